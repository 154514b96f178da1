"""Stage `bench`: latency of eager transformers vs the exported program vs the AOTI package, and how long
each kind of consumer takes to load the package.

Median of timed calls after warm-up (CUDA events on the GPU, wall clock on the CPU) at each (B, P) in
`[bench] shapes`; load times in a fresh process per consumer (page cache warm, device initialized first);
writes bench.json and a markdown table. A benchmark, not a gate: it never fails on speed.
"""

from __future__ import annotations

import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .artifacts import record, write_text_atomic
from .config import Settings
from .paths import ProfilePaths

log = logging.getLogger("sam3_aoti")


def time_calls(fn, args, device: str, warmup: int, iters: int) -> list[float]:
    """Milliseconds per call."""
    import torch

    with torch.no_grad():
        for _ in range(warmup):
            fn(*args)
        times = []
        for _ in range(iters):
            if device == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn(*args)
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn(*args)
                times.append((time.perf_counter() - t0) * 1e3)
    return times


# How each consumer loads a package: ours, torch's by name, and `load_pt2` as a production loader calls it;
# torch's two again with its CPU vector-ISA probe switched off (TORCHINDUCTOR_VEC_ISA_OK=0), which costs
# 20-40 s per process on the H200 before any byte of the package is read.
TORCH_LOAD = "from torch._inductor.package import load_package\nload = lambda p: load_package(p, '{}')"
PT2_LOAD = "from torch.export.pt2_archive._package import load_pt2\nload = lambda p: load_pt2(p)"
NO_ISA_PROBE = {"TORCHINDUCTOR_VEC_ISA_OK": "0"}
OURS = "from sam3_aoti.package import load_package\nload = lambda p: load_package(p)"
LOADERS = {  # ours twice: the first start hashes the package, the next finds that check remembered
    "sam3_aoti load_package, first start": (OURS, {}),
    "sam3_aoti load_package, next start": (OURS, {}),
    "torch load_package model": (TORCH_LOAD.format("model"), {}),
    "torch load_package transforms": (TORCH_LOAD.format("transforms"), {}),
    "load_pt2": (PT2_LOAD, {}),
    "torch load_package model, no ISA probe": (TORCH_LOAD.format("model"), NO_ISA_PROBE),
    "load_pt2, no ISA probe": (PT2_LOAD, NO_ISA_PROBE),
}
LOAD_SCRIPT = """
import json, sys, time, torch
{loader}
if sys.argv[2] == "cuda":
    torch.zeros(1, device="cuda")  # a service has its CUDA context before it loads a model
t0 = time.perf_counter()
load(sys.argv[1])
print(json.dumps(time.perf_counter() - t0))
"""


def load_seconds(package, device: str) -> dict[str, float]:
    """Seconds each consumer takes to load `package`, each in a fresh process, after one read of the
    file so the page cache is warm (as on a service's second start)."""
    with open(package, "rb") as f:
        while f.read(1 << 26):
            pass
    src = str(Path(__file__).resolve().parents[1])  # this checkout's library for the first loader
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")]))}
    times = {}
    with tempfile.TemporaryDirectory() as cache:  # an empty record of checked packages (integrity.py)
        env["SAM3_AOTI_CACHE"] = cache
        for name, (loader, extra_env) in LOADERS.items():
            times.update(_load_in_fresh_process(name, loader, package, device, {**env, **extra_env}))
    return times


def _load_in_fresh_process(name, loader, package, device, env) -> dict[str, float]:
    proc = subprocess.run([sys.executable, "-c", LOAD_SCRIPT.format(loader=loader), str(package), device],
                          capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        log.warning("%s could not load the package: %s", name, (proc.stderr.strip().splitlines() or ["?"])[-1])
        return {}
    seconds = round(json.loads(proc.stdout.strip().splitlines()[-1]), 2)
    log.info("load: %s %.2f s", name, seconds)
    return {name: seconds}


def run(settings: Settings) -> None:
    import torch

    from .model import example_inputs
    from .weights import eager_reference
    from .package import load_package

    paths, opts = ProfilePaths.of(settings), settings.stage("bench")
    package = load_package(paths.package)
    loads = load_seconds(paths.package, settings.device)
    t0 = time.perf_counter()
    exported = package.exported_only()
    fallback_s = time.perf_counter() - t0
    log.info("load: exported-program fallback %.2f s", fallback_s)
    eager, _ = eager_reference(settings)
    backends = {"eager": eager, "exported": exported.model, "aoti": package.model}
    rows = []
    for b, p in opts["shapes"]:
        args = example_inputs(eager.model.config, b, p, device=settings.device)
        row = {"batch": b, "prompts": p}
        for name, fn in backends.items():
            ms = time_calls(fn, args, settings.device, opts["warmup"], opts["iters"])
            row[f"{name}_ms"] = round(statistics.median(ms), 2)
        row["aoti_speedup"] = round(row["eager_ms"] / row["aoti_ms"], 2)
        log.info("B=%d P=%d: eager %.1f ms, exported %.1f ms, AOTI %.1f ms (x%.2f)", b, p, row["eager_ms"],
                 row["exported_ms"], row["aoti_ms"], row["aoti_speedup"])
        rows.append(row)
        if settings.device == "cuda":
            torch.cuda.empty_cache()
    info = {"device": settings.device, "precision": settings.precision, "weights": settings.weights,
            "package_bytes": paths.package.stat().st_size, "fallback_bytes": paths.fallback_package.stat().st_size,
            "load_seconds": loads, "fallback_load_seconds": round(fallback_s, 2),
            "gpu": torch.cuda.get_device_name(0) if settings.device == "cuda" else None,
            "torch": torch.__version__, "warmup": opts["warmup"], "iters": opts["iters"], "rows": rows}
    write_text_atomic(paths.bench_json, json.dumps(info, indent=2) + "\n")
    lines = [f"# Bench: {settings.profile} on {info['gpu'] or 'cpu'} ({settings.precision})", "",
             f"Median of {opts['iters']} calls after {opts['warmup']} warm-up.", "",
             f"Package {info['package_bytes'] / 1e9:.2f} GB, fallback beside it {info['fallback_bytes'] / 1e9:.2f} GB. "
             "Load, fresh process each: " + ", ".join(f"{k} {v:.2f} s" for k, v in loads.items())
             + f"; exported-program fallback {fallback_s:.1f} s.", "",
             "| B | P | eager ms | exported ms | AOTI ms | AOTI speed-up |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['batch']} | {r['prompts']} | {r['eager_ms']} | {r['exported_ms']} | {r['aoti_ms']} | "
              f"{r['aoti_speedup']}x |" for r in rows]
    write_text_atomic(paths.bench_md, "\n".join(lines) + "\n")
    record(paths.manifest, "bench", [paths.bench_json, paths.bench_md], settings.fingerprint("bench"))
    log.info("table: %s", paths.bench_md)


if __name__ == "__main__":
    from .stage import main

    main("bench", run, __doc__.splitlines()[0])
