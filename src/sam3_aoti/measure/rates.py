"""The card's own rates, measured in the run that uses them: memory copy (GB/s) and bf16 GEMM (TFLOP/s)."""

from __future__ import annotations

import statistics

from .timing import time_calls


def copy_gbps(iters: int = 10) -> float:
    """The card's memory rate in this run: bytes read and written by a 2 GiB device-to-device copy, median of
    `iters`, in GB/s (what a part that only streams its weights could reach)."""
    import torch

    src = torch.empty(1 << 30, dtype=torch.int16, device="cuda")
    dst = torch.empty_like(src)
    ms = statistics.median(time_calls(dst.copy_, (src,), "cuda", 3, iters))
    return round(2 * src.nbytes / (ms * 1e-3) / 1e9, 1)


def gemm_tflops(iters: int = 10) -> float:
    """The card's bf16 GEMM rate in this run: an 8192^3 product on random data, median of `iters`."""
    import torch

    a, b = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    ms = statistics.median(time_calls(torch.matmul, (a, b), "cuda", 3, iters))
    return round(2 * 8192**3 / (ms * 1e-3) / 1e12, 1)


def floor(flop: int, weight_bytes: int, gemm_tflops: float, memory_gbps: float) -> dict:
    """A part's floor: its FLOPs at the card's GEMM rate or its weights read once at its memory rate, whichever
    takes longer (a lower bound: activations are not counted), in ms, and which of the two it is."""
    flop_ms, weights_ms = flop / (gemm_tflops * 1e9), weight_bytes / (memory_gbps * 1e6)
    return {"floor_ms": round(max(flop_ms, weights_ms), 4), "floor_of": "FLOPs" if flop_ms >= weights_ms else "weights"}
