"""Stage `tune`: Inductor's autotuning, run once per GPU model, torch/Triton version and graph, and kept.

max-autotune benchmarks Triton GEMM templates (with their epilogues fused) against cuBLAS for every GEMM
shape, and coordinate-descent tuning searches each Triton kernel's launch config: many minutes of GPU
benchmarks. This stage compiles every exported program once with `[tune] inductor` in an empty Inductor
cache and keeps only what the benchmarks decided (the GEMM choice timings, Inductor's `cache/<system>`
file, and each kernel's `.best_config`) in `tuning/results/`, with what they hold for in
`tuning/index.json` (the key). `compile` seeds its cache with them and compiles with the same options: it
benchmarks nothing, and says so in its index (`benchmarked_now`) when it had to. Triton's compiled
kernels go to the variant's own Inductor cache, which `compile` uses, so it does not compile them again.
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import time
from pathlib import Path

from ..aoti.tuning import count_decisions, harvest, keep_kernels, tuning_key, tuning_options
from ..errors import CompileError, ConfigError, first_line
from ..pipeline.artifacts import record
from ..pipeline.paths import ProfilePaths
from ..pipeline.settings import Settings
from ..runtime.files import atomic_output

log = logging.getLogger(__spec__.name)  # not __name__: run by `python -m`, a stage is "__main__"


def run(settings: Settings) -> None:
    from ..aoti.compile import (aoti_compile, check_constants_are_weights, check_inductor_options, compiled_names,
                                compiled_outputs, load_program, platform_info, program_names)
    from ..aoti.workers import tuned_digest
    from ..runtime.archive import MODEL_NAMES, PART_NAMES

    if not settings.tuned:
        raise ConfigError("tune runs on a GPU with [tune] enabled = true (pipeline.toml): nothing to tune here")
    paths = ProfilePaths.of(settings)
    key = tuning_key(settings, tuned_digest(settings), platform_info(settings.device))
    archives = [(paths.exported, MODEL_NAMES), *([(paths.exported_parts, PART_NAMES)] if settings.split else [])]
    options = tuning_options(settings)
    check_inductor_options(settings.stage("tune").get("inductor", {}), "[tune] inductor")
    seconds, phases = {}, {}
    with tempfile.TemporaryDirectory(prefix=".tune-cache.", dir=paths.root) as cache:
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = cache  # empty: every decision is benchmarked here, now
        for archive, name in [(a, n) for a, expected in archives for n in compiled_names(program_names(a), expected)]:
            log.info("tuning %s: a full compile that benchmarks every GEMM and kernel config (%s)", name, options)
            try:
                compiled = aoti_compile(load_program(archive, name), options, settings.stage("compile")["sdpa_backends"])
            except Exception as e:
                raise CompileError(f"tuning {name} failed: {first_line(e)} (set [tune] enabled = false to build "
                                   "without it)") from e
            seconds[name], phases[name] = compiled.seconds, compiled.phases
            log.info("tuned %s in %.1f s", name, seconds[name])
            _, _, constants = compiled_outputs(name, compiled.files)  # packageable with new weights?
            check_constants_are_weights(name, constants, archive)
        decisions = count_decisions(Path(cache))
        kernels = keep_kernels(Path(cache), paths.inductor_cache)
        log.info("%d files of Triton's compiled kernels into %s, for compile to load", kernels, paths.inductor_cache)
        with atomic_output(paths.tuning) as tmp:
            files = harvest(Path(cache), tmp / "results")
            index = {"key": key, "tune_seconds": seconds, "tune_phases": phases, "files": files, **decisions,
                     "date": time.strftime("%Y-%m-%d")}
            (tmp / "index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    log.info("kept %d GEMM layouts and %d kernel configs (%d files) in %s", decisions["gemm_layouts"],
             decisions["kernel_configs"], files, paths.tuning)
    record(paths.manifest, "tune", [paths.tuning], {"tune_seconds": seconds, **decisions,
                                                    **settings.fingerprint("tune", "compile")})


if __name__ == "__main__":
    from ..pipeline.runner import main

    main("tune", run, __doc__.splitlines()[0])
