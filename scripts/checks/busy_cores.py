"""How many cores a command keeps busy, sampled: /proc/stat every few seconds while it runs, to a TSV (seconds since
start, busy cores) and a summary line (the mean, the seconds spent with fewer than all but half a core busy, and the
core-seconds busy against those of the command's own processes).
On 2 cores the suite's wall time is its CPU work over two cores only while both are busy: this shows where not.

Usage: python scripts/checks/busy_cores.py --out samples.tsv [--every 5] -- COMMAND...
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import time
from pathlib import Path


def jiffies() -> tuple[int, int]:
    """(all, idle + iowait) jiffies since boot, summed over the cores."""
    fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    return sum(fields[:8]), fields[3] + fields[4]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--every", type=float, default=5.0)
    parser.add_argument("command", nargs=argparse.REMAINDER)
    args = parser.parse_args()
    command = args.command[1:] if args.command[:1] == ["--"] else args.command
    if not command:
        parser.error("name the command to run after --")
    cores = len(os.sched_getaffinity(0))
    start, before = time.monotonic(), jiffies()
    proc = subprocess.Popen(command)
    samples = []
    with args.out.open("w") as out:
        while proc.poll() is None:
            time.sleep(args.every)
            now = jiffies()
            busy = cores * (1 - (now[1] - before[1]) / max(now[0] - before[0], 1))
            samples.append(busy)
            out.write(f"{time.monotonic() - start:.0f}\t{busy:.2f}\n")
            out.flush()
            before = now
    short = sum(args.every for busy in samples if busy < cores - 0.5)
    waited = resource.getrusage(resource.RUSAGE_CHILDREN)
    print(f"{len(samples) * args.every:.0f} s sampled: {sum(samples) / max(len(samples), 1):.2f} of {cores} cores "
          f"busy on average; {short:.0f} s with fewer than {cores - 0.5:g} busy; {sum(samples) * args.every:.0f} "
          f"core-seconds busy, {waited.ru_utime + waited.ru_stime:.0f} of them in the command's processes that were "
          "waited for (the rest: processes it left to others, such as Ray's daemons, or other work)", file=sys.stderr)
    sys.exit(proc.returncode)


if __name__ == "__main__":
    main()
