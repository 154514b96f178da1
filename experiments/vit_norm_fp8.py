#!/usr/bin/env python3
"""The ViT's residual add + LayerNorm + row quantization to e4m3 (what precision=fp8 runs before each q/k/v and
fc1 GEMM, 64 times a call) at 16 images, 82,944 tokens of width 1024, three ways:
  - Inductor as the package's compile builds it (torch.compile, default heuristics): past 8,448 rows (2 x 32 rows
    per SM) a reduction's hint is DEFAULT, and a DEFAULT reduction over more than 64 values is a looped one, so
    the row's LayerNorm statistics, its max and its cast are three passes over it (`triton_red_...` kernels in
    the fp8 section's profile, benchmarks/h100-2026-12-06-vit-fused-qkv/);
  - Inductor with persistent reductions up to 1024 values whatever the hint (an `InductorChoices` of its own);
  - one Triton kernel: ROWS rows a program, each row in registers once (the sum written in bf16, its statistics,
    the normalized row's max, the e4m3 row and its scale), its e4m3 rows written where the window partition puts
    them (addressing, not a copy).
for three places of the layer: a global layer's LayerNorm (no partition), a windowed layer's first (its output
partitioned into 24 x 24 windows) and its second (the attention's output read from its windows). Median ms of CUDA
events, the bytes each must move at the card's copy rate (`torch.add` of two such tensors into a third, timed
here), the kernels each launches (torch.profiler), and each one's difference from Inductor's (the sum, the e4m3
values as floats times their scales).

Usage: scripts/gpu_run.sh --python experiments/vit_norm_fp8.py --out DIR     (a Hopper GPU: vit-norm-fp8.{json,md})
       python experiments/vit_norm_fp8.py --interpret                       (the kernel against torch ops on small
                                                                               shapes in Triton's CPU interpreter)
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

if "--interpret" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported
os.environ["TORCHINDUCTOR_FORCE_DISABLE_CACHES"] = "1"  # each form compiled anew: the choices are no cache key

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from sam3_aoti.model.fp8 import E4M3, E4M3_MAX, quantize_rows  # noqa: E402

EPS = 1e-6
PLACES = ("global", "windowed, first", "windowed, second")


def partition_rows(x, grid: int, window: int):
    """`[B * grid * grid, C]` token rows in the order transformers' `window_partition` puts them."""
    batch, c = x.shape[0] // (grid * grid), x.shape[-1]
    n = grid // window
    return x.view(batch, n, window, n, window, c).permute(0, 1, 3, 2, 4, 5).reshape(-1, c)


def unpartition_rows(x, grid: int, window: int):
    batch, c, n = x.shape[0] // (grid * grid), x.shape[-1], grid // window
    return x.view(batch, n, n, window, window, c).permute(0, 1, 3, 2, 4, 5).reshape(-1, c)


def composed(residual, branch, weight, bias, place: str, grid: int, window: int):
    """The layer's arithmetic in torch ops, as the exported program has it: (the new residual, e4m3 rows, scales)."""
    if place == "windowed, second":
        branch = unpartition_rows(branch, grid, window)
    total = residual + branch
    normed = F.layer_norm(total, (total.shape[-1],), weight, bias, EPS)
    if place == "windowed, first":
        normed = partition_rows(normed, grid, window)
    rows, scales = quantize_rows(normed)
    return total, rows, scales


