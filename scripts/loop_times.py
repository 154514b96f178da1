"""How long the project's own loops take on this machine, each from a fresh clone of the checkout's HEAD:

  chain   `uv run doit` (the tiny profile's default chain on the CPU): the environment's sync, then doit, with
          each stage's seconds from its log
  quick   `uv run pytest -m "not slow"`, alone, and again beside a tiny build (what a developer's machine does)
  suite   `bash .ci/run` (what CI runs), with the tests' kept builds cold (an empty SAM3_AOTI_TEST_BUILDS)

Writes loops.json and loops.md into OUT. Usage: uv run python scripts/loop_times.py OUT [--parts chain quick suite]
"""

from __future__ import annotations

import argparse
import json
import os
import re
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
STAGE_DONE = re.compile(r"^\[(\w+) +([\d.]+)s\] done$", re.M)


def clone(into: Path) -> Path:
    subprocess.run(["git", "clone", "-q", str(REPO), str(into)], check=True)
    return into


def timed(command: list[str], cwd: Path, env: dict | None = None, log: Path | None = None) -> tuple[float, str, int]:
    t0 = time.monotonic()
    proc = subprocess.run(command, cwd=cwd, env={**os.environ, **(env or {})}, capture_output=True, text=True)
    seconds = round(time.monotonic() - t0, 1)
    output = proc.stdout + proc.stderr
    if log:
        log.write_text(output)
    return seconds, output, proc.returncode


def chain(scratch: Path, out: Path) -> dict:
    repo = clone(scratch / "chain")
    sync, _, _ = timed(["uv", "sync", "--locked"], repo)
    doit, output, rc = timed(["uv", "run", "--locked", "doit"], repo, log=out / "chain.log")
    stages = {}
    for log in sorted((repo / "artifacts").glob("*/logs/*.log")):
        found = STAGE_DONE.findall(log.read_text())
        if found and not log.name.endswith(".output.log"):
            stages[found[-1][0]] = float(found[-1][1])
    return {"uv_sync_s": sync, "doit_s": doit, "exit": rc, "stages_s": stages}


def quick(scratch: Path, out: Path) -> dict:
    repo = clone(scratch / "quick")
    timed(["uv", "sync", "--locked"], repo)
    command = ["uv", "run", "--locked", "pytest", "-m", "not slow", "-q", "-p", "no:cacheprovider"]
    alone, output, rc = timed(command, repo, log=out / "quick.log")
    other = clone(scratch / "beside")
    timed(["uv", "sync", "--locked"], other)
    # The build as from another terminal: a session of its own (the kernel shares the cores between sessions).
    build = subprocess.Popen(["uv", "run", "--locked", "doit"], cwd=other, stdout=subprocess.DEVNULL,
                             stderr=subprocess.DEVNULL, start_new_session=True)
    time.sleep(20)  # the build under way (export, then compile on every core)
    beside, _, rc_beside = timed(command, repo, log=out / "quick-beside-a-build.log")
    os.killpg(build.pid, signal.SIGKILL)  # doit, its stages and their compile workers
    build.wait()
    summary = next((line for line in reversed(output.splitlines()) if " passed" in line), "")
    return {"alone_s": alone, "exit": rc, "summary": summary.strip("= "),
            "beside_a_tiny_build_s": beside, "exit_beside": rc_beside}


def suite(scratch: Path, out: Path) -> dict:
    repo = clone(scratch / "suite")
    seconds, output, rc = timed(["bash", ".ci/run"], repo, env={"SAM3_AOTI_TEST_BUILDS": str(scratch / "builds")},
                                log=out / "suite.log")
    summary = next((line for line in reversed(output.splitlines()) if " passed" in line), "")
    return {"ci_run_s": seconds, "exit": rc, "summary": summary.strip("= ")}


def table(results: dict) -> str:
    rows = ["| loop | seconds | what |", "|---|---|---|"]
    if "chain" in results:
        c = results["chain"]
        stages = ", ".join(f"{k} {v}" for k, v in c["stages_s"].items())
        rows.append(f"| tiny chain, `uv run doit` | {c['doit_s']} (+ {c['uv_sync_s']} `uv sync`) | {stages} |")
    if "quick" in results:
        q = results["quick"]
        rows.append(f"| quick loop, alone | {q['alone_s']} | {q['summary']} |")
        rows.append(f"| quick loop, beside a tiny build | {q['beside_a_tiny_build_s']} | |")
    if "suite" in results:
        s = results["suite"]
        rows.append(f"| the suite, `bash .ci/run`, kept builds cold | {s['ci_run_s']} | {s['summary']} |")
    return "\n".join(rows) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("--parts", nargs="+", default=["chain", "quick", "suite"], choices=["chain", "quick", "suite"])
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True).stdout
    results = {"commit": head.strip(), "cores": os.cpu_count(), "date": time.strftime("%Y-%m-%d")}
    with tempfile.TemporaryDirectory(prefix="sam3-aoti-loops-") as scratch:
        for part in args.parts:  # one at a time: each alone on the machine
            results[part] = globals()[part](Path(scratch), args.out)
            print(part, json.dumps(results[part]), file=sys.stderr, flush=True)
    (args.out / "loops.json").write_text(json.dumps(results, indent=2) + "\n")
    (args.out / "loops.md").write_text(f"main at {results['commit']}, {results['cores']} cores\n\n" + table(results))
    print(table(results))


if __name__ == "__main__":
    main()
