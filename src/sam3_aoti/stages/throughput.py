"""Stage `throughput` (on request): `sam3-aoti segment` over a collection like a user's on this machine, end to end
(Ray Data, decoding in CPU tasks, the model actors, masks upsampled and run-length encoded, Parquet written), in
images per second against the bench's images per second at 16 images x 1 prompt for the same package, with the
GPU's busy share sampled through the run (nvidia-smi). The collection is the verify photographs, resized so each
has a short side of at least `[throughput] min_side` (every 8th `large_width` px wide), cropped and flipped so no
two are alike, written once as JPEG and PNG, with a few broken files beside them. On a machine of N GPUs it runs
twice, with one model actor and with N (`[throughput] actors` picks the counts), and gives each count's rate
against N times the one actor's and every GPU's busy share and memory. A benchmark, not a gate: writes
throughput.json and throughput.md.
"""

from __future__ import annotations

import json
import logging
import shutil
import subprocess
import tempfile
import threading
import time
from pathlib import Path

from ..errors import ConfigError
from ..measure.collection import write_collection
from ..pipeline.artifacts import record
from ..pipeline.paths import ProfilePaths
from ..pipeline.report import Report, Table, dash, write_report
from ..pipeline.schema import BENCH_COLUMNS
from ..pipeline.settings import Settings

log = logging.getLogger(__spec__.name)  # not __name__: run by `python -m`, a stage is "__main__"

class GpuBusy:
    """Every GPU's utilization (the share of time a kernel ran) and memory in use, sampled by nvidia-smi every 200 ms
    while open."""

    def __init__(self):
        self.samples: dict[int, list[tuple[float, float]]] = {}  # GPU index -> (busy %, MiB in use) each sample
        self.proc = None

    def __enter__(self):
        if shutil.which("nvidia-smi"):
            self.proc = subprocess.Popen(["nvidia-smi", "--query-gpu=index,utilization.gpu,memory.used",
                                          "--format=csv,noheader,nounits", "-lms", "200"], stdout=subprocess.PIPE,
                                         text=True)
            threading.Thread(target=self._read, daemon=True).start()
        return self

    def _read(self):
        for line in self.proc.stdout:
            fields = [f.strip() for f in line.split(",")]
            if len(fields) == 3 and all(f.replace(".", "", 1).isdigit() for f in fields):
                self.samples.setdefault(int(fields[0]), []).append((float(fields[1]), float(fields[2])))

    def __exit__(self, *exc):
        if self.proc:
            self.proc.terminate()
            self.proc.wait()

    def per_gpu(self, skip: int = 0) -> dict[int, dict]:
        """Each GPU's mean busy share, leaving out its first `skip` samples (Ray starting, the package loading), and
        the most memory in use on it (MiB)."""
        gpus = {}
        for index, samples in sorted(self.samples.items()):
            busy = [b for b, _ in samples[skip:]]
            gpus[index] = {"busy_share": round(sum(busy) / len(busy) / 100, 3) if busy else None,
                           "peak_mib": max(m for _, m in samples)}
        return gpus

    def share(self, gpus: int = 1, skip: int = 0) -> float | None:
        """The mean busy share of the `gpus` GPUs that held the most memory: those the model actors ran on (Ray
        picks them), each holding one package."""
        used = sorted(self.per_gpu(skip).values(), key=lambda g: g["peak_mib"], reverse=True)[:gpus]
        shares = [g["busy_share"] for g in used if g["busy_share"] is not None]
        return round(sum(shares) / len(shares), 3) if shares else None


def visible_gpus() -> int:
    """How many GPUs nvidia-smi lists on this machine (0 without it)."""
    if not shutil.which("nvidia-smi"):
        return 0
    out = subprocess.run(["nvidia-smi", "--query-gpu=index", "--format=csv,noheader"], capture_output=True, text=True)
    return sum(line.strip().isdigit() for line in out.stdout.splitlines()) if out.returncode == 0 else 0