@triton.jit
def _window_row(token, GRID: tl.constexpr, WINDOW: tl.constexpr):
    """Where transformers' window partition puts token row `token` (image-major, then row, then column)."""
    per_image: tl.constexpr = GRID * GRID
    n: tl.constexpr = GRID // WINDOW
    image, at = token // per_image, token % per_image
    h, w = at // GRID, at % GRID
    return ((image * n + h // WINDOW) * n + w // WINDOW) * (WINDOW * WINDOW) + (h % WINDOW) * WINDOW + w % WINDOW


@triton.jit
def _add_norm_quant_kernel(residual_ptr, branch_ptr, weight_ptr, bias_ptr, total_ptr, rows_ptr, scales_ptr, tokens,
                           eps, C: tl.constexpr, ROWS: tl.constexpr, GRID: tl.constexpr, WINDOW: tl.constexpr,
                           PARTITION_OUT: tl.constexpr, PARTITION_IN: tl.constexpr):
    token = tl.program_id(0) * ROWS + tl.arange(0, ROWS)
    live = token < tokens
    channels = tl.arange(0, C)
    at = token.to(tl.int64)[:, None] * C + channels[None, :]
    branch_row = _window_row(token, GRID, WINDOW) if PARTITION_IN else token
    branch_at = branch_row.to(tl.int64)[:, None] * C + channels[None, :]
    total = (tl.load(residual_ptr + at, mask=live[:, None]).to(tl.float32)
             + tl.load(branch_ptr + branch_at, mask=live[:, None]).to(tl.float32)).to(tl.bfloat16)
    tl.store(total_ptr + at, total, mask=live[:, None])
    x = total.to(tl.float32)
    mean = tl.sum(x, 1) / C
    centered = x - mean[:, None]
    rstd = 1.0 / tl.sqrt(tl.sum(centered * centered, 1) / C + eps)
    weight, bias = tl.load(weight_ptr + channels).to(tl.float32), tl.load(bias_ptr + channels).to(tl.float32)
    normed = (centered * rstd[:, None] * weight[None, :] + bias[None, :]).to(tl.bfloat16).to(tl.float32)
    scale = tl.maximum(tl.max(tl.abs(normed), 1), 1e-12) / 448.0
    quantized = tl.clamp(normed / scale[:, None], -448.0, 448.0).to(tl.float8e4nv)
    out_row = _window_row(token, GRID, WINDOW) if PARTITION_OUT else token
    tl.store(rows_ptr + out_row.to(tl.int64)[:, None] * C + channels[None, :], quantized, mask=live[:, None])
    tl.store(scales_ptr + out_row, scale, mask=live)


def fused(residual, branch, weight, bias, place: str, grid: int, window: int, rows_per_program: int = 4,
          num_warps: int = 4):
    tokens, c = residual.shape
    total = torch.empty_like(residual)
    rows = torch.empty((tokens, c), dtype=E4M3, device=residual.device)
    scales = torch.empty((tokens, 1), dtype=torch.float32, device=residual.device)
    _add_norm_quant_kernel[(triton.cdiv(tokens, rows_per_program),)](
        residual, branch, weight, bias, total, rows, scales, tokens, EPS, C=c, ROWS=rows_per_program, GRID=grid,
        WINDOW=window, PARTITION_OUT=place == "windowed, first", PARTITION_IN=place == "windowed, second",
        num_warps=num_warps)
    return total, rows, scales


def inputs(images: int, grid: int, c: int, device: str, seed: int = 0):
    g = torch.Generator(device="cpu").manual_seed(seed)
    tokens = images * grid * grid
    make = lambda *shape: torch.randn(*shape, generator=g).to(device)  # noqa: E731
    return (make(tokens, c).to(torch.bfloat16), make(tokens, c).to(torch.bfloat16),
            (1 + 0.1 * make(c)).to(torch.bfloat16), (0.1 * make(c)).to(torch.bfloat16))


def difference(a, b) -> dict:
    """How far outputs `b` are from `a`: the sums, and the dequantized rows relative to the rows' scale."""
    (total_a, rows_a, scales_a), (total_b, rows_b, scales_b) = a, b
    values_a, values_b = rows_a.float() * scales_a, rows_b.float() * scales_b
    return {"sum_max_abs": (total_a.float() - total_b.float()).abs().max().item(),
            "sum_max_rel": ((total_a.float() - total_b.float()).abs() / total_a.float().abs().clamp(min=1e-3)).max()
            .item(),
            "dequantized_max_abs_of_row_max": ((values_a - values_b).abs() / (scales_a * E4M3_MAX)).max().item(),
            "e4m3_values_differing": (rows_a.view(torch.uint8) != rows_b.view(torch.uint8)).float().mean().item()}


def persistent_up_to_1024():
    """Inductor's choices with a persistent reduction for any reduction of at most 1024 values."""
    from torch._inductor.choices import InductorChoices
    from torch._inductor.virtualized import V

    class Choices(InductorChoices):
        @staticmethod
        def should_use_persistent_reduction(features, cooperative_reduction):
            if (not cooperative_reduction and features.is_reduction()
                    and V.graph.sizevars.statically_known_leq(features.reduction_numel, 1024)):
                return True
            return InductorChoices.should_use_persistent_reduction(features, cooperative_reduction)
    return Choices()


def compiled(place: str, grid: int, window: int, choices=None):
    """`composed` compiled by Inductor now (at its first call, under `choices` when given)."""
    import torch._dynamo
    from torch._inductor.virtualized import V

    torch._dynamo.reset()
    fn = torch.compile(lambda r, b, w, bi: composed(r, b, w, bi, place, grid, window), fullgraph=True, dynamic=False)

    def first_call(*args):
        if choices is None:
            return fn(*args)
        with V.set_choices_handler(choices):
            return fn(*args)
    return fn, first_call


def timed(fn, args, rounds: int = 20, calls: int = 10) -> float:
    """Median ms a call over `rounds` of `calls` back to back (the host's launches hidden behind the kernels)."""
    for _ in range(5):
        fn(*args)
    torch.cuda.synchronize()
    times = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(calls):
            fn(*args)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) / calls)
    return statistics.median(times)


