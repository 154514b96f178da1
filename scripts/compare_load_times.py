"""A service's next start under two runtimes, on one package: is the loader of B slower than the loader of A?
Each is a git revision or a folder holding src/ (`.` is this checkout as it is). Each load runs in a fresh
process (warm page cache; each runtime with its own record of checked packages, filled by one untimed first
start), and the two alternate so that a drift of the machine hits both. Writes OUT.json and OUT.md.

    uv run python scripts/compare_load_times.py PACKAGE f078bd9 . --device cuda --repeats 9 --out benchmarks/x/load
"""

import argparse
import json
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

from sam3_aoti.measure.load_times import next_start_seconds  # noqa: E402


def checkout_src(rev: str, into: Path) -> Path:
    """The src/ folder of `rev`: a folder that holds src/ (`.` is this checkout), or a git revision unpacked into
    `into` (a device machine has no .git: carry `git archive REV src | tar -x -C FOLDER` there)."""
    if (Path(rev) / "src" / "sam3_aoti").is_dir():
        return Path(rev).resolve() / "src"
    into.mkdir(parents=True)
    archive = subprocess.run(["git", "-C", str(ROOT), "archive", rev, "src"], check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(into)], input=archive, check=True)
    return into / "src"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("package", type=Path)
    parser.add_argument("revs", nargs=2, metavar="REV_OR_FOLDER")
    parser.add_argument("--device", default="cpu", choices=["cpu", "cuda"])
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--out", type=Path, required=True, help="OUT.json and OUT.md are written")
    args = parser.parse_args()
    names = [r if (Path(r) / "src" / "sam3_aoti").is_dir() else subprocess.run(
        ["git", "-C", str(ROOT), "rev-parse", "--short", r], check=True, capture_output=True, text=True).stdout.strip()
        for r in args.revs]
    if len(set(names)) < 2:
        sys.exit("compare_load_times: name two different revisions or folders")
    with tempfile.TemporaryDirectory() as tmp:
        srcs = [checkout_src(r, Path(tmp) / n) for r, n in zip(args.revs, names)]
        caches = [Path(tmp) / f"cache-{n}" for n in names]
        for src, cache in zip(srcs, caches):  # the first start: hashes the package and remembers the check
            if next_start_seconds(src, args.package, args.device, cache) is None:
                sys.exit(f"compare_load_times: {src} cannot load {args.package} (see the log above)")
        times = {n: [] for n in names}
        for _ in range(args.repeats):
            for n, src, cache in zip(names, srcs, caches):
                times[n].append(round(next_start_seconds(src, args.package, args.device, cache), 4))
    rows = [{"rev": n, "median_s": round(statistics.median(t), 3), "min_s": round(min(t), 3),
             "max_s": round(max(t), 3), "seconds": t} for n, t in times.items()]
    report = {"package": str(args.package), "package_bytes": args.package.stat().st_size, "device": args.device,
              "repeats": args.repeats, "rows": rows,
              "b_minus_a_median_s": round(rows[1]["median_s"] - rows[0]["median_s"], 3)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.with_suffix(".json").write_text(json.dumps(report, indent=1) + "\n")
    table = ["| runtime of | next start, median s | min | max |", "| --- | ---: | ---: | ---: |"]
    table += [f"| {r['rev']} | {r['median_s']} | {r['min_s']} | {r['max_s']} |" for r in rows]
    args.out.with_suffix(".md").write_text(
        f"Next start of `{args.package.name}` ({report['package_bytes'] / 1e6:.1f} MB, {args.device}), fresh process "
        f"each, {args.repeats} alternating repeats:\n\n" + "\n".join(table) + "\n")
    print("\n".join(table))


if __name__ == "__main__":
    main()
