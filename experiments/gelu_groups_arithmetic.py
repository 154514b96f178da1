#!/usr/bin/env python3
"""What the arithmetic of the fp8 MLP's GELU + 1 x 128 group quantization kernel (`experiments/gelu_groups.py`) costs,
on 16 images' tokens (82,944 x 4736 bf16 in, e4m3 and scales out). Its launch shapes are all within 4 % of each
other (`gelu_groups_tune.py`), so this times the same launch with its arithmetic changed, one step at a time:
the division by the scale as IEEE division per value (today's), as one reciprocal per row and a product per
value, or as the fast approximate division; and the same without the GELU's erf (a floor, not a candidate: it is
another function). Each variant's bytes are compared with today's kernel: a variant that changes them would
change the package's numbers, so it is a candidate only if `same` holds or verify's gates are re-measured.
Usage: python3 experiments/gelu_groups_arithmetic.py --out DIR   (on a CUDA GPU; writes DIR/gelu-groups-arithmetic.{json,md})
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from sam3_aoti.measure.timing import time_calls  # noqa: E402
import gelu_groups  # noqa: E402  (this folder's)
from gelu_groups_tune import HIDDEN, kernel_inputs  # noqa: E402  (this folder's: the same inputs)
DIVISIONS = {"IEEE division per value": 0, "reciprocal per row, product per value": 1, "fast division": 2}


@triton.jit
def _variant_kernel(x_ptr, bias_ptr, values_ptr, scales_ptr, m, k, stride_x, ROWS: tl.constexpr,
                    GROUP: tl.constexpr, E4M3_MAX: tl.constexpr, MIN_AMAX: tl.constexpr, GELU: tl.constexpr,
                    DIVISION: tl.constexpr):
    row_block, group = tl.program_id(0), tl.program_id(1)
    rows = (row_block * ROWS + tl.arange(0, ROWS)).to(tl.int64)
    cols = group * GROUP + tl.arange(0, GROUP)
    inside = rows[:, None] < m
    x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=inside, other=0.0)
    bias = tl.load(bias_ptr + cols)
    h = (x.to(tl.float32) + bias.to(tl.float32)).to(x.dtype).to(tl.float32)
    if GELU:
        y = (h * 0.5 * (1.0 + tl.math.erf(h * 0.7071067811865476))).to(x.dtype).to(tl.float32)
    else:
        y = h
    scale = tl.maximum(tl.max(tl.abs(y), axis=1), MIN_AMAX) / E4M3_MAX
    if DIVISION == 0:
        q = tl.math.div_rn(y, scale[:, None])
    elif DIVISION == 1:
        q = y * tl.math.div_rn(1.0, scale)[:, None]
    else:
        q = tl.fdiv(y, scale[:, None], ieee_rounding=False)
    values = tl.clamp(q, -E4M3_MAX, E4M3_MAX)
    tl.store(values_ptr + rows[:, None] * k + cols[None, :], values.to(tl.float8e4nv), mask=inside)
    tl.store(scales_ptr + group * m + rows, scale, mask=rows < m)


def launch(x, bias, gelu: bool, division: int):
    m, k = x.shape
    values = torch.empty((m, k), dtype=gelu_groups.E4M3, device=x.device)
    scales = torch.empty((k // gelu_groups.GROUP, m), dtype=torch.float32, device=x.device)
    grid = (triton.cdiv(m, gelu_groups.ROWS), k // gelu_groups.GROUP)
    _variant_kernel[grid](x, bias, values, scales, m, k, x.stride(0), ROWS=gelu_groups.ROWS, GROUP=gelu_groups.GROUP,
                          E4M3_MAX=gelu_groups.E4M3_MAX, MIN_AMAX=gelu_groups.MIN_SCALE_AMAX, GELU=gelu,
                          DIVISION=division, num_warps=gelu_groups.NUM_WARPS)
    return values, scales


def main() -> None:
    args, x, bias, moved = kernel_inputs(__doc__.splitlines()[0])
    tokens = x.shape[0]
    today = gelu_groups.launch_gelu_groups(x, bias)

    def ms_of(fn) -> float:
        return statistics.median(time_calls(fn, (x,), "cuda", 5, 20))

    results = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
               "tokens": tokens, "bytes_moved": moved, "clone_ms": round(ms_of(lambda t: t.clone()), 4),
               "today_ms": round(ms_of(lambda t: gelu_groups.launch_gelu_groups(t, bias)), 4), "variants": []}
    for gelu in (True, False):
        for name, division in DIVISIONS.items():
            values, scales = launch(x, bias, gelu, division)
            same_scales = bool(torch.equal(scales, today[1]))
            differing = int((values.view(torch.uint8) != today[0].view(torch.uint8)).sum())
            ms = ms_of(lambda t, g=gelu, d=division: launch(t, bias, g, d))
            row = {"gelu": gelu, "division": name, "ms": round(ms, 4), "gb_per_s": round(moved / (ms * 1e-3) / 1e9),
                   "same": same_scales and differing == 0, "values_differing": differing,
                   "values_differing_share": round(differing / values.numel(), 8)}
            results["variants"].append(row)
            print(json.dumps(row), flush=True)
    (args.out / "gelu-groups-arithmetic.json").write_text(json.dumps(results, indent=2) + "\n")
    lines = [f"# GELU + group quantization: the arithmetic's cost, {tokens} x {HIDDEN} ({results['gpu']}, torch "
             f"{results['torch']}, Triton {results['triton']})", "",
             f"Today's kernel: {results['today_ms']} ms; a bf16 clone of the input: {results['clone_ms']} ms. Rows "
             "without the GELU are floors (another function), not candidates.", "",
             "| GELU (erf) | division | ms | GB/s | bytes as today's | values differing |", "|---|---|---|---|---|---|"]
    for r in results["variants"]:
        lines.append(f"| {'yes' if r['gelu'] else 'no (floor)'} | {r['division']} | {r['ms']} | {r['gb_per_s']} | "
                     f"{r['same'] if r['gelu'] else '-'} | {r['values_differing']} ({r['values_differing_share']:.2e}) |")
    (args.out / "gelu-groups-arithmetic.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
