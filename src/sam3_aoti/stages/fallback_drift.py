"""Stage `fallback_drift`: the exported fallback, read back from its file as the runtime reads a package's
fallback, measured against eager on every input verify compares (`measure.drift`; eager's outputs from the
`reference` stage's cache), beside the compile.

At full size, loading the fallback was most of verify's wait after the package (its programs read 22-28 s on the
H100). Verify gates these numbers where the fallback beside the package is this very file (its sha256), the
inputs and eager are the same (`measure.drift.fallback_key`); otherwise it loads and measures the fallback itself.
A stage of its own, not part of `fallback`: editing the runtime's loader reruns this one, not the re-export.
"""

from __future__ import annotations

import functools
import json
import logging
import time

from ..measure.drift import fallback_key, measure_drift
from ..pipeline.artifacts import record, recorded_sha256
from ..pipeline.paths import ProfilePaths
from ..pipeline.settings import Settings, compared_shapes
from ..runtime.files import write_text_atomic

log = logging.getLogger(__spec__.name)  # not __name__: run by `python -m`, a stage is "__main__"


def run(settings: Settings) -> None:
    from ..model.checkpoints import eager_reference, reference_transforms
    from ..model.reference import ReferenceCache
    from ..pipeline.cases import load_cases
    from ..pipeline.package_metadata import exported_signatures, interface_metadata
    from ..pipeline.precision import without_tf32
    from ..runtime.archive import PART_NAMES
    from ..runtime.loader import programs_package
    from ..runtime.torch_private import exported_programs

    paths = ProfilePaths.of(settings)
    cases = load_cases()
    without_tf32(settings.spec)  # the fallback's convolutions in real fp32, as eager's were
    t0 = time.perf_counter()
    with open(paths.exported_portable, "rb") as file:
        programs = exported_programs(file)
    log.info("read %s in %.1f s", paths.exported_portable.name, time.perf_counter() - t0)
    program = exported_signatures(paths, settings.split)
    metadata = interface_metadata(settings, program, [name for name in PART_NAMES if name in programs])
    fallback = programs_package(programs, metadata, paths.tokenizer_merges.read_text(), paths.exported_portable)
    cache = ReferenceCache.of(settings)
    eager = functools.cache(lambda: eager_reference(settings)[0])  # only for an input the reference stage lacks
    records = measure_drift(settings, {"exported": fallback}, eager, reference_transforms(settings), cases, cache)
    key = fallback_key(settings, recorded_sha256(paths.manifest, paths.exported_portable), cache)
    write_text_atomic(paths.fallback_drift, json.dumps({"key": key, "records": records}, indent=1) + "\n")
    log.info("measured against eager in %.1f s: %d runs on %d inputs (%d of eager's from the reference cache)",
             time.perf_counter() - t0, sum("metrics" in r for r in records), len(cache.used), cache.hits)
    record(paths.manifest, "fallback_drift", [paths.fallback_drift],
           {"inputs": compared_shapes(settings), **settings.fingerprint("fallback_drift")})


if __name__ == "__main__":
    from ..pipeline.runner import main

    main("fallback_drift", run, __doc__.splitlines()[0])
