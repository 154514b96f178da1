"""Inductor's autotuning decisions as files: harvested from a tuning compile's cache, keyed, and seeded into a
later compile's cache so that it benchmarks nothing."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

from ..errors import CompileError
from ..pipeline.paths import ProfilePaths
from ..pipeline.settings import Settings

GEMM_CHOICES = "cache"  # Inductor's PersistentCache: cache/<hash of GPU name, Triton and CUDA versions>


BEST_CONFIG = ".best_config"  # beside each generated kernel: <cache>/<2 chars>/<kernel hash>.best_config


def tuning_options(settings: Settings) -> dict:
    """Inductor options of a tuned compile: [compile] inductor, then [tune] inductor over it."""
    return {**settings.stage("compile").get("inductor", {}), **settings.stage("tune").get("inductor", {})}


def tuning_key(settings: Settings, program_sha256: str, platform: dict) -> dict:
    """What tuning results hold for: the GPU model, the versions that generate and time kernels, the graph
    and the options. Results for another key are never used."""
    return {"gpu": platform.get("gpu"), "torch": platform["torch"], "triton": platform["triton"],
            "cuda": platform["cuda"], "program_sha256": program_sha256, "inductor": tuning_options(settings)}


def tuned_files(cache: Path) -> list[Path]:
    """The files of an Inductor cache that hold autotuning decisions, relative to it."""
    choices = [p for p in (cache / GEMM_CHOICES).glob("*") if p.is_file()]
    configs = [p for p in cache.rglob(f"*{BEST_CONFIG}") if p.is_file()]
    return sorted(p.relative_to(cache) for p in choices + configs)


def count_decisions(cache: Path) -> dict:
    """What an Inductor cache has decided by benchmarks: GEMM (op, input layout) entries timed (`{op: {layout:
    {precision: {choice: ms}}}}`), pad-mm decisions and timings (one value per key, in the same file), and
    kernels with a tuned launch config."""
    gemms = padding = 0
    for path in (cache / GEMM_CHOICES).glob("*"):
        try:
            table = json.loads(path.read_text()).get("cache", {})
        except (OSError, ValueError):
            continue
        gemms += sum(len(layouts) for layouts in table.values() if isinstance(layouts, dict))
        padding += sum(1 for value in table.values() if not isinstance(value, dict))
    return {"gemm_layouts": gemms, "padding_decisions": padding,
            "kernel_configs": sum(1 for _ in cache.rglob(f"*{BEST_CONFIG}"))}


def harvest(cache: Path, dest: Path) -> int:
    """Copy the tuning decisions of `cache` to `dest` (same relative paths); returns how many files."""
    files = tuned_files(cache)
    for rel in files:
        (dest / rel).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(cache / rel, dest / rel)
    return len(files)


def keep_kernels(cache: Path, dest: Path) -> int:
    """Triton's compiled kernels from the tuning's cache into `dest`, the Inductor cache `compile` uses: the
    tuned compile generates the same kernels, so it loads them instead of compiling them again. Triton names
    each kernel's folder by a hash of its source, options, Triton version and GPU, so merging is safe (a
    kernel already there is the same kernel). Returns how many files were added."""
    added = 0
    for src in (cache / "triton").rglob("*"):
        dst = dest / src.relative_to(cache)
        if src.is_file() and not dst.exists():
            dst.parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst)
            added += 1
    return added


def seed(results: Path, cache: Path) -> int:
    """Put tuning decisions into an Inductor cache: kernel configs copied, the GEMM timings merged into a
    timing file already there (the tuned entries win). Returns how many files were written."""
    written = 0
    for rel in tuned_files(results):
        src, dst = results / rel, cache / rel
        dst.parent.mkdir(parents=True, exist_ok=True)
        if rel.parts[0] == GEMM_CHOICES and dst.exists():
            mine, theirs = json.loads(dst.read_text()), json.loads(src.read_text())
            merged = _merge(mine.get("cache", {}), theirs.get("cache", {}))
            tmp = dst.with_name(dst.name + ".seeding")
            tmp.write_text(json.dumps({**theirs, "cache": merged}, indent=1))
            os.replace(tmp, dst)
        else:
            shutil.copy2(src, dst)
        written += 1
    return written


def _merge(base: dict, over: dict) -> dict:
    out = dict(base)
    for key, value in over.items():
        out[key] = _merge(out[key], value) if isinstance(value, dict) and isinstance(out.get(key), dict) else value
    return out


def read_tuning(paths: ProfilePaths, key: dict) -> dict:
    """The tuning index, if its key is this compile's; a clear error otherwise."""
    if not paths.tuning_index.exists():
        raise CompileError(f"no tuning results at {paths.tuning}: run `uv run doit tune` (or set [tune] enabled = false)")
    index = json.loads(paths.tuning_index.read_text())
    stale = [k for k in key if index.get("key", {}).get(k) != key[k]]
    if stale:
        raise CompileError(f"the tuning results in {paths.tuning} are for another {', '.join(stale)}: "
                           "run `uv run doit tune` to tune again")
    return index
