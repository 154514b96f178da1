"""Stage `fallback`: the exported programs with this project's custom ops written out in torch ops, so the
package's exported-program fallback deserializes where torch alone is installed.

A stage of its own, beside `compile` rather than before it: writing the ops out (`run_decompositions`) is minutes at
full size, and nothing that compile reads depends on it. The portable `model` is checked against eager at the
export's check shapes before it is kept.
"""

from __future__ import annotations

import logging
import time

from ..model.exporting import check_against_eager, load_programs, portable, save_programs
from ..pipeline.artifacts import record
from ..pipeline.paths import ProfilePaths
from ..pipeline.settings import Settings
from ..runtime.files import atomic_output, human_size

log = logging.getLogger(__spec__.name)  # not __name__: run by `python -m`, a stage is "__main__"


def run(settings: Settings) -> None:
    import torch

    from ..model.checkpoints import load_model
    from ..model.configs import example_inputs
    from ..model.grounding import Sam3Grounding

    paths, opts = ProfilePaths.of(settings), settings.stage("export")
    t0 = time.perf_counter()
    programs = load_programs(paths.exported)
    fallback = portable(programs)
    for name, program in fallback.items():  # constants in the exported program's order: the same archive as ever
        program._constants = {key: program.constants[key] for key in programs[name].constants}
    log.info("custom ops written in torch ops in %.1f s", time.perf_counter() - t0)
    device = torch.device(settings.device)
    model = load_model(settings).to(device)
    wrapper = Sam3Grounding.built_as(model, settings)
    args = example_inputs(model.config, opts["check_batch"], opts["check_prompts"], seed=2, device=device)
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
