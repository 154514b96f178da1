#!/usr/bin/env python3
"""Launch shapes of the fp8 MLP's GELU + 1 x 128 group quantization kernel (`experiments/gelu_groups.py`), timed
on 16 images' tokens (82,944 x 4736 bf16 in, e4m3 and scales out): rows per program, warps, and which grid axis
runs fastest. Each shape's output is checked against the default launch's (bit for bit), and its rate against the
bytes it must move. The default launch is the first row, so a better shape is a change of `ROWS`, `NUM_WARPS`,
`GROUPS_FIRST` backed by this table.
Usage: python3 experiments/gelu_groups_tune.py --out DIR   (on a CUDA GPU; writes DIR/gelu-groups-tune.{json,md})
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402

from sam3_aoti.measure.timing import time_calls  # noqa: E402
import gelu_groups  # noqa: E402  (this folder's)

HIDDEN, TOKENS_PER_IMAGE = 4736, 72 * 72


def kernel_inputs(description: str):
    """The command line (--out DIR, --images N) and the kernel's inputs for N images' tokens: (args, x, bias, the
    bytes the kernel must move)."""
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--images", type=int, default=16)
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    tokens = args.images * TOKENS_PER_IMAGE
    torch.manual_seed(0)
    x = torch.randn(tokens, HIDDEN, device="cuda", dtype=torch.bfloat16)
    bias = torch.randn(HIDDEN, device="cuda", dtype=torch.bfloat16) * 0.02
    moved = tokens * HIDDEN * (2 + 1) + tokens * (HIDDEN // 128) * 4  # bf16 in, e4m3 out, fp32 scales out
    return args, x, bias, moved


def main() -> None:
    args, x, bias, moved = kernel_inputs(__doc__.splitlines()[0])
    tokens = x.shape[0]
    default = dict(rows=gelu_groups.ROWS, num_warps=gelu_groups.NUM_WARPS, groups_first=gelu_groups.GROUPS_FIRST)
    want = gelu_groups.launch_gelu_groups(x, bias, **default)
    # a copy of the same bytes, the rate this card's memory gives a plain read-and-write
    copy_ms = statistics.median(time_calls(lambda t: t.clone(), (x,), "cuda", 5, 20))
    shapes = [default] + [dict(rows=r, num_warps=w, groups_first=g) for r, w, g in
                          itertools.product((8, 16, 32, 64, 128), (1, 2, 4, 8), (False, True))
                          if (r, w, g) != tuple(default.values())]
    results = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "tokens": tokens,
               "bytes_moved": moved, "clone_ms": round(copy_ms, 4),
               "clone_gb_per_s": round(2 * x.numel() * 2 / (copy_ms * 1e-3) / 1e9), "shapes": []}
    for shape in shapes:
        row = dict(shape)
        try:
            got = gelu_groups.launch_gelu_groups(x, bias, **shape)
            row["same"] = bool(torch.equal(got[0].view(torch.uint8), want[0].view(torch.uint8))
                               and torch.equal(got[1], want[1]))
            ms = statistics.median(time_calls(lambda t: gelu_groups.launch_gelu_groups(t, bias, **shape), (x,),
                                              "cuda", 5, 20))
            row.update(ms=round(ms, 4), gb_per_s=round(moved / (ms * 1e-3) / 1e9))
        except Exception as e:  # a shape Triton refuses (too many registers) is a row, not the end
            row["failed"] = f"{type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        results["shapes"].append(row)
        print(json.dumps(row), flush=True)
    (args.out / "gelu-groups-tune.json").write_text(json.dumps(results, indent=2) + "\n")
    timed = sorted((r for r in results["shapes"] if "ms" in r), key=lambda r: r["ms"])
    lines = [f"# GELU + group quantization launch shapes, {tokens} x {HIDDEN} ({results['gpu']}, torch "
             f"{torch.__version__})", "", f"A bf16 clone of the input: {results['clone_ms']} ms "
             f"({results['clone_gb_per_s']} GB/s). First row: today's launch; then the ten fastest.", "",
             "| rows | warps | groups first | ms | GB/s | same output |", "|---|---|---|---|---|---|"]
    for r in [results["shapes"][0]] + timed[:10]:
        lines.append(f"| {r['rows']} | {r['num_warps']} | {r['groups_first']} | {r.get('ms', r.get('failed'))} | "
                     f"{r.get('gb_per_s', '-')} | {r.get('same', '-')} |")
    (args.out / "gelu-groups-tune.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
