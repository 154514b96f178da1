"""segment's start-up on this machine: `sam3-aoti segment` over a few photographs, `--runs` times, each in a process
of its own that starts its own local Ray, and the split of each run's time until the first results (segment's
summary: listing and checks, Ray's start, the actors' start and first batch), with the medians. `--src` (repeated)
runs other checkouts' code (`git archive REV src | tar -x -C DIR`), one run of each in turn, so versions compare on
one machine under the same drift.

Usage: python scripts/checks/segment_startup.py PACKAGE [--runs 8] [--images 16] [--batch-size 4] [--src DIR/src ...]
       [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("package", type=Path)
    parser.add_argument("--runs", type=int, default=8)
    parser.add_argument("--images", type=int, default=16)
    parser.add_argument("--batch-size", type=int, default=4, help="segment's; doit throughput's is 16")
    parser.add_argument("--src", type=Path, action="append", help="default: this checkout's src")
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    srcs = args.src or [Path(__file__).resolve().parents[2] / "src"]
    sys.path.insert(0, str(srcs[0]))
    from sam3_aoti.measure.collection import write_collection

    folder = Path(tempfile.mkdtemp(prefix="segment-startup-"))
    runs = {str(src): [] for src in srcs}
    try:
        write_collection(folder / "photos", args.images, 1008, 1400, 0)
        for _ in range(args.runs):
            for src in srcs:
                shutil.rmtree(folder / "out", ignore_errors=True)
                path = os.pathsep.join(filter(None, [str(src), os.environ.get("PYTHONPATH")]))
                command = [sys.executable, "-m", "sam3_aoti", "segment", str(folder / "photos"), "--package",
                           str(args.package.absolute()), "--prompt", "a cat", "--output", str(folder / "out"),
                           "--batch-size", str(args.batch_size)]
                proc = subprocess.run(command, capture_output=True, text=True, env={**os.environ, "PYTHONPATH": path},
                                      check=True)
                summary = json.loads([line for line in proc.stdout.splitlines() if line.startswith("{")][-1])
                runs[str(src)].append({"first_result_s": summary["first_result_s"], **summary["startup"]})
                print(src, json.dumps(runs[str(src)][-1]), flush=True)
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    result = {src: {"runs": each, "medians": {key: round(statistics.median(run[key] for run in each), 2)
                                               for key in each[0]}} for src, each in runs.items()}
    for src, each in result.items():
        print(src, "medians:", json.dumps(each["medians"]))
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")

if __name__ == "__main__":
    main()
