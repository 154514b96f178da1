#!/usr/bin/env python3
"""Launch shapes of the op `sam3_aoti::fp8_linear_rope`'s kernel (`vit_qkv_rope`) on a windowed ViT layer's q, k, v
projection at 16 images (82,944 tokens, 1024 -> 3072, 576 positions), each timed (median ms of 30 calls, CUDA
events), beside cuBLAS's rowwise fp8 GEMM of the same product with its bias and no rotation (`torch._scaled_mm`):
how far the Triton GEMM is from the card's fp8 rate. Prints one line a shape.

Usage: scripts/gpu_run.sh --python experiments/fp8_qkv_rope_launches.py     (a Hopper GPU)
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402

from sam3_aoti.model.fp8 import quantize_rows  # noqa: E402
from sam3_aoti.runtime.fp8_linear import launch_linear_rope  # noqa: E402

from fp8_qkv_rope import timed  # noqa: E402  (this folder's: run as a script, it is on sys.path)

# (block_m, block_n, block_k, num_warps, num_stages); the first is the op's own (fp8_linear.LAUNCH)
LAUNCHES = [(128, 256, 128, 8, 3), (128, 256, 128, 8, 4), (128, 128, 128, 4, 4), (128, 128, 128, 8, 4),
            (256, 128, 128, 8, 3), (128, 256, 64, 8, 4), (128, 128, 64, 4, 5), (64, 256, 128, 4, 4)]


def main() -> None:
    torch.manual_seed(0)
    weight, weight_scales = quantize_rows(torch.randn(3072, 1024, device="cuda") * 0.03)
    weight_scales = weight_scales.t().contiguous()
    bias = (torch.randn(3072, device="cuda") * 0.1).bfloat16()
    angles = torch.rand(576, 32, device="cuda") * 60
    cos, sin = angles.cos().contiguous(), angles.sin().contiguous()
    rows, row_scales = quantize_rows(torch.randn(16 * 5184, 1024, device="cuda", dtype=torch.bfloat16))
    flop = 2 * rows.shape[0] * 1024 * 3072
    ms = timed(lambda: torch._scaled_mm(rows, weight.t(), scale_a=row_scales, scale_b=weight_scales, bias=bias,
                                        out_dtype=torch.bfloat16), reps=30)
    print("cublas scaled_mm alone", round(ms, 4), flush=True)
    for bm, bn, bk, warps, stages in LAUNCHES:
        ms = timed(lambda: launch_linear_rope(rows, row_scales, weight, weight_scales, bias, cos, sin, 2048, block_m=bm,
                                              block_n=bn, block_k=bk, num_warps=warps, num_stages=stages), reps=30)
        print(json.dumps({"launch": [bm, bn, bk, warps, stages], "ms": round(ms, 4), "tflops": round(flop / ms / 1e9)}),
              flush=True)


if __name__ == "__main__":
    main()
