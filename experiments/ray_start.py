#!/usr/bin/env python3
"""Where `segment`'s start-up goes before its own code runs (issue #49's 8 s): a local Ray's start, an actor that
imports torch (as the model actor does) started at once or after the cluster's prestarted workers have come up, with
and without Ray's `preload_python_modules`, Ray Data's first run against its second on the same cluster (a trivial
model actor), and segment's pipeline from nothing with a model actor that imports torch and opens the GPU but loads
no package: the floor of segment's start-up under the package's own load and first call. The pipeline also runs with
each of two levers: torch imported by the workers Ray prestarts (`preload_python_modules`, so the model actor may
find it imported; segment does not), and Ray Data imported in a thread while `ray.init` waits for Ray's processes
(segment does, from 8 CPUs on), and with both. Each case in a fresh process, the cases in turn `--repeat` times; the
median of each.

Usage: uv run python experiments/ray_start.py --out DIR [--repeat 3] [--cpus 2 | --cpus 0 (all of them)] [--gpu]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

PIPELINES = {  # segment's pipeline with each lever (segment imports Ray Data beside ray.init from 8 CPUs on)
    "pipeline": {},
    "pipeline, torch preloaded in workers": {"preload": True},
    "pipeline, Ray Data imported beside ray.init": {"data_beside": True},
    "pipeline, both": {"preload": True, "data_beside": True},
}
CASES = {
    "actor importing torch, at once": {"sleep": 0, "preload": False},
    "actor importing torch, 3 s after ray.init": {"sleep": 3, "preload": False},
    "actor, torch preloaded in workers, at once": {"sleep": 0, "preload": True},
    "actor, torch preloaded in workers, 3 s after ray.init": {"sleep": 3, "preload": True},
}


def start_ray(cpus: int, data_beside: bool = False, **options):
    """A local Ray as segment starts it (`batch.engine.start_ray`), on `cpus` CPUs (0: all), Ray Data imported beside
    `ray.init` or not."""
    import ray

    from sam3_aoti.batch.engine import start_ray as segments_start

    segments_start(ray, None, data_beside=data_beside, num_cpus=cpus or None, **options)


def one_case(sleep: float, preload: bool, cpus: int) -> dict:
    """In this process: ray.init, then an actor whose constructor imports torch; seconds of each."""
    import ray

    t0 = time.perf_counter()
    start_ray(cpus, **({"_system_config": {"preload_python_modules": ["torch"]}} if preload else {}))
    t1 = time.perf_counter()
    time.sleep(sleep)

    @ray.remote(num_cpus=1)
    class Model:
        def __init__(self):
            t = time.perf_counter()
            import torch  # noqa: F401

            self.import_s = time.perf_counter() - t

        def ready(self):
            return self.import_s

    t2 = time.perf_counter()
    import_s = ray.get(Model.remote().ready.remote())
    t3 = time.perf_counter()
    ray.shutdown()
    return {"ray_init_s": t1 - t0, "actor_ready_s": t3 - t2, "actor_torch_import_s": import_s}


def data_runs(cpus: int) -> dict:
    """In this process: Ray Data's first and second run to the first batch on one cluster (a CPU map, then an
    actor pool), after the prestarted workers have come up."""
    import ray

    start_ray(cpus)
    time.sleep(3)
    ray.data.DataContext.get_current().enable_progress_bars = False

    class Model:
        def __call__(self, batch):
            return batch

    firsts = []
    for _ in range(2):
        t0 = time.perf_counter()
        dataset = ray.data.from_items([{"x": i} for i in range(64)], override_num_blocks=4).map_batches(
            lambda b: b, batch_size=16).map_batches(Model, batch_size=16, num_cpus=0.5,
                                                     compute=ray.data.ActorPoolStrategy(size=1))
        next(iter(dataset.iter_batches(batch_size=None)))
        firsts.append(time.perf_counter() - t0)
    ray.shutdown()
    return {"first_run_first_batch_s": firsts[0], "second_run_first_batch_s": firsts[1]}


def pipeline(cpus: int, gpu: bool, preload: bool = False, data_beside: bool = False) -> dict:
    """In this process, as `segment` runs (batch/engine.py): a local Ray's start, then its pipeline (a CPU map of 4
    rows a task, a pool of one model actor holding the GPU when `gpu`, a CPU map after it) to the first batch. The
    actor imports torch and opens a CUDA context (no package, no model): what segment's start-up is before the
    package's load and first call. `preload`: Ray's prestarted workers import torch; `data_beside`: Ray Data is
    imported in a thread while `ray.init` runs."""
    import ray

    t0 = time.perf_counter()
    start_ray(cpus, data_beside, **({"_system_config": {"preload_python_modules": ["torch"]}} if preload else {}))
    t1 = time.perf_counter()
    import ray.data

    ray.data.DataContext.get_current().enable_progress_bars = False

    class Model:
        def __init__(self):
            t = time.perf_counter()
            import torch

            self.import_s = time.perf_counter() - t
            t = time.perf_counter()
            if gpu:
                torch.zeros(1, device="cuda")
            self.context_s = time.perf_counter() - t

        def __call__(self, batch):
            return {**batch, "import_s": [self.import_s] * len(batch["x"]),
                    "context_s": [self.context_s] * len(batch["x"])}

    dataset = ray.data.from_items([{"x": i} for i in range(64)], override_num_blocks=16).map_batches(
        lambda b: b, batch_size=4, num_cpus=1).map_batches(
        Model, batch_size=16, num_cpus=1, num_gpus=1 if gpu else 0, compute=ray.data.ActorPoolStrategy(size=1)
    ).map_batches(lambda b: b, batch_size=None, num_cpus=1)
    first = next(iter(dataset.iter_batches(batch_size=None)))
    t2 = time.perf_counter()
    ray.shutdown()
    return {"ray_init_s": t1 - t0, "ray_up_to_first_batch_s": t2 - t1, "first_batch_s": t2 - t0,
            "actor_torch_import_s": float(first["import_s"][0]), "actor_cuda_context_s": float(first["context_s"][0])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--cpus", type=int, default=2)
    parser.add_argument("--gpu", action="store_true", help="the pipeline's model actor holds a GPU and opens it")
    parser.add_argument("--case", help=argparse.SUPPRESS)  # one case, in a process of its own
    args = parser.parse_args()
    if args.case:
        if args.case == "data":
            result = data_runs(args.cpus)
        elif args.case in PIPELINES:
            result = pipeline(args.cpus, args.gpu, **PIPELINES[args.case])
        else:
            result = one_case(**CASES[args.case], cpus=args.cpus)
        print(json.dumps(result))
        return
    # as segment starts Ray (batch/engine.py)
    from sam3_aoti.batch.engine import LOCAL_RAY_ENV

    env = {**LOCAL_RAY_ENV, **os.environ}
    cases = [*PIPELINES, *CASES, "data"]
    runs = {case: [] for case in cases}
    for _ in range(args.repeat):  # each case once in turn: the machine's drift falls on every case alike
        for case in cases:
            command = [sys.executable, __file__, "--case", case, "--cpus", str(args.cpus),
                       *(["--gpu"] if args.gpu else [])]
            runs[case].append(json.loads(subprocess.run(command, env=env, capture_output=True, text=True, check=True,
                                                         timeout=300).stdout.splitlines()[-1]))
            print(case, runs[case][-1], flush=True)
    results = {case: {key: round(statistics.median(run[key] for run in runs[case]), 2) for key in runs[case][0]}
               for case in cases}
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "ray-start.json").write_text(json.dumps({"cpus": args.cpus or os.cpu_count(), "gpu": args.gpu,
                                                             "repeat": args.repeat, "cases": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
