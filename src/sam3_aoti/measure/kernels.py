"""Where a call's GPU time goes, from torch.profiler: time per kernel category, launches, idle time, and the
costliest kernels by name."""

from __future__ import annotations

KERNEL_CATEGORIES = (  # first match wins, on the lower-cased kernel name
    ("attention (SDPA)", ("flash", "fmha", "attention", "cudnn_generated", "sdpa")),
    ("GEMM", ("gemm", "nvjet", "cutlass", "xmma", "matmul", "wgmma", "splitk")),
    ("convolution", ("conv", "implicit", "winograd", "dgrad", "wgrad")),
    ("Triton (fused pointwise/reductions)", ("triton",)),
    ("copies", ("copy", "memcpy", "memset", "cat")),
)


def profiled_kernels(fn, args, calls: int = 5) -> tuple[list[tuple[str, float]], float]:
    """Every GPU kernel of `calls` calls of `fn` (torch.profiler; copies and memsets left out) as (name, ms),
    and the calls' wall time in ms (CUDA events)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad():
        fn(*args)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            start.record()
            for _ in range(calls):
                fn(*args)
            end.record()
            torch.cuda.synchronize()
    kernels = [(event.name, event.time_range.elapsed_us() / 1e3) for event in prof.events()
               if event.device_type == torch.autograd.DeviceType.CUDA
               and not event.name.startswith(("Memcpy", "Memset"))]
    return kernels, start.elapsed_time(end)


def kernel_breakdown(fn, args, calls: int = 5) -> dict:
    """GPU time per kernel category and launches, per call, from torch.profiler over `calls` calls."""
    kernels, wall = profiled_kernels(fn, args, calls)
    categories: dict[str, float] = {}
    for name, ms in kernels:
        lower = name.lower()
        category = next((c for c, keys in KERNEL_CATEGORIES if any(k in lower for k in keys)), "other")
        categories[category] = categories.get(category, 0.0) + ms
    per_call = {c: round(ms / calls, 2) for c, ms in sorted(categories.items(), key=lambda kv: -kv[1])}
    busy = sum(per_call.values())
    return {"kernel_ms_per_call": per_call, "launches_per_call": round(len(kernels) / calls),
            "wall_ms_per_call": round(wall / calls, 2), "gpu_idle_ms_per_call": round(max(wall / calls - busy, 0.0), 2)}


def top_kernels(fn, args, count: int, calls: int = 5) -> dict:
    """The `count` kernels that take most GPU time per call of `fn`, by name, with their launches per call."""
    kernels, wall = profiled_kernels(fn, args, calls)
    by_name: dict[str, list[float]] = {}
    for name, ms in kernels:
        by_name.setdefault(name, []).append(ms)
    ranked = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))
    return {"kernel_ms_per_call": round(sum(ms for _, ms in kernels) / calls, 3),
            "launches_per_call": round(len(kernels) / calls), "wall_ms_per_call": round(wall / calls, 3),
            "top": [{"kernel": name[:160], "ms_per_call": round(sum(times) / calls, 4),
                     "launches_per_call": round(len(times) / calls, 1)} for name, times in ranked[:count]]}