def actor_counts(asked: list[int] | None, gpus: int, device: str) -> list[int | None]:
    """The model actor counts to run: `[throughput] actors` if given; on a machine of N > 1 GPUs, one actor and then
    N, so the N-GPU rate is measured against the one-GPU rate of the same run; else segment's own default. A GPU
    actor holds a GPU of its own: a count over the GPUs nvidia-smi lists is a one-line error, not a run that waits
    (without nvidia-smi the counts stand as asked)."""
    if asked:
        if device == "cuda" and gpus and max(asked) > gpus:
            raise ConfigError(f"[throughput] actors = {asked}: this machine has {gpus} GPU(s), and each model actor "
                              "holds one; give counts up to that")
        return list(asked)
    return [1, gpus] if gpus > 1 else [None]


def gpu_cell(gpu: dict) -> str:
    """One GPU's busy share and most memory in use, for the per-GPU table."""
    return f"{dash(gpu['busy_share'] and format(gpu['busy_share'], '.0%'))} ({gpu['peak_mib']:.0f})"


def bench_rate(paths: ProfilePaths) -> tuple[float | None, str | None]:
    """The bench's images/s at 16 x 1 for this package (its fastest AOTI column), if bench has run."""
    if not paths.bench_json.is_file():
        return None, None
    rows = json.loads(paths.bench_json.read_text()).get("rows", [])
    for row in rows:
        if (row.get("batch"), row.get("prompts")) == (16, 1):
            for column in ("aoti_graphs", "aoti"):
                found = row.get("backends", {}).get(BENCH_COLUMNS[column])
                if found:
                    return found["images_per_s"], BENCH_COLUMNS[column]
    return None, None


def segment_run(folder: Path, paths: ProfilePaths, opts: dict, actors: int | None) -> dict:
    """`segment` over the collection with `actors` model actors (None: segment's default), the GPUs sampled."""
    from ..batch import segment

    output = Path(tempfile.mkdtemp(prefix="segment-", dir=paths.root / "throughput"))
    try:
        with GpuBusy() as busy:
            # parts of segment's default size, committed as the run goes, as a user's run commits them (one part
            # of every image was written after the last batch, inside the running span)
            summary = segment(str(folder), output, [opts["prompt"]], str(paths.package), batch_size=opts["batch_size"],
                              actors=actors, actor_cpus=opts.get("actor_cpus"))
    finally:
        shutil.rmtree(output, ignore_errors=True)
    startup_samples = int(summary["first_result_s"] / 0.2)
    return {"actors": summary["actors"], "actor_cpus": summary["actor_cpus"], "images": summary["segmented"],
            "failed": summary["failed"], "seconds": summary["seconds"], "startup_seconds": summary["first_result_s"],
            "startup": summary["startup"], "images_per_second": summary["images_per_second"],
            "steady_images_per_second": summary["steady_images_per_second"],
            "gpu_busy_share": busy.share(summary["actors"] or 1, startup_samples),
            "gpu_busy_samples": sum(map(len, busy.samples.values())),
            "gpus": {str(k): v for k, v in busy.per_gpu(startup_samples).items()},
            "actor_calls_in_flight": summary["actor_calls_in_flight"]}


