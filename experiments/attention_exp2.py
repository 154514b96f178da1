"""What the op `sam3_aoti::attention` (runtime/attention.py) spends on each score beside its two dots, variant by
variant: the key masks (today's kernel masks every key and selects -inf per score, though SAM3's 5,184 and 576 keys
fill every step: `EVEN` drops both), the rescale of the accumulator at every key step (`LAZY`: only when some row's
max grows by 8 in log2 units, FlashAttention-4's rule), the SFU's packed bf16x2 exp2 (two a register), and a share of
each step's exps emulated on the FMA units (FlashAttention-4's trick: `EMULATED_N` more keys a step,
`runtime.attention._exp2_emulated`). At head dim 32 (the DETR encoder) a score is 128 tensor FLOPs and one exp on
the SFU's 16 a clock per SM; at 64 (the ViT) the two are about even.

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
# (BLOCK_M, BLOCK_N, warps, stages, EMULATED_N) tried beside each shape's CONFIG, each even (no key masks) and lazy
TILES = {32: [(64, 128, 4, 3, 0), (64, 64, 4, 4, 16), (64, 128, 4, 3, 32)],
         64: [(64, 64, 4, 3, 0), (128, 128, 8, 3, 0), (64, 32, 4, 3, 32), (128, 64, 8, 3, 16)]}


def variants(kind: str, dim: int) -> dict:
    """label -> launch_attention's keywords (None: cuDNN's SDPA)."""
    today = CONFIG[kind]
    out = {"cuDNN SDPA": None, "today (masked keys)": dict(config=today, even=False),
           "even": dict(config=today), "even, lazy": dict(config=today, lazy=True),
           "even, packed": dict(config=today, packed=True), "even, lazy, packed": dict(config=today, lazy=True,
                                                                                       packed=True)}
    for tile in TILES[dim]:
        out["even, lazy " + "x".join(map(str, tile))] = dict(config=tile, lazy=True)
    return out


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
            for label, keywords in variants(kind, dim).items():
                if keywords is None:
                    def run():
                        with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                            return F.scaled_dot_product_attention(q, k, v, scale=scale).transpose(1, 2)
                else:
                    run = lambda keywords=keywords: launch_attention(q, k, v, scale, **keywords)
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
