#!/usr/bin/env python3
"""Issue #50's first lever on one ViT MLP of SAM3 at 16 images (82,944 tokens of width 1024, hidden 4736):
`x + fc2(gelu(fc1(layernorm(x))))` compiled by Inductor as
  - bf16: today's build;
  - fp8 rows: both linears as row-wise e4m3 GEMMs (`sam3_aoti.model.fp8.Fp8Linear`), where GELU's output needs
    a max over its whole 4736-wide row before it can be quantized;
  - fp8 groups: fc1 as above, fc2's input quantized in 1 x 128 groups (4736 = 37 x 128: the max is over 128
    values, within one tile of the GELU's kernel) against 128 x 128 weight blocks (`gelu_groups.Fp8GroupLinear`:
    `F.scaled_mm`, BlockWise1x128 x BlockWise128x128, Hopper's DeepSeek-style kernel);
  - bf16, GELU epilogue: fc1, its bias and the (tanh) GELU as one cuBLASLt GEMM (`vit_gelu_epilogue`, today's
    bf16 build);
  - fp8, fc1 fused: fc1 as one Triton fp8 GEMM whose epilogue adds the bias, applies the tanh GELU and quantizes
    in 1 x 128 groups (the op `sam3_experiment::fp8_linear_gelu_groups`), then fc2 on the groups (`F.scaled_mm`);
  - fp8 fc1 to bf16, fc2 bf16: the same fc1 kernel writing the GELU's output in bf16, fc2 cuBLAS's bf16 GEMM
    (`sam3_aoti.model.fp8.Fp8Mlp`, the op `sam3_aoti::fp8_linear_gelu`): what precision=fp8 builds now;
  - fp8 fc1, fc2 Triton blocks: fc2's blockwise product in the project's Triton kernel
    (`gelu_groups.launch_group_linear`) in place of `F.scaled_mm`, which AOTInductor runs through its proxy
    executor and which fails there in torch 2.11.
The blockwise Triton kernel's launch shapes are timed alone too.
Each: median ms of 20 calls (CUDA events) after warm-up, its costliest kernels (torch.profiler), and its error
against the fp32 MLP. The GELU-and-quantize step alone too, rows against groups, beside the bytes it must move.
Usage: python3 experiments/vit_mlp_fp8.py --out DIR        (on a Hopper GPU; writes DIR/vit-mlp-fp8.{json,md})
       python3 experiments/vit_mlp_fp8.py --cpu --out DIR  (the arithmetic checked on small shapes, no timing)
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import traceback
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from sam3_aoti.model.fp8 import Fp8Linear, Fp8Mlp as ProductMlp, quantize_rows  # noqa: E402

import fp8_fc1_fused  # noqa: E402  (this folder's)
import gelu_groups  # noqa: E402  (this folder's)
from gelu_groups import Fp8GroupLinear, quantize_groups  # noqa: E402


@torch.library.triton_op("sam3_experiment::fp8_linear_gelu_groups", mutates_args=())
def fp8_linear_gelu_groups(rows: torch.Tensor, row_scales: torch.Tensor, weight: torch.Tensor,
                           weight_scales: torch.Tensor, bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """fc1 with the bias, the tanh GELU and 1 x 128 group quantization in its epilogue (`fp8_fc1_fused.py`'s
    kernel with the cheap epilogue, fc1's launch); off CUDA its arithmetic in torch ops."""
    if not rows.is_cuda:
        product = (rows.float() @ weight.float().t()) * row_scales * weight_scales + bias.float()
        return quantize_groups(F.gelu(product, approximate="tanh"))
    return fp8_fc1_fused.fused(rows, row_scales, weight, weight_scales, bias, block_n=256, cheap=True,
                               wrap=torch.library.wrap_triton)


@torch.library.triton_op("sam3_experiment::fp8_group_linear", mutates_args=())
def fp8_group_linear(groups: torch.Tensor, scales: torch.Tensor, weight: torch.Tensor, weight_scales: torch.Tensor,
                     bias: torch.Tensor) -> torch.Tensor:
    if not groups.is_cuda:
        k = groups.shape[1]
        rows = (groups.float().reshape(-1, k // 128, 128) * scales.t()[..., None]).reshape(groups.shape)
        blocks = weight.float().reshape(-1, 128, k // 128, 128) * weight_scales[:, None, :k // 128, None]
        return (rows @ blocks.reshape(weight.shape).t() + bias.float()).to(torch.bfloat16)
    return gelu_groups.launch_group_linear(groups, scales, weight, weight_scales, bias, wrap=torch.library.wrap_triton)


WIDTH, HIDDEN, TOKENS_PER_IMAGE = 1024, 4736, 72 * 72


class Mlp(nn.Module):
    """The ViT's MLP half of a block, residual included."""

    def __init__(self, dtype):
        super().__init__()
        self.norm = nn.LayerNorm(WIDTH, dtype=dtype)
        self.fc1, self.fc2 = nn.Linear(WIDTH, HIDDEN, dtype=dtype), nn.Linear(HIDDEN, WIDTH, dtype=dtype)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class Fp8Mlp(nn.Module):
    """The MLP with fp8 linears: fc1 row-wise, fc2 row-wise or in 1 x 128 groups."""

    def __init__(self, mlp: Mlp, groups: bool):
        super().__init__()
        self.norm, self.fc1 = mlp.norm, Fp8Linear(mlp.fc1)
        self.fc2 = Fp8GroupLinear(mlp.fc2) if groups else Fp8Linear(mlp.fc2)

    def forward(self, x):
        return x + self.fc2(F.gelu(self.fc1(self.norm(x))))


class GeluEpilogueMlp(Mlp):
    """The bf16 MLP as `vit_gelu_epilogue` builds it: fc1 with its bias and GELU in cuBLASLt's epilogue."""

    def __init__(self, mlp: Mlp):
        nn.Module.__init__(self)
        self.norm, self.fc1, self.fc2 = mlp.norm, mlp.fc1, mlp.fc2

    def forward(self, x):
        hidden = torch._addmm_activation(self.fc1.bias, self.norm(x), self.fc1.weight.t(), use_gelu=True)
        return x + self.fc2(hidden)


class FusedGroups(nn.Module):
    """The fused fc1 writing groups, then fc2's blockwise product: `F.scaled_mm` or (`triton`) the project's kernel."""

    def __init__(self, mlp: Mlp, triton: bool):
        super().__init__()
        self.norm, self.fc1, self.fc2, self.triton = mlp.norm, Fp8Linear(mlp.fc1), Fp8GroupLinear(mlp.fc2), triton

    def forward(self, x):
        rows, row_scales = quantize_rows(self.norm(x))
        groups, scales = torch.ops.sam3_experiment.fp8_linear_gelu_groups(rows, row_scales, self.fc1.weight,
                                                                         self.fc1.weight_scale, self.fc1.bias)
        if self.triton:
            fc2 = self.fc2
            return x + torch.ops.sam3_experiment.fp8_group_linear(groups, scales, fc2.weight, fc2.weight_scale,
                                                                  fc2.bias)
        return x + self.fc2.on_groups(groups, scales)


class ProductFp8Mlp(nn.Module):
    """The MLP as precision=fp8 builds it: `model.fp8.Fp8Mlp` between the LayerNorm and the residual."""

    def __init__(self, mlp: Mlp):
        super().__init__()
        self.norm, self.mlp = mlp.norm, ProductMlp(mlp)

    def forward(self, x):
        return x + self.mlp(self.norm(x))


def error(out, reference) -> dict:
    diff = (out.float() - reference).flatten()
    return {"max_abs": diff.abs().max().item(),
            "relative_l2": (diff.norm() / reference.flatten().norm()).item()}


def timed(fn, x, iters=20, warmup=5) -> float:
    from sam3_aoti.measure.timing import time_calls

    return statistics.median(time_calls(fn, (x,), "cuda", warmup, iters))


def top_kernels(fn, x, count=8) -> list[dict]:
    """The costliest kernels of one call (ms each, from torch.profiler's CUDA times)."""
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad():
        fn(x)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            fn(x)
            torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    events.sort(key=lambda e: -e.device_time_total)
    return [{"kernel": e.key[:120], "ms": round(e.device_time_total / 1e3, 3), "calls": e.count}
            for e in events[:count]]


GROUP_LINEAR_LAUNCHES = [{"block_m": 128, "num_warps": 8, "num_stages": 3}, {"block_m": 128, "num_warps": 8, "num_stages": 4},
                         {"block_m": 128, "num_warps": 4, "num_stages": 3}, {"block_m": 64, "num_warps": 4, "num_stages": 4},
                         {"block_m": 256, "num_warps": 8, "num_stages": 3}]


def fc2_alone(linear: nn.Linear, tokens: int) -> dict:
    """fc2's product alone: cuBLAS bf16, `F.scaled_mm` on groups and blocks, the project's Triton kernel per launch."""
    hidden = torch.randn(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16)
    groups, scales = quantize_groups(hidden)
    group_linear = Fp8GroupLinear(linear)
    flop = 2 * tokens * HIDDEN * WIDTH
    calls = {"bf16 (cuBLAS)": lambda h: F.linear(h, linear.weight, linear.bias),
             "F.scaled_mm blockwise": lambda h: group_linear.on_groups(groups, scales)}
    calls.update({f"Triton blocks {launch}": (lambda h, launch=launch: gelu_groups.launch_group_linear(
        groups, scales, group_linear.weight, group_linear.weight_scale, group_linear.bias, **launch))
        for launch in GROUP_LINEAR_LAUNCHES})
    want, rows = group_linear.on_groups(groups, scales).float(), {}
    for name, fn in calls.items():
        try:
            ms = timed(fn, hidden)
            rows[name] = {"ms": round(ms, 3), "tflop_per_s": round(flop / (ms * 1e-3) / 1e12, 1),
                          "max_abs_vs_scaled_mm": float((fn(hidden).float() - want).abs().max())}
        except Exception as e:  # a launch this card cannot hold: named, the others go on
            rows[name] = {"failed": f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"}
        print("fc2 alone", name, rows[name], flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--images", type=int, default=16)
    parser.add_argument("--cpu", action="store_true", help="check the arithmetic on small shapes, no timing")
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    device = "cpu" if args.cpu else "cuda"
    tokens = 256 if args.cpu else args.images * TOKENS_PER_IMAGE
    torch.manual_seed(0)
    reference_mlp = Mlp(torch.float32).to(device)
    with torch.no_grad():
        for linear in (reference_mlp.fc1, reference_mlp.fc2):
            linear.weight.normal_(0, WIDTH ** -0.5)
            linear.bias.normal_(0, 0.02)
    x32 = torch.randn(tokens, WIDTH, device=device)
    with torch.no_grad():
        reference = reference_mlp(x32)
    bf16 = Mlp(torch.bfloat16).to(device)
    bf16.load_state_dict({k: v.to(torch.bfloat16) for k, v in reference_mlp.state_dict().items()})
    x = x32.to(torch.bfloat16)
    variants = {"bf16": bf16, "bf16, GELU epilogue": GeluEpilogueMlp(bf16), "fp8 rows": Fp8Mlp(bf16, groups=False),
                "fp8 groups": Fp8Mlp(bf16, groups=True), "fp8, fc1 fused": FusedGroups(bf16, triton=False),
                "fp8 fc1 to bf16, fc2 bf16": ProductFp8Mlp(bf16), "fp8 fc1, fc2 Triton blocks": FusedGroups(bf16, triton=True)}
    flop = 2 * 2 * tokens * WIDTH * HIDDEN
    results = {"tokens": tokens, "images": args.images, "flop": flop, "device": device,
               "gpu": torch.cuda.get_device_name() if device == "cuda" else None, "torch": torch.__version__,
               "variants": {}, "gelu_and_quantize": {}}
    for name, module in variants.items():
        row = results["variants"][name] = {}
        try:
            with torch.no_grad():
                fn = module if args.cpu else torch.compile(module)
                row["error"] = error(fn(x), reference)
                if not args.cpu:
                    row["ms"] = round(timed(fn, x), 3)
                    row["tflop_per_s"] = round(flop / (row["ms"] * 1e-3) / 1e12, 1)
                    row["kernels"] = top_kernels(fn, x)
        except Exception as e:  # a kernel refused (as torch 2.11's first took the block scales): the others still run
            row["failed"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
            traceback.print_exc()
        print(name, json.dumps(row)[:400], flush=True)
    if not args.cpu:  # the step between fc1 and fc2 alone: read bf16 [M, 4736], write e4m3 and the scales
        hidden = torch.randn(tokens, HIDDEN, device=device, dtype=torch.bfloat16)
        moved = tokens * HIDDEN * 3
        zero = torch.zeros(HIDDEN, device=device, dtype=torch.bfloat16)
        for name, quantize in (("rows", quantize_rows), ("1 x 128 groups", quantize_groups),
                               ("1 x 128 groups, the project's kernel", None)):
            fn = torch.compile(lambda h, quantize=quantize: quantize(F.gelu(h))) if quantize else \
                torch.compile(lambda h: torch.ops.sam3_experiment.gelu_quantize_groups(h, zero))
            ms = timed(fn, hidden)
            results["gelu_and_quantize"][name] = {"ms": round(ms, 3), "gb_per_s": round(moved / (ms * 1e-3) / 1e9),
                                                  "kernels": top_kernels(fn, hidden, 4)}
            print("gelu + quantize", name, results["gelu_and_quantize"][name], flush=True)
        results["fc2_alone"] = fc2_alone(bf16.fc2, tokens)
    (args.out / "vit-mlp-fp8.json").write_text(json.dumps(results, indent=2) + "\n")
    lines = [f"# One ViT MLP at {tokens} tokens ({results['gpu'] or 'CPU check'}, torch {torch.__version__})", "",
             "| variant | ms | TFLOP/s | max abs error | relative L2 error vs fp32 |", "|---|---|---|---|---|"]
    for name, row in results["variants"].items():
        err = row.get("error", {})
        lines.append(f"| {name} | {row.get('ms', row.get('failed', '-'))} | {row.get('tflop_per_s', '-')} | "
                     f"{err.get('max_abs', float('nan')):.4g} | {err.get('relative_l2', float('nan')):.4g} |")
    if results.get("fc2_alone"):
        lines += ["", "| fc2 alone (4736 -> 1024) | ms | TFLOP/s |", "|---|---|---|"]
        lines += [f"| {n} | {r.get('ms', r.get('failed'))} | {r.get('tflop_per_s', '-')} |"
                  for n, r in results["fc2_alone"].items()]
    if results["gelu_and_quantize"]:
        lines += ["", "| GELU + quantize alone | ms | GB/s |", "|---|---|---|"]
        lines += [f"| {n} | {r['ms']} | {r['gb_per_s']} |" for n, r in results["gelu_and_quantize"].items()]
    (args.out / "vit-mlp-fp8.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
