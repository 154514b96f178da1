"""Stage `bench`: latency of eager transformers vs the exported program vs the AOTI package.

Median of timed calls after warm-up (CUDA events on the GPU, wall clock on the CPU) at each (B, P) in
`[bench] shapes`; writes bench.json and a markdown table. A benchmark, not a gate: it never fails on speed.
"""

from __future__ import annotations

import json
import logging
import statistics
import time

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


def run(settings: Settings) -> None:
    import torch

    from .model import eager_reference, example_inputs
    from .package import load_package

    paths, opts = ProfilePaths.of(settings), settings.stage("bench")
    t0 = time.perf_counter()
    package = load_package(paths.package)
    load_s = time.perf_counter() - t0
    eager, _ = eager_reference(settings)
    backends = {"eager": eager, "exported": package.exported_only().model, "aoti": package.model}
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
            "package_bytes": paths.package.stat().st_size, "package_load_seconds": round(load_s, 2),
            "gpu": torch.cuda.get_device_name(0) if settings.device == "cuda" else None,
            "torch": torch.__version__, "warmup": opts["warmup"], "iters": opts["iters"], "rows": rows}
    write_text_atomic(paths.bench_json, json.dumps(info, indent=2) + "\n")
    lines = [f"# Bench: {settings.profile} on {info['gpu'] or 'cpu'} ({settings.precision})", "",
             f"Median of {opts['iters']} calls after {opts['warmup']} warm-up; package load {load_s:.1f} s.", "",
             "| B | P | eager ms | exported ms | AOTI ms | AOTI speed-up |", "|---|---|---|---|---|---|"]
    lines += [f"| {r['batch']} | {r['prompts']} | {r['eager_ms']} | {r['exported_ms']} | {r['aoti_ms']} | "
              f"{r['aoti_speedup']}x |" for r in rows]
    write_text_atomic(paths.bench_md, "\n".join(lines) + "\n")
    record(paths.manifest, "bench", [paths.bench_json, paths.bench_md], settings.fingerprint("bench"))
    log.info("table: %s", paths.bench_md)


if __name__ == "__main__":
    from .stage import main

    main("bench", run, __doc__.splitlines()[0])
