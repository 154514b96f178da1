"""Timed calls: median and p90 after warm-up (CUDA events on the GPU, wall clock on the CPU), peak memory,
and the fairness rules of a multi-column benchmark (every column warm at every shape, rotated order)."""

from __future__ import annotations

import statistics
import time


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


def p90(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.9 * (len(ordered) - 1)))]


def measure(fn, args, device: str, warmup: int, iters: int) -> dict:
    """Median and p90 ms and the peak memory the calls took beyond what was allocated before (CUDA)."""
    import torch

    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    ms = time_calls(fn, args, device, warmup, iters)
    peak = (torch.cuda.max_memory_allocated() - before) / 2**20 if device == "cuda" else None
    return {"median_ms": round(statistics.median(ms), 2), "p90_ms": round(p90(ms), 2),
            "peak_mib": round(peak, 1) if peak is not None else None}


def warm_up(shapes: list, calls_at, warmup: int) -> None:
    """Every column's warm-up at every shape before any is timed: the first shape a column runs pays for its
    one-time work (kernel loads, allocator growth, autotuning), which no row should carry."""
    import torch

    with torch.no_grad():
        for shape in shapes:
            for fn, args in calls_at(shape).values():
                for _ in range(max(warmup, 1)):
                    fn(*args)


def rotated(names: list, index: int) -> list:
    """The columns in the order row `index` times them: each row starts one column later, so no column is
    always first (or always after the slowest)."""
    k = index % len(names) if names else 0
    return names[k:] + names[:k]
