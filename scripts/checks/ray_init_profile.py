"""Where a local Ray's start (`ray.init` as segment calls it, with segment's `LOCAL_RAY_ENV`) spends its time: the
median over `--runs` fresh processes of ray.init's whole time and of its steps, from cProfile's cumulative times
(the dashboard process it waits for, its asks for the raylet, which waits for its dashboard agent before it registers,
the driver's own connection). Ray's own `ray.init`: segment's start (`batch.engine.start_ray`) asks for the raylet
more often.

Usage: uv run python scripts/checks/ray_init_profile.py [--runs 5] [--cpus 2] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path

STEPS = {  # cProfile's (file suffix, function) -> what the step waits for
    ("services.py", "start_api_server"): "the dashboard process (started even with the dashboard off)",
    ("services.py", "get_node"): "Ray's asks for its raylet, a second apart, until it has registered",
    ("worker.py", "connect"): "the driver's own connection",
    ("node.py", "start_gcs_server"): "the GCS",
}

ONE_RUN = """
import cProfile, json, os, pstats, sys, time
sys.path.insert(0, {src!r})
from sam3_aoti.batch.engine import LOCAL_RAY_ENV
for name, value in LOCAL_RAY_ENV.items():
    os.environ.setdefault(name, value)
import ray
profile = cProfile.Profile()
t0 = time.perf_counter()
profile.enable()
ray.init(include_dashboard=False, log_to_driver=False, configure_logging=False, num_cpus={cpus})
profile.disable()
total = time.perf_counter() - t0
ray.shutdown()
stats = pstats.Stats(profile).stats.items()
steps = {{f"{{file.rsplit('/', 1)[-1]}}:{{name}}": stat[3] for (file, line, name), stat in stats}}
print(json.dumps({{"ray_init_s": total, "steps": steps}}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5)
    parser.add_argument("--cpus", type=int, default=2)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    src = str(Path(__file__).resolve().parents[2] / "src")
    runs = [json.loads(subprocess.run([sys.executable, "-c", ONE_RUN.format(src=src, cpus=args.cpus)],
                                      capture_output=True, text=True, check=True, timeout=300).stdout.splitlines()[-1])
            for _ in range(args.runs)]
    result = {"runs": args.runs, "cpus": args.cpus,
              "ray_init_s": round(statistics.median(r["ray_init_s"] for r in runs), 2), "steps": {}}
    for (file, name), what in STEPS.items():
        key = f"{file}:{name}"
        result["steps"][key] = {"what": what, "s": round(statistics.median(r["steps"].get(key, 0.0) for r in runs), 2)}
    lines = [f"ray.init, median of {args.runs} runs on {args.cpus} CPUs: {result['ray_init_s']} s"]
    lines += [f"  {step['s']:5.2f} s  {key}: {step['what']}" for key, step in result["steps"].items()]
    print("\n".join(lines))
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "ray-init.json").write_text(json.dumps(result, indent=2) + "\n")
        (args.out / "ray-init.txt").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
