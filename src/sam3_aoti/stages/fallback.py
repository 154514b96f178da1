"""Stage `fallback`: the programs exported again with this project's custom ops in the torch ops they compute
(`model.ops.torch_forms`), so the package's exported-program fallback deserializes where torch alone is installed.

A stage of its own, beside `compile` rather than before it: nothing that compile reads depends on it. The
portable `model` is checked against eager at the export's check shapes before it is kept. Then the programs are
read back from the file, as the runtime reads a package's fallback, and measured against eager on every input
verify compares (`measure.drift`, eager's outputs from the `reference` stage): verify, after the package, gates
these numbers where the package holds this very file, instead of loading the fallback itself.
"""

from __future__ import annotations

import functools
import logging
import time

from ..errors import ExportError
from ..model.exporting import check_against_eager, custom_ops_in, export_programs, save_programs, transforms_example
from ..pipeline.artifacts import record
from ..pipeline.paths import ProfilePaths
from ..pipeline.settings import Settings, compared_shapes
from ..runtime.files import atomic_output, human_size, sha256, write_text_atomic

log = logging.getLogger(__spec__.name)  # not __name__: run by `python -m`, a stage is "__main__"


def run(settings: Settings) -> None:
    import torch

    from ..model.checkpoints import load_model
    from ..model.configs import example_inputs
    from ..model.grounding import ImageTransforms, Sam3Grounding
    from ..model.ops import torch_forms

    paths, opts = ProfilePaths.of(settings), settings.stage("export")
    t0 = time.perf_counter()
    device = torch.device(settings.device)
    model = load_model(settings).to(device)
    wrapper = Sam3Grounding.built_as(model, settings)
    example = example_inputs(model.config, opts["example_batch"], opts["example_prompts"], device=device)
    transforms = ImageTransforms(model.config.vision_config.backbone_config.image_size).eval()
    with torch_forms():
        fallback, _ = export_programs(wrapper, example, settings.profile in opts.get("split", []), transforms,
                                      transforms_example(opts, device))
    if left := {name: sorted(ops) for name, program in fallback.items() if (ops := custom_ops_in(program))}:
        raise ExportError(f"the fallback still calls {left}: call them through sam3_aoti.model.ops")
    log.info("exported with the custom ops in torch ops in %.1f s", time.perf_counter() - t0)
    args = example_inputs(model.config, opts["check_batch"], opts["check_prompts"], seed=2, device=device)
    diff = check_against_eager("model (portable)", fallback["model"].module(), wrapper, args,
                               settings.spec.export_atol)
    with atomic_output(paths.exported_portable) as tmp:
        save_programs(fallback, tmp)
    log.info("the fallback (loads with torch alone) in %.1f s: %s (%s; max |portable - eager| = %.3g)",
             time.perf_counter() - t0, paths.exported_portable.name,
             human_size(paths.exported_portable.stat().st_size), diff)
    del fallback, wrapper, model  # the programs are read back from the file: what the package will hold
    measure_fallback(settings, paths)
    record(paths.manifest, "fallback", [paths.exported_portable, paths.fallback_drift],
           {"inputs": compared_shapes(settings), **settings.fingerprint("fallback", "export")})


def measure_fallback(settings: Settings, paths: ProfilePaths) -> None:
    """The written fallback, read back, against eager on verify's inputs: `export/fallback_drift.json`, with the
    key verify checks before it uses the numbers (`measure.drift.fallback_key`)."""
    import json

    from ..measure.drift import fallback_key, measure_drift
    from ..model.checkpoints import eager_reference, reference_transforms
    from ..model.reference import ReferenceCache
    from ..pipeline.cases import load_cases
    from ..pipeline.package_metadata import interface_metadata
    from ..runtime.archive import PART_NAMES
    from ..runtime.loader import programs_package
    from ..runtime.torch_private import exported_programs

    t0 = time.perf_counter()
    with open(paths.exported_portable, "rb") as file:
        programs = exported_programs(file)
    log.info("read the fallback back in %.1f s", time.perf_counter() - t0)
    program = json.loads(paths.program_digest.read_text())
    metadata = interface_metadata(settings, program, [name for name in PART_NAMES if name in programs])
    fallback = programs_package(programs, metadata, paths.tokenizer_merges.read_text(), paths.exported_portable)
    cache = ReferenceCache.of(settings)
    eager = functools.cache(lambda: eager_reference(settings)[0])  # only for an input the reference stage lacks
    records = measure_drift(settings, {"exported": fallback}, eager, reference_transforms(settings), load_cases(),
                            cache)
    key = fallback_key(settings, sha256(paths.exported_portable), cache)
    write_text_atomic(paths.fallback_drift, json.dumps({"key": key, "records": records}, indent=1) + "\n")
    log.info("measured against eager in %.1f s: %d runs on %d inputs (%d of eager's from the reference cache)",
             time.perf_counter() - t0, sum("metrics" in r for r in records), len(cache.used), cache.hits)


if __name__ == "__main__":
    from ..pipeline.runner import main

    main("fallback", run, __doc__.splitlines()[0])
