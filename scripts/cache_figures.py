"""The binary cache's H200 figures (`scripts/gpu_full.sh start cache`), from that run's own records: each
step's wall time (timings.tsv), the tasks doit ran in it (". name" lines of its log), the cache's lines, and
whether the package a clone got is byte-identical to the builder's. Writes cache.json beside the logs and
prints cache.md.

    python scripts/cache_figures.py RESULTS_DIR > cache.md
"""

import json
import sys
from pathlib import Path

STEPS = {  # step -> what it is, and the target of the issue it answers (seconds)
    "fresh-box": ("a fresh box with no cache at all: toolchain to render", 540),
    "cache-A-fresh-box": ("A: a fresh box, no cache to read: toolchain to render, pushing", 540),
    "cache-B-folder": ("B: a fresh clone, empty Inductor cache, substituting from the folder cache", 90),
    "cache-B-load": ("B: load_package and one 1 x 1 call of the substituted package", None),
    "cache-C-s3": ("C: the same over S3 (rclone serve s3 on 127.0.0.1)", 90),
    "cache-C-load": ("C: load_package and one 1 x 1 call of the substituted package", None),
    "cache-D-new-seed": ("D: a new weights seed: compile substituted, weights, export, package, verify, render here", None),
}


def main(results: Path) -> None:
    rows = []
    for line in (results / "timings.tsv").read_text().splitlines():
        name, seconds, rc = line.split("\t")
        log = (results / f"{name}.log").read_text(errors="replace") if (results / f"{name}.log").exists() else ""
        ran = [l[3:].strip() for l in log.splitlines() if l.startswith(".  ")]
        cache = [l.removeprefix("sam3-aoti cache: ") for l in log.splitlines() if l.startswith("sam3-aoti cache: ")]
        stage_lines = {s: sum(1 for l in log.splitlines() if l.startswith(f"[{s} ")) for s in ("probe", "compile", "export")}
        cmp = results / f"{name.rsplit('-', 1)[0]}-cmp.txt"
        what, target = STEPS.get(name, (name, None))
        rows.append({"step": name, "what": what, "seconds": float(seconds), "exit": int(rc), "target_s": target,
                     "doit_ran": ran, "cache": cache, "ran_aoti": stage_lines["compile"] > 0,
                     "ran_probe": stage_lines["probe"] > 0, "ran_export": stage_lines["export"] > 0,
                     "identical_to_A": cmp.exists() and cmp.read_text().strip().endswith("identical") or None})
    (results / "cache.json").write_text(json.dumps(rows, indent=2) + "\n")
    print("| step | what | seconds | target | exit | doit ran | AOTInductor | probe | export | sam3.pt2 = A's |")
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        target = f"≤ {r['target_s']}" if r["target_s"] else "-"
        same = {True: "yes", False: "no", None: "-"}[r["identical_to_A"]]
        print(f"| {r['step']} | {r['what']} | {r['seconds']:.1f} | {target} | {r['exit']} | {', '.join(r['doit_ran']) or '-'} "
              f"| {'ran' if r['ran_aoti'] else 'no'} | {'ran' if r['ran_probe'] else 'no'} | "
              f"{'ran' if r['ran_export'] else 'no'} | {same} |")
    print()
    for r in rows:
        for line in r["cache"]:
            print(f"- {r['step']}: {line}")


if __name__ == "__main__":
    main(Path(sys.argv[1]))
