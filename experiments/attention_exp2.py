"""Where the op `sam3_aoti::attention` (runtime/attention.py) spends its exps: the SFU's exp2 for every score (today),
a share of each key step's exps emulated on the FMA units (FlashAttention-4's trick: `EMULATED_N` more keys a step,
`runtime.attention._exp2_emulated`), and the SFU's packed bf16x2 exp2 (two a register, if sm_90 has it at twice the
rate). At head dim 32 (the DETR encoder) a score is 128 tensor FLOPs and one exp, so the SFU's 16 exps a clock per
SM are the floor; at 64 (the ViT) the two are about even.

Shapes, bf16 in the projections' layouts: the DETR encoder's self-attention (5,184 tokens, 8 heads x 32) at 1 and
16 pairs; the ViT's windowed (9 windows of 576 tokens an image) and global (5,184) attentions, 16 heads x 64, at 1
and 16 images. Each variant: median ms of CUDA-event timings, TFLOP/s, the exp floor (exps at the SFU's rate of 16
a clock per SM), and the error against fp32 SDPA (max abs over the reference's max); cuDNN's SDPA beside them.
Writes attention-exp2.json and attention-exp2.md.
Usage: scripts/gpu_run.sh --python experiments/attention_exp2.py --out DIR [--iters N]
"""

import argparse
import json
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from sam3_aoti.measure.timing import time_calls
from sam3_aoti.runtime.attention import CONFIG, launch_attention

# name: (sequences per image or pair, tokens, heads, head dim, today's CONFIG kind)
SHAPES = {"DETR encoder": (1, 5184, 8, 32, "plain"), "ViT windowed": (9, 576, 16, 64, "wide"),
          "ViT global": (1, 5184, 16, 64, "long")}
# (BLOCK_M, BLOCK_N, warps, stages, EMULATED_N), tried beside each shape's CONFIG
VARIANTS = {32: [(64, 64, 4, 4, 16), (64, 64, 4, 4, 32), (64, 64, 4, 3, 64), (64, 32, 4, 4, 16),
                 (64, 32, 4, 4, 32), (64, 128, 4, 3, 32), (128, 64, 8, 3, 32), (128, 64, 8, 3, 16)],
            64: [(64, 64, 4, 3, 16), (64, 64, 4, 3, 32), (64, 32, 4, 3, 32), (128, 64, 8, 3, 16),
                 (128, 64, 8, 3, 32), (128, 32, 8, 3, 32), (128, 128, 8, 3, 32)]}


def projected(n: int, length: int, heads: int, dim: int) -> torch.Tensor:
    """`[N, H, L, D]` as a view of a `[N, L, H * D]` projection."""
    return torch.randn(n, length, heads * dim, device="cuda", dtype=torch.bfloat16).view(
        n, length, heads, dim).transpose(1, 2)


def sfu_rate() -> float:
    """Exps a second at 16 a clock per SM (Hopper's SFU), at the card's top clock."""
    props = torch.cuda.get_device_properties(0)
    clock_hz = getattr(props, "clock_rate", 1_980_000) * 1e3  # kHz; torch 2.11 has no clock_rate: H200's 1.98 GHz
    return props.multi_processor_count * 16 * clock_hz


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--iters", type=int, default=30)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    torch.manual_seed(0)
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "sfu_exps_per_s": sfu_rate(),
               "rows": []}
    for name, (per, tokens, heads, dim, kind) in SHAPES.items():
        for count in (1, 16):
            n = per * count
            q, k, v = (projected(n, tokens, heads, dim) for _ in range(3))
            scale = dim ** -0.5
            want = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), scale=scale).transpose(1, 2)
            flop, exps = 4 * n * heads * tokens * tokens * dim, n * heads * tokens * tokens
            variants = {"cuDNN SDPA": None, "SFU (CONFIG)": (CONFIG[kind], False),
                        "packed bf16x2 (CONFIG)": (CONFIG[kind], True)}
            variants.update({"emulated " + "x".join(map(str, c)): (c, False) for c in VARIANTS[dim]})
            for label, variant in variants.items():
                if variant is None:
                    def run():
                        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                            return F.scaled_dot_product_attention(q, k, v, scale=scale).transpose(1, 2)
                else:
                    config, packed = variant
                    run = lambda config=config, packed=packed: launch_attention(q, k, v, scale, config=config,
                                                                                packed=packed)
                row = {"shape": name, "count": count, "variant": label}
                try:
                    err = float((run().float() - want).abs().max() / want.abs().max())
                    ms = statistics.median(time_calls(run, (), "cuda", 5, args.iters))
                    row.update(ms=round(ms, 4), tflops=round(flop / ms / 1e9, 1), error=err,
                               exp_floor_ms=round(exps / results["sfu_exps_per_s"] * 1e3, 4))
                except Exception as e:  # a config that does not fit, or an instruction the card lacks
                    row["failed"] = f"{type(e).__name__}: {str(e).splitlines()[0][:160]}"
                results["rows"].append(row)
                print(json.dumps(row), flush=True)
            write(results, args.out)  # after every shape: a run stopped early keeps what it measured


def write(results: dict, out: Path) -> None:
    (out / "attention-exp2.json").write_text(json.dumps(results, indent=1))
    lines = [f"# The attention kernel's exps ({results['device']}, torch {results['torch']})", "",
             "| shape | images or pairs | variant | ms | TFLOP/s | SFU exp floor ms | error |",
             "|---|---|---|---|---|---|---|"]
    for r in results["rows"]:
        if "failed" in r:
            lines.append(f"| {r['shape']} | {r['count']} | {r['variant']} | failed: {r['failed']} | | | |")
        else:
            lines.append(f"| {r['shape']} | {r['count']} | {r['variant']} | {r['ms']} | {r['tflops']} | "
                         f"{r['exp_floor_ms']} | {r['error']:.1e} |")
    (out / "attention-exp2.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