def run(settings: Settings) -> None:
    paths, opts = ProfilePaths.of(settings), settings.stage("throughput")
    folder = paths.root / "throughput" / "collection"
    copies = opts.get("copies", 1)
    collection = write_collection(folder, opts["images"], opts["min_side"], opts["large_width"], opts["broken"],
                                  copies)
    images = opts["images"] * copies
    log.info("%d photographs (%d files under %d names each; %d JPEG, %d PNG; short side %d px and up, %d of them %d "
             "px wide) and %d broken files in %s", images, opts["images"], copies, collection["jpeg"],
             collection["png"], opts["min_side"], collection["large"], opts["large_width"], opts["broken"], folder)
    runs = []
    gpus = visible_gpus() if settings.device == "cuda" else 0
    for actors in actor_counts(opts.get("actors"), gpus, settings.device):
        r = segment_run(folder, paths, opts, actors)
        runs.append(r)
        log.info("%s model actor(s): %d images in %.1f s (%.1f s until the first results): %.2f images/s overall, "
                 "%.2f once running; GPU busy %s", r["actors"], r["images"], r["seconds"], r["startup_seconds"],
                 r["images_per_second"], r["steady_images_per_second"], dash(r["gpu_busy_share"]))
    one = next((r for r in runs if r["actors"] == 1), None)
    for r in runs:  # each count's rate against that many times one actor's, measured in this run
        r["scaling"] = round(r["steady_images_per_second"] / (r["actors"] * one["steady_images_per_second"]), 3) \
            if one and one["steady_images_per_second"] and r["steady_images_per_second"] else None
    reference, column = bench_rate(paths)
    first = runs[0]
    data = {
        **{k: v for k, v in first.items() if k not in ("gpus", "scaling")},  # the headline: the first count's run
        "min_side": opts["min_side"], "collection": {k: collection[k] for k in ("jpeg", "png", "large", "broken")},
        "large_width": opts["large_width"], "files_written": opts["images"], "copies": copies,
        "prompt": opts["prompt"], "batch_size": opts["batch_size"],
        "bench_16x1_images_per_second": reference, "bench_column": column,
        "share_of_bench": round(first["steady_images_per_second"] / reference, 3) if reference else None,
        "runs": runs,
        "date": time.strftime("%Y-%m-%d"),
    }
    log.info("bench 16 x 1: %s images/s", dash(reference))
    table = Table("segment over a folder", ["model actors", "images", "seconds (start-up)", "images/s overall",
                                            "images/s running", "bench 16 x 1 images/s",
                                            "share of the bench times the actors",
                                            "against that many times one actor", "GPU busy (the actors' GPUs)",
                                            "calls in flight per actor"],
                  [[r["actors"], r["images"], f"{r['seconds']:.1f} ({r['startup_seconds']:.1f})",
                    f"{r['images_per_second']:.2f}", f"{r['steady_images_per_second']:.2f}", dash(reference),
                    dash(reference and f"{r['steady_images_per_second'] / (reference * (r['actors'] or 1)):.0%}"),
                    dash(r["scaling"] and f"{r['scaling']:.0%}"),
                    dash(r["gpu_busy_share"] and f"{r['gpu_busy_share']:.0%}"), dash(r["actor_calls_in_flight"])]
                   for r in runs])
    tables = [table]
    if any(r["gpus"] for r in runs):
        tables.append(Table("each GPU: busy share while running, most memory in use (MiB)",
                            ["model actors", *(f"GPU {i}" for i in runs[0]["gpus"])],
                            [[r["actors"], *map(gpu_cell, r["gpus"].values())] for r in runs]))
    notes = [f"{data['date']}: `sam3-aoti segment` over {images} photographs ({opts['images']} files, each under "
             f"{copies} name(s); {collection['jpeg']} JPEG, "
             f"{collection['png']} PNG; short side {opts['min_side']} px and up, {collection['large']} of them "
             f"{opts['large_width']} px wide) and {opts['broken']} broken files ({data['failed']} listed as errors), "
             f"prompt {opts['prompt']!r}, batches of {opts['batch_size']}, "
             f"model actor(s) of {data['actor_cpus']} CPU(s); reading, decoding, upsampling, "
             "run-length encoding and Parquet included. 'Running' leaves out Ray's start and the package's load "
             "(until the first results); the GPU's busy share is nvidia-smi's utilization over the same span, of the "
             "GPUs that held the most memory, as many as there were actors (those Ray gave them); calls in "
             "flight: an actor's calls under way, on average over that span (a GPU actor overlaps two; fewer: it "
             "waited for batches). With several actor counts, each count's rate is set against that many times the "
             "one actor's of the same run. "
             f"Bench column: {dash(column)}.",
             *(f"Start-up with {r['actors']} model actor(s), s: " + (", ".join(
                 f"{k.removesuffix('_s').replace('_', ' ')} {v}" for k, v in r["startup"].items())
                 if r["startup"] else "-") + "." for r in runs)]
    report = Report(f"Throughput of segment ({settings.profile}, {settings.precision}, {settings.device})", notes,
                    None, tables, data=data)
    write_report(report, paths.throughput_json, paths.throughput_md)
    record(paths.manifest, "throughput", [paths.throughput_json, paths.throughput_md],
           settings.fingerprint("throughput"))


if __name__ == "__main__":
    from ..pipeline.runner import main

    main("throughput", run, __doc__.splitlines()[0])
