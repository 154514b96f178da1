#!/usr/bin/env python3
"""The ViT MLP's fc1 as one Triton fp8 GEMM whose epilogue adds the bias, applies the GELU and quantizes the result
in 1 x 128 groups (what fc2 reads), against today's precision=fp8 path for the same step: `torch._scaled_mm` (rowwise
e4m3, bf16 out), then `sam3_experiment::gelu_quantize_groups` (experiments/gelu_groups.py) on its output. A group of 128 is
one output tile's width, so each program holds whole groups and the quantization needs no pass of its own; the
4736-wide bf16 product is never written. Two kernels: tiles loaded through pointers (CONFIGS), and persistent with
TMA loads (TMA_CONFIGS, 128 or 256 wide, and its product alone: the rate of Triton's main loop; the tutorial keeps warp specialization to Blackwell). On 16 images' tokens (82,944 x 1024 in,
4736 out), every launch shape: its time, and how many e4m3 values and scales differ from today's (the sums are not
added in cuBLAS's order: on an H100, 1.7 % of the values and up to 2.3 % of a group's scale, where the bias cancels
the product). The bf16 GEMM alone and the fp8 GEMM alone are the floors. `--interpret` checks both kernels in
Triton's CPU interpreter at a small shape (no times).
Usage: python3 experiments/fp8_fc1_fused.py --out DIR [--images 16]   (on a CUDA GPU; writes DIR/fp8-fc1-fused.{json,md})
       TRITON_INTERPRET=1 python3 experiments/fp8_fc1_fused.py --interpret
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from sam3_aoti.model.fp8 import quantize_rows  # noqa: E402
from sam3_aoti.runtime.fp8_linear import gelu_tanh, tile_of  # noqa: E402
import gelu_groups  # noqa: E402  (this folder's)

WIDTH, HIDDEN, TOKENS_PER_IMAGE = 1024, 4736, 72 * 72  # the ViT's width, its MLP's, tokens of one image
# (BLOCK_M, BLOCK_K, num_warps, num_stages): the tile's rows and depth; its width is one group (128)
CONFIGS = [(128, 128, 8, 4), (64, 128, 4, 3)]  # the best two of eight on an H100 (h100-2026-12-05-segment-overlap)
# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) of the pointer kernel with the cheap epilogue
POINTER_CONFIGS = [(128, 256, 128, 8, 3), (128, 256, 64, 8, 4), (128, 128, 128, 8, 4), (64, 128, 128, 4, 3),
                   (256, 128, 128, 8, 3), (128, 256, 128, 8, 4)]
# (BLOCK_M, BLOCK_N, BLOCK_K, num_warps, num_stages) of the persistent TMA kernel: Triton's persistent-matmul tutorial
# takes 128 x 256 x 128 tiles for fp8 on Hopper; a tile holds BLOCK_N / 128 whole groups
TMA_CONFIGS = [(128, 256, 128, 8, 3), (128, 256, 64, 8, 4), (128, 128, 128, 8, 4), (256, 128, 128, 8, 3)]


@triton.jit
def _gelu_groups_epilogue(acc, rows, first_col, a_scale_ptr, w_scale_ptr, bias_ptr, values_ptr, scales_ptr, m, n,
                          WIDTH: tl.constexpr, GROUP: tl.constexpr, E4M3_MAX: tl.constexpr, MIN_AMAX: tl.constexpr,
                          CHEAP: tl.constexpr):
    """Scales, bias, GELU and 1 x GROUP quantization of an fp32 product tile `acc [rows, WIDTH]`, stored. CHEAP: no
    bf16 roundings between the steps, GELU's tanh form through the SFU's tanh.approx, a multiply by each group's
    reciprocal scale in place of IEEE division (what one element costs in instructions; the exact form emulates
    today's two kernels step for step)."""
    groups: tl.constexpr = WIDTH // GROUP
    cols = first_col + tl.arange(0, WIDTH)
    inside = (rows[:, None] < m) & (cols[None, :] < n)
    a_scale = tl.load(a_scale_ptr + rows, mask=rows < m, other=0.0)
    w_scale = tl.load(w_scale_ptr + cols, mask=cols < n, other=0.0)
    bias = tl.load(bias_ptr + cols, mask=cols < n, other=0.0).to(tl.float32)
    if CHEAP:
        h = acc * a_scale[:, None] * w_scale[None, :] + bias[None, :]
        g = gelu_tanh(h, True)
    else:
        y = (acc * a_scale[:, None] * w_scale[None, :]).to(tl.bfloat16)  # _scaled_mm's bf16 output
        h = (y.to(tl.float32) + bias[None, :]).to(tl.bfloat16).to(tl.float32)
        g = (h * 0.5 * (1.0 + tl.math.erf(h * 0.7071067811865476))).to(tl.bfloat16).to(tl.float32)  # torch's GELU
    g = tl.reshape(g, (acc.shape[0], groups, GROUP))
    amax = tl.maximum(tl.max(tl.abs(g), axis=2), MIN_AMAX)  # [rows, groups]
    if CHEAP:
        values = tl.clamp(g * (E4M3_MAX / amax)[:, :, None], -E4M3_MAX, E4M3_MAX)
    else:
        values = tl.clamp(tl.math.div_rn(g, (amax / E4M3_MAX)[:, :, None]), -E4M3_MAX, E4M3_MAX)
    tl.store(values_ptr + rows[:, None] * n + cols[None, :],
             tl.reshape(values, (acc.shape[0], WIDTH)).to(values_ptr.dtype.element_ty), mask=inside)
    group_ids = first_col // GROUP + tl.arange(0, groups)
    tl.store(scales_ptr + group_ids[None, :] * m + rows[:, None], amax / E4M3_MAX,
             mask=(rows[:, None] < m) & (group_ids[None, :] < n // GROUP))


@triton.jit
def _fc1_gelu_groups_kernel(a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, bias_ptr, values_ptr, scales_ptr, m, n,
                            k: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                            GROUP: tl.constexpr, GROUP_M: tl.constexpr, E4M3_MAX: tl.constexpr,
                            MIN_AMAX: tl.constexpr, CHEAP: tl.constexpr):
    block_m, block_n = tile_of(tl.program_id(0), m, n, BLOCK_M, BLOCK_N, GROUP_M)
    rows = (block_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
    cols = block_n * BLOCK_N + tl.arange(0, BLOCK_N)
    depth = tl.arange(0, BLOCK_K)
    a_at = a_ptr + rows[:, None] * k + depth[None, :]  # [BLOCK_M, BLOCK_K] of the row-major activations
    w_at = w_ptr + cols[None, :].to(tl.int64) * k + depth[:, None]  # [BLOCK_K, BLOCK_N] of the weight [N, K], K-major
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for _ in range(0, k // BLOCK_K):  # k a constexpr: the interpreter ranges over no runtime int
        acc = tl.dot(tl.load(a_at, mask=rows[:, None] < m, other=0.0), tl.load(w_at, mask=cols[None, :] < n, other=0.0),
                     acc)
        a_at += BLOCK_K
        w_at += BLOCK_K
    _gelu_groups_epilogue(acc, rows, block_n * BLOCK_N, a_scale_ptr, w_scale_ptr, bias_ptr, values_ptr, scales_ptr,
                          m, n, BLOCK_N, GROUP, E4M3_MAX, MIN_AMAX, CHEAP)


@triton.jit
def _fc1_gelu_groups_tma_kernel(a_desc, w_desc, a_scale_ptr, w_scale_ptr, bias_ptr, values_ptr, scales_ptr,
                                m: tl.constexpr, n: tl.constexpr, k: tl.constexpr, BLOCK_M: tl.constexpr,
                                BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP: tl.constexpr,
                                GROUP_M: tl.constexpr, PROGRAMS: tl.constexpr, E4M3_MAX: tl.constexpr,
                                MIN_AMAX: tl.constexpr, WARP_SPECIALIZE: tl.constexpr, PRODUCT_ONLY: tl.constexpr,
                                CHEAP: tl.constexpr, SUBTILE: tl.constexpr):
    """The same product and epilogue, persistent (a program per SM, tile after tile) with TMA loads of both
    operands (host tensor descriptors): Hopper's way to keep its fp8 tensor cores fed. A tile is BLOCK_N / GROUP
    groups wide. PRODUCT_ONLY writes the scaled bf16 product instead (no bias, GELU or quantization): the rate of
    Triton's fp8 main loop alone, against cuBLAS's. SUBTILE runs the epilogue on the tile's two halves one after
    the other (fewer live registers, as the tutorial's EPILOGUE_SUBTILE)."""
    blocks_m: tl.constexpr = (m + BLOCK_M - 1) // BLOCK_M
    blocks_n: tl.constexpr = (n + BLOCK_N - 1) // BLOCK_N  # 4736 = 18.5 tiles of 256: the last one half outside
    per_band: tl.constexpr = GROUP_M * blocks_n
    tiles: tl.constexpr = blocks_m * blocks_n
    # a static count of turns (the interpreter ranges over no runtime value), the last one's tile past the end skipped
    for turn in tl.range(0, (tiles + PROGRAMS - 1) // PROGRAMS, flatten=True, warp_specialize=WARP_SPECIALIZE):
        tile = tl.program_id(0) + turn * PROGRAMS
        if tile < tiles:
            first_m = (tile // per_band) * GROUP_M
            band_m = tl.minimum(blocks_m - first_m, GROUP_M)
            block_m = first_m + (tile % per_band) % band_m
            block_n = (tile % per_band) // band_m
            acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
            for step in range(0, k // BLOCK_K):
                a = a_desc.load([block_m * BLOCK_M, step * BLOCK_K])
                w = w_desc.load([block_n * BLOCK_N, step * BLOCK_K])
                acc = tl.dot(a, w.T, acc)
            rows = (block_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
            if PRODUCT_ONLY:
                cols = block_n * BLOCK_N + tl.arange(0, BLOCK_N)
                a_scale = tl.load(a_scale_ptr + rows, mask=rows < m, other=0.0)
                w_scale = tl.load(w_scale_ptr + cols, mask=cols < n, other=0.0)
                tl.store(values_ptr + rows[:, None] * n + cols[None, :],
                         (acc * a_scale[:, None] * w_scale[None, :]).to(tl.bfloat16),
                         mask=(rows[:, None] < m) & (cols[None, :] < n))
            elif SUBTILE:
                left, right = tl.split(tl.permute(tl.reshape(acc, (BLOCK_M, 2, BLOCK_N // 2)), (0, 2, 1)))
                _gelu_groups_epilogue(left, rows, block_n * BLOCK_N, a_scale_ptr, w_scale_ptr, bias_ptr, values_ptr,
                                      scales_ptr, m, n, BLOCK_N // 2, GROUP, E4M3_MAX, MIN_AMAX, CHEAP)
                _gelu_groups_epilogue(right, rows, block_n * BLOCK_N + BLOCK_N // 2, a_scale_ptr, w_scale_ptr, bias_ptr,
                                      values_ptr, scales_ptr, m, n, BLOCK_N // 2, GROUP, E4M3_MAX, MIN_AMAX, CHEAP)
            else:
                _gelu_groups_epilogue(acc, rows, block_n * BLOCK_N, a_scale_ptr, w_scale_ptr, bias_ptr, values_ptr, scales_ptr,
                                      m, n, BLOCK_N, GROUP, E4M3_MAX, MIN_AMAX, CHEAP)


def fused_tma(rows, row_scales, weight, weight_scales, bias, block_m=128, block_k=128, num_warps=8, num_stages=3,
              block_n=gelu_groups.GROUP, warp_specialize=False, product_only=False, cheap=False, subtile=False,
              programs=None, values_dtype=gelu_groups.E4M3):
    """`fused` through the persistent TMA kernel: `programs` (default one per SM) work through the tiles.
    `product_only`: the bf16 product alone (`values`), no scales."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    m, k = rows.shape
    n = weight.shape[0]
    values = torch.empty((m, n), dtype=torch.bfloat16 if product_only else values_dtype, device=rows.device)
    scales = torch.empty((n // gelu_groups.GROUP, m), dtype=torch.float32, device=rows.device)
    tiles = triton.cdiv(m, block_m) * triton.cdiv(n, block_n)
    programs = min(programs or torch.cuda.get_device_properties(rows.device).multi_processor_count, tiles)
    a_desc = TensorDescriptor.from_tensor(rows, [block_m, block_k])
    w_desc = TensorDescriptor.from_tensor(weight, [block_n, block_k])
    _fc1_gelu_groups_tma_kernel[(programs,)](
        a_desc, w_desc, row_scales, weight_scales, bias, values, scales, m, n, k, BLOCK_M=block_m, BLOCK_N=block_n,
        BLOCK_K=block_k, GROUP=gelu_groups.GROUP, GROUP_M=8, PROGRAMS=programs, E4M3_MAX=gelu_groups.E4M3_MAX,
        MIN_AMAX=gelu_groups.MIN_SCALE_AMAX, WARP_SPECIALIZE=warp_specialize, PRODUCT_ONLY=product_only,
        CHEAP=cheap, SUBTILE=subtile, num_warps=num_warps, num_stages=num_stages)
    return values, scales


def fused(rows, row_scales, weight, weight_scales, bias, block_m=128, block_k=128, num_warps=8, num_stages=3,
          block_n=gelu_groups.GROUP, cheap=False, values_dtype=gelu_groups.E4M3, wrap=lambda kernel: kernel):
    """`rows [M, K]` e4m3 with `row_scales [M, 1]`, `weight [N, K]` e4m3 with `weight_scales [1, N]`, `bias [N]`
    bf16 -> (e4m3 values [M, N], fp32 scales [N / 128, M]): `quantize_groups(gelu(rows @ weight.T + bias))`.
    `values_dtype` float32 keeps the quotients uncast (the interpreter's check)."""
    m, k = rows.shape
    n = weight.shape[0]
    values = torch.empty((m, n), dtype=values_dtype, device=rows.device)
    scales = torch.empty((n // gelu_groups.GROUP, m), dtype=torch.float32, device=rows.device)
    grid = (triton.cdiv(m, block_m) * triton.cdiv(n, block_n),)
    wrap(_fc1_gelu_groups_kernel)[grid](rows, row_scales, weight, weight_scales, bias, values, scales, m, n, k,
                                  BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, GROUP=gelu_groups.GROUP,
                                  GROUP_M=8, E4M3_MAX=gelu_groups.E4M3_MAX, MIN_AMAX=gelu_groups.MIN_SCALE_AMAX,
                                  CHEAP=cheap, num_warps=num_warps, num_stages=num_stages)
    return values, scales


def inputs(tokens: int, width: int, hidden: int, device: str):
    """LayerNorm-like activations (quantized in rows, as the LayerNorm's kernel writes them), an fc1 of the ViT's
    scale (quantized per output channel, as `Fp8Linear` stores it) and its bias."""
    torch.manual_seed(0)
    x = torch.randn(tokens, width, device=device, dtype=torch.bfloat16)
    weight = torch.randn(hidden, width, device=device) * 0.02
    bias = (torch.randn(hidden, device=device) * 0.02).to(torch.bfloat16)
    rows, row_scales = quantize_rows(x)
    w8, w_scales = quantize_rows(weight)
    return x, rows, row_scales, w8, w_scales.t().contiguous(), weight.to(torch.bfloat16), bias


def today(rows, row_scales, w8, w_scales, bias):
    """precision=fp8's fc1 today: cuBLAS's rowwise fp8 GEMM, then the GELU + group quantization kernel."""
    if rows.is_cuda:
        out = torch._scaled_mm(rows, w8.t(), scale_a=row_scales, scale_b=w_scales, out_dtype=torch.bfloat16)
    else:  # the same arithmetic in torch ops (Fp8Linear's CPU form)
        out = ((rows.float() @ w8.float().t()) * row_scales * w_scales).to(torch.bfloat16)
    return gelu_groups.reference(out, bias) if not rows.is_cuda else gelu_groups.launch_gelu_groups(out, bias)


def differences(got, want) -> dict:
    values = int((got[0].view(torch.uint8) != want[0].view(torch.uint8)).sum())
    scale_rel = float(((got[1] - want[1]).abs() / want[1]).max())
    return {"values_differing": values, "values_differing_share": round(values / got[0].numel(), 8),
            "scales_max_relative_difference": scale_rel}


def interpret() -> None:
    """The kernel in Triton's CPU interpreter at a small shape, its quotients kept in fp32: the interpreter's own
    cast to e4m3 is wrong where a value rounds up into the next power of two (-126.4 becomes -64), and it truncates
    its bf16 casts where CUDA rounds, so the quotients and scales are held to 3 % (three truncated casts of 2^-7)
    and the cast is left to the GPU run, which counts the values that differ from today's."""
    x, rows, row_scales, w8, w_scales, _, bias = inputs(200, 256, 384, "cpu")
    _, want_scales = today(rows, row_scales, w8, w_scales, bias)
    product = ((rows.float() @ w8.float().t()) * row_scales * w_scales).to(torch.bfloat16)
    gelu = torch.nn.functional.gelu(product + bias).float().reshape(200, -1, 128)
    want = (gelu / want_scales.t()[..., None]).clamp(-448, 448).reshape(200, -1)  # 384 wide: a 256 tile's half
    launches = {"fused": lambda: fused(rows, row_scales, w8, w_scales, bias, block_m=64, block_k=64, num_warps=4,
                                       num_stages=1, values_dtype=torch.float32),
                "fused, 256 wide": lambda: fused(rows, row_scales, w8, w_scales, bias, block_m=64, block_k=64,
                                                 num_warps=4, num_stages=1, block_n=256, values_dtype=torch.float32),
                "fused_tma": lambda: fused_tma(rows, row_scales, w8, w_scales, bias, block_m=64, block_k=64,
                                               num_warps=4, num_stages=1, programs=5, values_dtype=torch.float32),
                "fused_tma, 256 wide": lambda: fused_tma(rows, row_scales, w8, w_scales, bias, block_m=64, block_k=64,
                                                         num_warps=4, num_stages=1, block_n=256, programs=3,
                                                         values_dtype=torch.float32),
                "fused_tma, 256 wide in halves": lambda: fused_tma(rows, row_scales, w8, w_scales, bias, block_m=64,
                                                                   block_k=64, num_warps=4, num_stages=1, block_n=256,
                                                                   subtile=True, programs=3,
                                                                   values_dtype=torch.float32)}
    for name, launch in launches.items():
        quotients, scales = launch()
        torch.testing.assert_close(scales, want_scales, rtol=3e-2, atol=0)
        torch.testing.assert_close(quotients, want, rtol=3e-2, atol=448 * 3 * 2 ** -8)  # a sum near -bias cancels
        print(json.dumps({"interpreted": name, "quotients_max_abs_difference": float((quotients - want).abs().max())}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--images", type=int, default=16)
    parser.add_argument("--interpret", action="store_true")
    args = parser.parse_args()
    if args.interpret:
        return interpret()
    from sam3_aoti.measure.timing import time_calls
    from sam3_aoti.pipeline.report import Report, Table, write_report

    args.out.mkdir(parents=True, exist_ok=True)
    tokens = args.images * TOKENS_PER_IMAGE
    x, rows, row_scales, w8, w_scales, w16, bias = inputs(tokens, WIDTH, HIDDEN, "cuda")
    flop = 2 * tokens * WIDTH * HIDDEN

    def ms_of(fn) -> float:
        return statistics.median(time_calls(fn, (), "cuda", 5, 20))

    want = today(rows, row_scales, w8, w_scales, bias)
    results = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
               "tokens": tokens, "gflop": round(flop / 1e9, 1),
               "bf16_gemm_ms": round(ms_of(lambda: torch.nn.functional.linear(x, w16, bias)), 4),
               "fp8_gemm_ms": round(ms_of(lambda: torch._scaled_mm(rows, w8.t(), scale_a=row_scales, scale_b=w_scales,
                                                                   out_dtype=torch.bfloat16)), 4),
               "today_ms": round(ms_of(lambda: today(rows, row_scales, w8, w_scales, bias)), 4), "fused": []}
    product = torch._scaled_mm(rows, w8.t(), scale_a=row_scales, scale_b=w_scales, out_dtype=torch.bfloat16)
    epilogues = (("TMA, persistent", {}), ("TMA, persistent, cheap epilogue", {"cheap": True}),
                 ("TMA, persistent, cheap epilogue in halves", {"cheap": True, "subtile": True}),
                 ("TMA, persistent, product alone", {"product_only": True}))
    launches = [("pointers", fused, (bm, 128, bk, warps, stages), {}) for bm, bk, warps, stages in CONFIGS] + [
        ("pointers, cheap epilogue", fused, config, {"cheap": True}) for config in POINTER_CONFIGS] + [
        (kernel, fused_tma, config, extra) for kernel, extra in epilogues for config in TMA_CONFIGS
        if not extra.get("subtile") or config[1] == 256]
    for kernel, launch, (block_m, block_n, block_k, warps, stages), extra in launches:
        row = {"kernel": kernel, "block_m": block_m, "block_n": block_n, "block_k": block_k, "num_warps": warps,
               "num_stages": stages}
        if block_n != 128:
            extra = {**extra, "block_n": block_n}
        try:
            got = launch(rows, row_scales, w8, w_scales, bias, block_m, block_k, warps, stages, **extra)
            ms = ms_of(lambda: launch(rows, row_scales, w8, w_scales, bias, block_m, block_k, warps, stages, **extra))
            same = ({"product_max_abs_difference": float((got[0].float() - product.float()).abs().max())}
                    if extra.get("product_only") else differences(got, want))
            row.update(ms=round(ms, 4), tflops=round(flop / (ms * 1e-3) / 1e12, 1), **same)
        except Exception as e:  # a shape this card's shared memory cannot hold: named, the others go on
            row["error"] = str(e).splitlines()[0][:200]
        results["fused"].append(row)
        print(json.dumps(row), flush=True)
    def against_today(r: dict) -> list:
        if "product_max_abs_difference" in r:
            return [f"product within {r['product_max_abs_difference']:.1e} of cuBLAS's", ""]
        return [f"{r['values_differing']} ({r['values_differing_share']:.1e})", f"{r['scales_max_relative_difference']:.1e}"]

    rows = [[r["kernel"], r["block_m"], r["block_n"], r["block_k"], r["num_warps"], r["num_stages"],
             *([r["ms"], r["tflops"], *against_today(r)] if "ms" in r else [r["error"], "", "", ""])]
            for r in results["fused"]]
    table = Table("Every launch shape", ["kernel", "BLOCK_M", "BLOCK_N", "BLOCK_K", "warps", "stages", "ms", "TFLOP/s",
                                         "values differing", "scales' max rel. difference"], rows)
    notes = [f"Today (cuBLAS rowwise fp8 GEMM, then the GELU group kernel): {results['today_ms']} ms. Floors: the fp8 "
             f"GEMM alone {results['fp8_gemm_ms']} ms, the bf16 GEMM alone (with its bias) {results['bf16_gemm_ms']} "
             "ms."]
    title = (f"fc1 + bias + GELU + 1 x 128 group quantization in one fp8 GEMM, {tokens} x {WIDTH} -> {HIDDEN} "
             f"({results['gpu']}, torch {results['torch']}, Triton {results['triton']})")
    write_report(Report(title, notes, None, [table], data=results), args.out / "fp8-fc1-fused.json",
                 args.out / "fp8-fc1-fused.md")

if __name__ == "__main__":
    main()
