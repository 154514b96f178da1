"""How fast segment's CPU tasks decode a collection like `doit throughput`'s: `worker.decode_batch` in batches of
`engine.DECODE_BATCH`, as Ray's tasks call it, in ms an image for the 4000 px JPEGs and PNGs and for the rest, on
one core. The decoding is what feeds the GPU actors (`gpu_full.sh`'s ceiling run), so its rate is the pipeline's.
`--src` times another checkout's code (`git archive REV src | tar -x -C DIR`) on the same files.

Usage: python scripts/checks/decode_rate.py [--images 64] [--src DIR/src] [--rounds 2]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
import time
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--images", type=int, default=64)
    parser.add_argument("--src", type=Path, default=Path(__file__).resolve().parents[2] / "src")
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    sys.path.insert(0, str(args.src))

    from PIL import Image

    from sam3_aoti.batch.engine import DECODE_BATCH
    from sam3_aoti.batch.worker import decode_batch
    from sam3_aoti.measure.collection import write_collection

    folder = Path(tempfile.gettempdir()) / f"sam3-aoti-decode-rate-{args.images}"
    write_collection(folder, args.images, 1008, 4000, 0)  # written once, then reused
    files = sorted(p for p in folder.iterdir() if p.suffix in (".jpg", ".png"))
    for f in files:
        f.read_bytes()  # in the page cache, as a run's second pass would find them
    large = {f for f in files if Image.open(f).width >= 4000}
    groups = {"4000 px JPEG": [f for f in files if f in large and f.suffix == ".jpg"],
              "4000 px PNG": [f for f in files if f in large and f.suffix == ".png"],
              "other JPEG": [f for f in files if f not in large and f.suffix == ".jpg"],
              "other PNG": [f for f in files if f not in large and f.suffix == ".png"], "all": files}

    def ms_an_image(group: list) -> float:
        best = float("inf")
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            for i in range(0, len(group), DECODE_BATCH):
                decode_batch({"source": [str(f) for f in group[i:i + DECODE_BATCH]]})
            best = min(best, (time.perf_counter() - t0) / len(group) * 1e3)
        return round(best, 1)

    result = {"src": str(args.src), "images": len(files),
              "ms_an_image": {name: ms_an_image(group) for name, group in groups.items() if group},
              "counts": {name: len(group) for name, group in groups.items()}}
    print(json.dumps(result, indent=2))


if __name__ == "__main__":
    main()
