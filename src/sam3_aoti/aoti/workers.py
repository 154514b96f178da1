"""AOTInductor-compile every program of an exported archive, each in a worker process of its own (several at
once on a machine with the cores for it): what the `compile` and `compile_parts` stages share.

The workers die with the stage: each asks the kernel to kill it when the stage process ends (however it ends),
and a stage that stops early (an error, Ctrl-C) kills them rather than waiting for their compiles; doit kills
what is left of a stage's process group, and a next run kills what a killed run left (`tasks.runs`).
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import os
import signal
from concurrent.futures import ProcessPoolExecutor, as_completed
from multiprocessing import get_context
from pathlib import Path

from ..pipeline.artifacts import check_free_space, record
from ..pipeline.paths import ProfilePaths
from ..pipeline.settings import Settings
from ..runtime.files import atomic_output, human_size
from .compile import compile_program, compiled_names, platform_info, program_sizes, submission_order

log = logging.getLogger(__spec__.name)


def compile_workers(models: int, program_bytes: int, device: str, cores: int | None = None,
                    memory: int | None = None) -> int:
    """Compiles at once. On CUDA each is one busy core (Inductor's Python) with bursts of Triton workers, so a
    quarter of the cores; on the CPU each is one busy core and then one g++ of the kernels and wrapper (one
    file), so a core each. Each holds a program's weights, copied once more into its blob check, so no more
    than a third of the memory holds (at least one)."""
    cores = cores or os.cpu_count() or 1
    memory = memory or os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    per_core = 4 if device == "cuda" else 1
    return max(1, min(models, cores // per_core, memory // (3 * max(program_bytes, 1))))


def die_with(parent: int) -> None:
    """A worker's initializer: be killed when the stage process (`parent`) ends, however it ends (Linux's
    PR_SET_PDEATHSIG); if it already has, end now."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)
    except (OSError, AttributeError):
        pass
    if os.getppid() != parent:
        os._exit(1)


def kill_workers() -> None:
    """The stage stops early: its workers are killed, not waited for (a compile takes minutes)."""
    for worker in multiprocessing.active_children():
        worker.kill()


def inductor_cache() -> Path:
    """Inductor's cache folder without importing torch (doit sets it for every stage), so that the workers'
    imports and program loads start at once."""
    if os.environ.get("TORCHINDUCTOR_CACHE_DIR"):
        return Path(os.environ["TORCHINDUCTOR_CACHE_DIR"])
    from torch._inductor.runtime.cache_dir_utils import cache_dir

    return Path(cache_dir())


class stopping_kills_workers:
    """`with` the pool: its workers killed when the block ends, however it ends (KeyboardInterrupt included).
    After success every result is in: a worker's own exit (its GPU context, Inductor's pool of compile
    processes) took 7-8 s of the full-size build's critical path."""

    def __init__(self, pool: ProcessPoolExecutor):
        self.pool = pool

    def __enter__(self) -> ProcessPoolExecutor:
        return self.pool

    def __exit__(self, kind, *_) -> None:
        kill_workers()
        self.pool.shutdown(wait=kind is None, cancel_futures=True)


def compile_archive(settings: Settings, stage: str, toolchain: dict) -> None:
    """`stage` (`compile` or `compile_parts`): compile the programs of its archive (`ProfilePaths.compiled_archive`)
    into its folder (their files per model and an index.json that names the program digest it is for), and record
    the stage. `toolchain`: the compiler setup it ran with."""
    paths = ProfilePaths.of(settings)
    archive, expected, digest_path, dest = paths.compiled_archive(stage)
    weights = archive.stat().st_size  # about the weights' size: the exported programs are mostly that
    # AOTInductor writes its blob and code in its cache; `keep_compiled` rebuilds the blob here to check it.
    cache = inductor_cache()
    check_free_space({cache: int(1.2 * weights), paths.root: int(1.1 * weights)}, stage)
    inductor = dict(settings.stage("compile").get("inductor", {}))
    sdpa_backends = settings.stage("compile")["sdpa_backends"] if settings.device == "cuda" else None
    digest = json.loads(digest_path.read_text())
    tuning = None
    if settings.tuned:  # the tune stage's decisions into this compile's cache: it benchmarks nothing
        from .tuning import count_decisions, read_tuning, seed, tuning_key, tuning_options

        inductor = tuning_options(settings)
        tuned = read_tuning(paths, tuning_key(settings, tuned_digest(settings), platform_info(settings.device)))
        seeded = seed(paths.tuning / "results", cache)
        before = count_decisions(cache)
        log.info("tuned compile: %d tuning files from %s (%d GEMM layouts, %d kernel configs)", seeded,
                 paths.tuning, tuned["gemm_layouts"], tuned["kernel_configs"])
    sizes = program_sizes(archive)
    names = compiled_names(list(sizes), expected)
    # A worker holds at most the whole archive; with the parts, two compile stages share the machine at once.
    cores = max(1, (os.cpu_count() or 1) // (2 if settings.split else 1))
    workers = compile_workers(len(names), weights, settings.device, cores)
    pool = ProcessPoolExecutor(workers, get_context("spawn"), initializer=die_with, initargs=(os.getpid(),))
    with atomic_output(dest) as tmp, stopping_kills_workers(pool):
        log.info("AOTInductor compiling %s on %s, %d at a time (this is the slow part)", ", ".join(names),
                 settings.device, workers)
        jobs = {pool.submit(compile_program, str(archive), name, inductor, sdpa_backends, str(tmp / name)): name
                for name in submission_order(names, sizes)}
        index = {"program_sha256": digest["sha256"], "inductor_options": inductor, "sdpa_backends": sdpa_backends,
                 "platform": platform_info(settings.device), "models": {}, "compile_seconds": {},
                 "compile_phases": {}, "toolchain": toolchain}
        for job in as_completed(jobs):
            name = jobs[job]
            entry, index["compile_seconds"][name], index["compile_phases"][name] = job.result()
            index["models"][name] = entry
            phases = index["compile_phases"][name]
            code = sum((tmp / name / f).stat().st_size for f in entry["files"])
            log.info("compiled %s in %.1f s (%s); code %s, weights blob %s (rebuilt from the exported archive: "
                     "identical)", name, index["compile_seconds"][name],
                     ", ".join(f"{k} {v} s" for k, v in list(phases.items())[:4]), human_size(code),
                     human_size(entry["blob_bytes"]))
        index["models"] = {name: index["models"][name] for name in names}
        if settings.tuned:
            after = count_decisions(cache)
            tuning = {"tuning_index": str(paths.tuning_index.relative_to(paths.root)),
                      "benchmarked_now": {k: after[k] - before[k] for k in after}}
            index["tuning"] = tuning
            if any(tuning["benchmarked_now"].values()):
                log.warning("the tuning results lacked %s: this compile benchmarked them (`uv run doit tune` "
                            "again keeps them)", tuning["benchmarked_now"])
        (tmp / "index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    record(paths.manifest, stage, [dest / "index.json"], {
        "compile_seconds": index["compile_seconds"], "program_sha256": digest["sha256"], "tuning": tuning,
        **settings.fingerprint(stage, "compile"),
    })


def tuned_digest(settings: Settings) -> str:
    """What the tune stage tunes: every exported program, model's and transforms' and the parts'."""
    paths = ProfilePaths.of(settings)
    digests = [paths.program_digest, *([paths.parts_digest] if settings.split else [])]
    return "+".join(json.loads(p.read_text())["sha256"] for p in digests)

