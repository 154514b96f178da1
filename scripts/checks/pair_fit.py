"""The cost of an image, a pair and a call, from a bench: a least-squares fit of `ms = image * B + pair * B * P +
call` to the medians of one column over the bench's (B, P) shapes (issue #28's "a pair in <= 1.4 ms").
  python scripts/checks/pair_fit.py benchmarks/h200-2026-12-03-text-qkv/bench-split.json ["AOTI + CUDA graphs"]"""

import json
import sys

import numpy as np

bench = json.load(open(sys.argv[1]))
column = sys.argv[2] if len(sys.argv) > 2 else "AOTI + CUDA graphs"
rows = [r for r in bench["rows"] if column in r["backends"]]
if len(rows) < 3:
    sys.exit(f"{sys.argv[1]}: {len(rows)} shapes with the column {column!r}; the fit needs three or more")
shapes = np.array([[r["batch"], r["batch"] * r["prompts"], 1.0] for r in rows])
ms = np.array([r["backends"][column]["median_ms"] for r in rows])
(image, pair, call), *_ = np.linalg.lstsq(shapes, ms, rcond=None)
residuals = ms - shapes @ np.array([image, pair, call])
print(f"{column}, {len(rows)} shapes: {image:.2f} ms per image + {pair:.2f} per pair + {call:.1f} per call; "
      f"residuals within {np.abs(residuals).max():.2f} ms")
