"""Stage `fallback`: the programs exported again with this project's custom ops in the torch ops they compute
(`model.ops.torch_forms`), so the package's exported-program fallback deserializes where torch alone is installed.

A stage of its own, beside `compile` rather than before it: nothing that compile reads depends on it. The
portable `model` is checked against eager at the export's check shapes before it is kept (the `fallback_drift`
stage then measures the written file against eager on verify's inputs).
"""

from __future__ import annotations

import logging
import time

from ..errors import ExportError
from ..model.exporting import (check_against_eager, custom_ops_in, export_programs, export_subject, save_programs,
                               transforms_example)
from ..pipeline.artifacts import record
from ..pipeline.paths import ProfilePaths
from ..pipeline.settings import Settings
from ..runtime.files import atomic_output, human_size

log = logging.getLogger(__spec__.name)  # not __name__: run by `python -m`, a stage is "__main__"


def run(settings: Settings) -> None:
    from ..model.configs import example_inputs
    from ..model.grounding import ImageTransforms
    from ..model.ops import torch_forms

    paths, opts = ProfilePaths.of(settings), settings.stage("export")
    t0 = time.perf_counter()
    wrapper, example, device = export_subject(settings, "fallback")
    config = wrapper.model.config
    transforms = ImageTransforms(config.vision_config.backbone_config.image_size).eval()
    with torch_forms():
        fallback, _ = export_programs(wrapper, example, settings.split, transforms, transforms_example(opts, device))
    if left := {name: sorted(ops) for name, program in fallback.items() if (ops := custom_ops_in(program))}:
        raise ExportError(f"the fallback still calls {left}: call them through sam3_aoti.model.ops")
    log.info("exported with the custom ops in torch ops in %.1f s", time.perf_counter() - t0)
    args = example_inputs(config, opts["check_batch"], opts["check_prompts"], seed=2, device=device)
    diff = check_against_eager("model (portable)", fallback["model"].module(), wrapper, args,
                               settings.spec.export_atol)
    with atomic_output(paths.exported_portable) as tmp:
        save_programs(fallback, tmp)
    log.info("the fallback (loads with torch alone) in %.1f s: %s (%s; max |portable - eager| = %.3g)",
             time.perf_counter() - t0, paths.exported_portable.name,
             human_size(paths.exported_portable.stat().st_size), diff)
    record(paths.manifest, "fallback", [paths.exported_portable], settings.fingerprint("fallback", "export"))


if __name__ == "__main__":
    from ..pipeline.runner import main

    main("fallback", run, __doc__.splitlines()[0])
