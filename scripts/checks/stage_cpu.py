"""CPU time per stage of a doit run: on a machine of few cores a build's wall time is its CPU work spread over the
cores, so this says what a change to the graph costs there (the stages' logs give only wall times).

Runs COMMAND and samples /proc every 0.2 s: each process's CPU time (user + system), charged to the stage process
(`python -m sam3_aoti.stages.NAME`) it descends from, compile workers and compilers included. A process that lives
less than a sample is missed. Prints one JSON object: stage -> CPU seconds, and the command's wall time (the
command's own output goes to stderr).

Usage: uv run python scripts/checks/stage_cpu.py -- uv run doit
"""

from __future__ import annotations

import collections
import json
import os
import subprocess
import sys
import time

TICK = os.sysconf("SC_CLK_TCK")


def sample(seen: dict) -> None:
    """pid -> [parent pid, command line, CPU seconds so far] for every process now."""
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                stat = f.read()
            fields = stat[stat.rindex(")") + 2:].split()
            if pid not in seen:
                with open(f"/proc/{pid}/cmdline") as f:
                    seen[pid] = [fields[1], f.read().replace("\0", " "), 0.0]
            seen[pid][2] = (int(fields[11]) + int(fields[12])) / TICK
        except (OSError, ValueError, IndexError):
            pass  # it ended between the listing and the read


def stage_of(pid: str, seen: dict, ours: str) -> str | None:
    """The stage a process belongs to; None for one outside the command's tree."""
    while pid in seen:
        parent, command, _ = seen[pid]
        if "sam3_aoti.stages." in command:
            return command.split("sam3_aoti.stages.")[1].split()[0]
        if pid == ours:
            return "doit and the rest"
        pid = parent
    return None


def main() -> None:
    command = sys.argv[sys.argv.index("--") + 1:] if "--" in sys.argv else sys.argv[1:]
    if not command:
        sys.exit(__doc__)
    t0 = time.monotonic()
    proc = subprocess.Popen(command, stdout=sys.stderr)  # stdout holds the JSON alone
    seen: dict = {}
    while proc.poll() is None:
        sample(seen)
        time.sleep(0.2)
    per_stage = collections.Counter()
    for pid, (_, _, cpu) in seen.items():
        if stage := stage_of(pid, seen, str(proc.pid)):
            per_stage[stage] += cpu
    print(json.dumps({"wall_s": round(time.monotonic() - t0, 1), "returncode": proc.returncode,
                      "cpu_s": {k: round(v, 1) for k, v in per_stage.most_common()},
                      "cpu_s_in_all": round(sum(per_stage.values()), 1)}, indent=1))


if __name__ == "__main__":
    main()