def kernels(fn, args) -> list[dict]:
    from torch.profiler import ProfilerActivity, profile

    fn(*args)
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        fn(*args)
        torch.cuda.synchronize()
    return [{"kernel": e.key, "ms": round(e.device_time_total / 1e3, 4), "launches": e.count}
            for e in prof.key_averages() if e.device_time_total > 0]


def interpret() -> None:
    """Each place at 2 images of a 6 x 6 grid in windows of 3, width 64: the kernel against `composed`. The
    interpreter rounds to bf16 and e4m3 its own way (bf16 by truncation), so the sums may differ by a bf16 step and
    the e4m3 values by a step or two: a row misplaced would differ by its whole range."""
    grid, window = 6, 3
    for place in PLACES:
        args = inputs(2, grid, 64, "cpu", seed=1)
        branch = partition_rows(args[1], grid, window) if place == "windowed, second" else args[1]
        want = composed(args[0], branch, *args[2:], place, grid, window)
        got = fused(args[0], branch, *args[2:], place, grid, window, rows_per_program=4)
        diff = difference(want, got)
        assert diff["sum_max_rel"] <= 2 ** -7 and diff["dequantized_max_abs_of_row_max"] <= 0.25, (place, diff)
        print(f"{place}: {diff}")
    print("the kernel agrees with the torch ops in Triton's interpreter")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=16)
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--interpret", action="store_true")
    args = parser.parse_args()
    if args.interpret:
        return interpret()
    grid, window, c = 72, 24, 1024
    residual, branch, weight, bias = inputs(args.images, grid, c, "cuda")
    tokens = residual.shape[0]
    moved = tokens * c * (2 + 2 + 2 + 1) + tokens * 4  # two bf16 rows in; the bf16 sum, e4m3 rows, scales out
    copy_ms = timed(lambda a, b: torch.add(a, b), (residual, branch))
    copy_rate = tokens * c * 2 * 3 / copy_ms / 1e9  # TB/s: two read, one written
    results = {"images": args.images, "tokens": tokens, "width": c, "bytes_moved": moved,
               "copy_rate_tb_s": round(copy_rate, 3), "floor_ms": round(moved / copy_rate / 1e9, 4), "places": {}}
    for place in PLACES:
        source = partition_rows(branch, grid, window) if place == "windowed, second" else branch
        call = (residual, source, weight, bias)
        rows = {}
        fn, first = compiled(place, grid, window)
        reference = first(*call)
        rows["Inductor"] = {"ms": timed(fn, call), "kernels": kernels(fn, call)}
        fn, first = compiled(place, grid, window, persistent_up_to_1024())
        out = first(*call)
        rows["Inductor, persistent up to 1024"] = {"ms": timed(fn, call), "kernels": kernels(fn, call),
                                                   **difference(reference, out)}
        for per_program, warps in ((1, 4), (2, 4), (4, 4), (4, 8), (8, 8), (16, 8)):
            run = lambda *a: fused(*a, place, grid, window, per_program, warps)  # noqa: E731
            out = run(*call)
            rows[f"Triton, {per_program} rows a program, {warps} warps"] = {
                "ms": timed(run, call), **difference(reference, out)}
        for row in rows.values():
            row["ms"] = round(row["ms"], 4)
            row["share_of_copy_rate"] = round(moved / row["ms"] / 1e9 / copy_rate, 3)
        results["places"][place] = rows
        print(place, {name: (r["ms"], r["share_of_copy_rate"]) for name, r in rows.items()}, flush=True)
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "vit-norm-fp8.json").write_text(json.dumps(results, indent=2) + "\n")
    lines = [f"# Residual + LayerNorm + e4m3 rows, {args.images} images ({tokens} tokens x {c}), "
             f"{torch.cuda.get_device_name()}", "",
             f"{moved / 1e6:.0f} MB to move; the card's copy rate here {copy_rate:.2f} TB/s, so at least "
             f"{results['floor_ms']} ms.", "",
             "| place | form | ms | share of the copy rate | kernels | sum max diff | e4m3 values differing | "
             "dequantized max diff, of the row's max |",
             "|---|---|---|---|---|---|---|---|"]
    for place, rows in results["places"].items():
        for name, r in rows.items():
            launched = ", ".join(f"`{k['kernel'][:60]}` {k['ms']}" for k in r.get("kernels", []))
            lines.append(f"| {place} | {name} | {r['ms']} | {r['share_of_copy_rate']} | {launched} | "
                         f"{r.get('sum_max_abs', 0)} | {r.get('e4m3_values_differing', 0):.4f} | "
                         f"{r.get('dequantized_max_abs_of_row_max', 0):.4f} |")
    (args.out / "vit-norm-fp8.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
