#!/usr/bin/env python3
"""A ViT attention's q, k, v projection and the rotary embedding of q and k in precision=fp8 (`vit_qkv_rope`), at 16
images and at one, for a windowed layer (576 positions a window) and a global one (5,184), two ways, each compiled by
Inductor as the package's compile builds it (torch.compile, default heuristics):
  - unfused, as the package ran it before: cuBLAS's rowwise fp8 GEMM (`torch._scaled_mm`, the bias in its epilogue)
    writes q, k and v in bf16, then Inductor's kernel reads q and k back and rotates them (transformers'
    `apply_rotary_pos_emb_2d` on the halved tables' full form);
  - fused: the op `sam3_aoti::fp8_linear_rope`, one Triton GEMM that rotates q and k in its epilogue.
Both start from the quantized rows (the LayerNorm before them makes those in the package) and end with q, k, v as
the attention reads them. Median ms of CUDA events, the product's TFLOP/s, the kernels each launches
(torch.profiler) and the largest difference between the two (one bf16 rounding: the unfused graph rounds the
product before rotating it).

Usage: scripts/gpu_run.sh --python experiments/fp8_qkv_rope.py --out DIR     (a Hopper GPU: fp8-qkv-rope.{json,md})
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402
from transformers.models.sam3.modeling_sam3 import apply_rotary_pos_emb_2d  # noqa: E402

from sam3_aoti.model.fp8 import quantize_rows  # noqa: E402
from sam3_aoti.runtime import fp8_linear  # noqa: E402,F401  (registers the op)

WIDTH, HEADS, DIM = 1024, 16, 64


def timed(fn, *args, reps: int = 50) -> float:
    """Median ms of `reps` calls (CUDA events), after three."""
    for _ in range(3):
        fn(*args)
    times = []
    for _ in range(reps):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(*args)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    return statistics.median(times)


def launches(fn, *args) -> int:
    """Kernels one call launches (torch.profiler's CUDA kernel events)."""
    from torch.profiler import ProfilerActivity, profile

    fn(*args)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn(*args)
        torch.cuda.synchronize()
    return sum(e.count for e in prof.key_averages() if e.device_type.name == "CUDA")


def forms(weight, weight_scales, bias, cos, sin, positions: int):
    """(unfused, fused) callables of (rows, row_scales) -> (q, k, v) `[B, heads, L, dim]` views."""
    full_cos, full_sin = cos.repeat_interleave(2, -1), sin.repeat_interleave(2, -1)

    def split(qkv, rows):
        heads = (rows // positions, positions, HEADS, DIM)
        return [t.view(heads).transpose(1, 2) for t in qkv.view(*heads[:2], -1).chunk(3, -1)]

    def unfused(rows, row_scales):
        qkv = torch._scaled_mm(rows, weight.t(), scale_a=row_scales, scale_b=weight_scales, bias=bias,
                               out_dtype=torch.bfloat16)
        q, k, v = split(qkv, rows.shape[0])
        q, k = apply_rotary_pos_emb_2d(q, k, full_cos, full_sin)
        return q, k, v

    def fused(rows, row_scales):
        qkv = torch.ops.sam3_aoti.fp8_linear_rope(rows, row_scales, weight, weight_scales, bias, cos, sin, 2 * WIDTH)
        return split(qkv, rows.shape[0])

    return torch.compile(unfused, fullgraph=True), torch.compile(fused, fullgraph=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    torch.manual_seed(0)
    weight, weight_scales = quantize_rows(torch.randn(3 * WIDTH, WIDTH, device="cuda") * 0.03)
    weight_scales = weight_scales.t().contiguous()
    bias = (torch.randn(3 * WIDTH, device="cuda") * 0.1).to(torch.bfloat16)
    results = []
    for layer, positions in (("windowed", 576), ("global", 5184)):
        angles = torch.rand(positions, DIM // 2, device="cuda") * 60
        cos, sin = angles.cos().contiguous(), angles.sin().contiguous()
        unfused, fused = forms(weight, weight_scales, bias, cos, sin, positions)
        for images in (16, 1):
            rows, row_scales = quantize_rows(torch.randn(images * 5184, WIDTH, device="cuda", dtype=torch.bfloat16))
            flop = 2 * rows.shape[0] * WIDTH * 3 * WIDTH
            with torch.no_grad():
                a, b = unfused(rows, row_scales), fused(rows, row_scales)
                diff = max(float((x.float() - y.float()).abs().max() / y.float().abs().max()) for x, y in zip(a, b))
                row = {"layer": layer, "images": images, "max_rel_diff": round(diff, 5)}
                for name, fn in (("unfused", unfused), ("fused", fused)):
                    ms = timed(fn, rows, row_scales)
                    row[name] = {"ms": round(ms, 4), "tflops": round(flop / ms / 1e9, 1),
                                 "launches": launches(fn, rows, row_scales)}
            results.append(row)
            print(json.dumps(row), flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    facts = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": results}
    (args.out / "fp8-qkv-rope.json").write_text(json.dumps(facts, indent=2) + "\n")
    lines = [f"# q, k, v and the rotary embedding in fp8 on {torch.cuda.get_device_name()}", "",
             "| layer | images | unfused ms (launches) | fused ms (launches) | change | fused TFLOP/s | max rel diff |",
             "|---|---|---|---|---|---|---|"]
    for r in results:
        u, f = r["unfused"], r["fused"]
        lines.append(f"| {r['layer']} | {r['images']} | {u['ms']} ({u['launches']}) | {f['ms']} ({f['launches']}) | "
                     f"{(f['ms'] / u['ms'] - 1) * 100:+.1f} % | {f['tflops']} | {r['max_rel_diff']} |")
    (args.out / "fp8-qkv-rope.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
