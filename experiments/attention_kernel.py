"""The op `sam3_aoti::attention` (runtime/attention.py) against SDPA on SAM3's two image-token attentions, and
which block sizes it should launch with (runtime.attention.CONFIG): the figures behind `[export] optimizations`'
`attention_kernel` and `grid_bias_attention`.

Shapes, in the layouts the package has them (bf16, `[N, L, 8 * 32]` projections viewed as `[N, 8, L, 32]`):
  DETR encoder self-attention, 5184 x 5184 tokens, N = 1, 6, 16 pairs: SDPA's cuDNN, flash and memory-efficient
  kernels, then the Triton kernel at every config;
  DETR decoder cross-attention, 201 queries x 5184 tokens with the box bias, N = 1, 16: SDPA on the bias as the
  package assembles it (`grid_bias` + `dense_mask`, timed with and without that assembly), then the kernel on the
  two per-axis tables. Both also as FlexAttention (torch.compile'd; the bias as a score_mod reading the tables).
Each column: median ms of CUDA-event timings (bench's `time_calls`), TFLOP/s (4 * N * H * Lq * Lk * D), and the
error against fp32 SDPA (max abs, relative to the reference's max). Writes attention-kernel.json and a table.
Usage: scripts/gpu_run.sh --python experiments/attention_kernel.py [--out DIR] [--iters N] [--chosen-only]
"""

import argparse
import itertools
import json
import statistics
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from sam3_aoti.model.export_fixes import dense_mask
from sam3_aoti.runtime.attention import CONFIG, grid_bias, launch_attention
from sam3_aoti.measure.timing import time_calls

HEADS, HEAD_DIM, SIDE, QUERIES = 8, 32, 72, 201
BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION}
CONFIGS = list(itertools.product((64, 128), (32, 64, 128), (4, 8), (2, 3, 4, 5)))


def projected(n: int, length: int) -> torch.Tensor:
    """`[N, 8, L, 32]` as a view of a `[N, L, 256]` projection, as transformers' attention hands it over."""
    return torch.randn(n, length, HEADS * HEAD_DIM, device="cuda", dtype=torch.bfloat16).view(
        n, length, HEADS, HEAD_DIM).transpose(1, 2)


def error(out: torch.Tensor, want: torch.Tensor) -> float:
    return float((out.float() - want).abs().max() / want.abs().max())


def measure(fn, iters: int) -> float:
    return statistics.median(time_calls(fn, (), "cuda", 5, iters))


def row(ms: float, flop: int, err: float, **extra) -> dict:
    return {"ms": round(ms, 4), "tflops": round(flop / ms / 1e9, 1), "error": err, **extra}


def shapes():
    for n in (1, 6, 16):
        yield f"DETR encoder self-attn N={n}", n, 5184, False
    for n in (1, 16):
        yield f"DETR decoder box-biased cross-attn N={n}", n, QUERIES, True


def write(results: dict, out: Path) -> None:
    """attention-kernel.json and its table, attention-kernel.md."""
    out.mkdir(parents=True, exist_ok=True)
    (out / "attention-kernel.json").write_text(json.dumps(results, indent=1))
    lines = ["| shape | " + " | ".join([*BACKENDS, "flex"]) + " | kernel (CONFIG) | fastest config | error (kernel) |",
             "|---|" + "---|" * (len(BACKENDS) + 4)]
    for name, shape in results["shapes"].items():
        cells = [f"{c['ms']} ({c['tflops']} TF/s)" if "ms" in c else "n/a" for c in shape["baselines"].values()]
        chosen, fastest = shape["kernel"][shape["chosen"]], shape["kernel"][shape["fastest"]]
        lines.append(f"| {name} | " + " | ".join(cells) + f" | {chosen.get('ms')} ({chosen.get('tflops')} TF/s) | "
                     f"{shape['fastest']}: {fastest['ms']} | {chosen.get('error', 0):.2e} |")
    (out / "attention-kernel.md").write_text("\n".join(lines) + "\n")


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--out", type=Path, default=Path("."))
    parser.add_argument("--iters", type=int, default=30)
    parser.add_argument("--chosen-only", action="store_true", help="the kernel at CONFIG's blocks only")
    args = parser.parse_args()
    torch.manual_seed(0)
    results = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "shapes": {}}
    for name, n, q_len, biased in shapes():
        q, k, v = projected(n, q_len), projected(n, SIDE * SIDE), projected(n, SIDE * SIDE)
        scale = HEAD_DIM ** -0.5
        by = bx = None
        if biased:
            by, bx = (torch.randn(n, HEADS, q_len, SIDE, device="cuda") for _ in range(2))
        flop = 4 * n * HEADS * q_len * SIDE * SIDE * HEAD_DIM
        bias = None if by is None else grid_bias(by, bx)
        want = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=bias, scale=scale)
        want = want.transpose(1, 2)
        columns = {}

        def assembled():  # the bias as the package hands SDPA its
            return dense_mask(grid_bias(by, bx), torch.bfloat16, q_len, SIDE * SIDE)

        mask = assembled() if biased else None
        for backend, kind in BACKENDS.items():
            try:
                with sdpa_kernel([kind]):
                    sdpa = lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
                    out = sdpa().transpose(1, 2)
                    columns[backend] = row(measure(sdpa, args.iters), flop, error(out, want))
                    if biased:
                        both = lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=assembled(), scale=scale)
                        columns[backend]["ms_with_bias_assembly"] = round(measure(both, args.iters), 4)
            except RuntimeError as e:
                columns[backend] = {"error": str(e).splitlines()[0][:120]}
        try:  # FlexAttention: torch's own generated Triton attention, the bias as a score_mod reading the tables
            from torch.nn.attention.flex_attention import flex_attention

            def grid_score(score, b, h, i, j):
                return score + by[b, h, i, j // SIDE] + bx[b, h, i, j % SIDE]

            flex = torch.compile(flex_attention, dynamic=False)
            run = lambda: flex(q, k, v, score_mod=grid_score if biased else None, scale=scale)
            columns["flex"] = row(measure(run, args.iters), flop, error(run().transpose(1, 2), want))
        except Exception as e:
            columns["flex"] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:100]}"}
        kernel = {}
        configs = CONFIGS if not args.chosen_only else [CONFIG["biased" if biased else "plain"]]
        for config in configs if not biased else [c for c in configs if c[1] == 64]:  # biased: 8 x 8 cells
            try:
                run = lambda: launch_attention(q, k, v, scale, by, bx, config=config)
                kernel["x".join(map(str, config))] = row(measure(run, args.iters), flop, error(run(), want))
            except Exception as e:  # a config that does not fit (shared memory, registers)
                kernel["x".join(map(str, config))] = {"error": f"{type(e).__name__}: {str(e).splitlines()[0][:100]}"}
        chosen = "x".join(map(str, CONFIG["biased" if biased else "plain"]))
        fastest = min((c for c in kernel if "ms" in kernel[c]), key=lambda c: kernel[c]["ms"])
        results["shapes"][name] = {"baselines": columns, "kernel": kernel, "chosen": chosen, "fastest": fastest}
        print(f"{name}: " + ", ".join(f"{b} {c.get('ms')} ms" for b, c in columns.items())
              + f"; kernel {chosen} {kernel[chosen].get('ms')} ms, fastest {fastest} {kernel[fastest]['ms']} ms",
              flush=True)
        write(results, args.out)  # after every shape: a run stopped early keeps what it measured
    print((args.out / "attention-kernel.md").read_text())


if __name__ == "__main__":
    main()
