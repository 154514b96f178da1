"""Stage `compile`: AOTInductor-compile both exported programs into code that holds no weights.

The compiled files depend on the program digest (graphs, signatures, weight layouts), never on the
weights' values: every tensor stays a constant of the model (none is inlined into a kernel) and the
constants live in a separate blob, which the `package` stage rebuilds from whatever weights the exported
programs hold. A new seed or checkpoint of the same architecture so re-packages in seconds, without
running AOTInductor again.
"""

from __future__ import annotations

import json
import logging
import os
from pathlib import Path

from ..aoti.compile import aoti_compile, check_inductor_options, keep_compiled, platform_info
from ..errors import CompileError, first_line
from ..pipeline.artifacts import check_free_space, record
from ..pipeline.paths import ProfilePaths, ToolchainPaths, portable
from ..pipeline.settings import Settings
from ..runtime.files import atomic_output, human_size
from ..toolchain.cuda_env import FIX_VARIABLE, read_build_facts

log = logging.getLogger(__spec__.name)  # not __name__: run by `python -m`, a stage is "__main__"


def run(settings: Settings) -> None:
    from torch._inductor.runtime.cache_dir_utils import cache_dir
    from torch.export.pt2_archive._package import load_pt2

    paths = ProfilePaths.of(settings)
    weights = paths.exported.stat().st_size  # about the weights' size: the exported programs are mostly that
    # AOTInductor writes its blob and code in its cache; `keep_compiled` rebuilds the blob here to check it.
    cache = Path(cache_dir())
    check_free_space({cache: int(1.2 * weights), paths.root: int(1.1 * weights)}, "compile")
    inductor = dict(settings.stage("compile").get("inductor", {}))
    check_inductor_options(inductor, "[compile] inductor")
    sdpa_backends = settings.stage("compile")["sdpa_backends"] if settings.device == "cuda" else None
    digest = json.loads(paths.program_digest.read_text())
    platform = platform_info(settings.device)
    tuning = None
    if settings.tuned:  # the tune stage's decisions into this compile's cache: it benchmarks nothing
        from ..aoti.tuning import count_decisions, read_tuning, seed, tuning_key, tuning_options

        inductor = tuning_options(settings)
        tuned = read_tuning(paths, tuning_key(settings, digest["sha256"], platform))
        seeded = seed(paths.tuning / "results", cache)
        before = count_decisions(cache)
        log.info("tuned compile: %d tuning files from %s (%d GEMM layouts, %d kernel configs)", seeded,
                 paths.tuning, tuned["gemm_layouts"], tuned["kernel_configs"])
    programs = load_pt2(str(paths.exported)).exported_programs
    index = {"program_sha256": digest["sha256"], "inductor_options": inductor, "sdpa_backends": sdpa_backends,
             "platform": platform, "models": {}, "compile_seconds": {}, "compile_phases": {},
             "toolchain": {**{k: portable(os.environ.get(k)) for k in ("CUDA_HOME", "CXX", FIX_VARIABLE)},
                           "build": read_build_facts(ToolchainPaths.of(settings).env_file)}}
    with atomic_output(paths.compiled) as tmp:
        for name in ("model", "transforms"):
            log.info("AOTInductor compiling %s on %s (this is the slow part)", name, settings.device)
            try:
                compiled = aoti_compile(programs[name], inductor, sdpa_backends)
            except Exception as e:
                raise CompileError(f"AOTInductor failed on {name}: {first_line(e)} "
                                   "(run `uv run doit toolchain` to check the compiler setup)") from e
            index["compile_seconds"][name], index["compile_phases"][name] = compiled.seconds, compiled.phases
            log.info("compiled %s in %.1f s (%s)", name, compiled.seconds,
                     ", ".join(f"{k} {v} s" for k, v in list(compiled.phases.items())[:6]))
            index["models"][name] = keep_compiled(name, compiled.files, paths.exported, tmp / name)
            code = sum((tmp / name / f).stat().st_size for f in index["models"][name]["files"])
            log.info("%s: code %s, weights blob %s (rebuilt from the exported archive: identical)", name,
                     human_size(code), human_size(index["models"][name]["blob_bytes"]))
        if settings.tuned:
            after = count_decisions(cache)
            tuning = {"tuning_index": str(paths.tuning_index.relative_to(paths.root)),
                      "benchmarked_now": {k: after[k] - before[k] for k in after}}
            index["tuning"] = tuning
            if any(tuning["benchmarked_now"].values()):
                log.warning("the tuning results lacked %s: this compile benchmarked them (`uv run doit tune` "
                            "again keeps them)", tuning["benchmarked_now"])
        (tmp / "index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    record(paths.manifest, "compile", [paths.compiled_index], {
        "compile_seconds": index["compile_seconds"], "program_sha256": digest["sha256"], "tuning": tuning,
        **settings.fingerprint("compile"),
    })


if __name__ == "__main__":
    from ..pipeline.runner import main

    main("compile", run, __doc__.splitlines()[0])
