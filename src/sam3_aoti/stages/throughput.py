"""Stage `throughput` (on request): `sam3-aoti segment` over a collection like a user's on this machine, end to end
(Ray Data, decoding in CPU tasks, the model actors, masks upsampled and run-length encoded, Parquet written), in
images per second against the bench's images per second at 16 images x 1 prompt for the same package, with the
GPU's busy share sampled through the run (nvidia-smi). The collection is the verify photographs, resized so each
has a short side of at least `[throughput] min_side` (every 8th `large_width` px wide), cropped and flipped so no
two are alike, written once as JPEG and PNG, with a few broken files beside them. A benchmark, not a gate:
writes throughput.json and throughput.md.
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

from ..measure.collection import write_collection
from ..pipeline.artifacts import record
from ..pipeline.paths import ProfilePaths
from ..pipeline.report import Report, Table, dash, write_report
from ..pipeline.schema import BENCH_COLUMNS
from ..pipeline.settings import Settings

log = logging.getLogger(__spec__.name)  # not __name__: run by `python -m`, a stage is "__main__"

class GpuBusy:
    """The GPU's utilization (the share of time a kernel ran) sampled by nvidia-smi every 200 ms while open."""

    def __init__(self):
        self.samples: list[float] = []
        self.proc = None

    def __enter__(self):
        if shutil.which("nvidia-smi"):
            self.proc = subprocess.Popen(["nvidia-smi", "--query-gpu=utilization.gpu", "--format=csv,noheader,nounits",
                                          "-i", "0", "-lms", "200"], stdout=subprocess.PIPE, text=True)
            threading.Thread(target=self._read, daemon=True).start()
        return self

    def _read(self):
        for line in self.proc.stdout:
            if line.strip().isdigit():
                self.samples.append(float(line))

    def __exit__(self, *exc):
        if self.proc:
            self.proc.terminate()
            self.proc.wait()

    def share(self, skip: int = 0) -> float | None:
        """The mean busy share, leaving out the first `skip` samples (Ray starting, the package loading)."""
        kept = self.samples[skip:]
        return round(sum(kept) / len(kept) / 100, 3) if kept else None


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


def run(settings: Settings) -> None:
    from ..batch import segment

    paths, opts = ProfilePaths.of(settings), settings.stage("throughput")
    folder = paths.root / "throughput" / "collection"
    copies = opts.get("copies", 1)
    collection = write_collection(folder, opts["images"], opts["min_side"], opts["large_width"], opts["broken"],
                                  copies)
    images = opts["images"] * copies
    log.info("%d photographs (%d files under %d names each; %d JPEG, %d PNG; short side %d px and up, %d of them %d "
             "px wide) and %d broken files in %s", images, opts["images"], copies, collection["jpeg"],
             collection["png"], opts["min_side"], collection["large"], opts["large_width"], opts["broken"], folder)
    output = Path(tempfile.mkdtemp(prefix="segment-", dir=paths.root / "throughput"))
    try:
        with GpuBusy() as busy:
            # parts of segment's default size, committed as the run goes, as a user's run commits them (one part
            # of every image was written after the last batch, inside the running span)
            summary = segment(str(folder), output, [opts["prompt"]], str(paths.package),
                              batch_size=opts["batch_size"], actor_cpus=opts.get("actor_cpus"))
    finally:
        shutil.rmtree(output, ignore_errors=True)
    reference, column = bench_rate(paths)
    startup_samples = int(summary["first_result_s"] / 0.2)
    data = {
        "images": summary["segmented"], "failed": summary["failed"], "min_side": opts["min_side"],
        "collection": {k: collection[k] for k in ("jpeg", "png", "large", "broken")},
        "large_width": opts["large_width"],
        "files_written": opts["images"], "copies": copies,
        "prompt": opts["prompt"], "batch_size": opts["batch_size"], "actors": summary["actors"],
        "actor_cpus": summary["actor_cpus"],
        "seconds": summary["seconds"], "startup_seconds": summary["first_result_s"], "startup": summary["startup"],
        "images_per_second": summary["images_per_second"],
        "steady_images_per_second": summary["steady_images_per_second"],
        "bench_16x1_images_per_second": reference, "bench_column": column,
        "share_of_bench": round(summary["steady_images_per_second"] / reference, 3) if reference else None,
        "gpu_busy_share": busy.share(startup_samples), "gpu_busy_samples": len(busy.samples),
        "actor_calls_in_flight": summary["actor_calls_in_flight"],
        "date": time.strftime("%Y-%m-%d"),
    }
    log.info("%d images in %.1f s (%.1f s until the first results): %.2f images/s overall, %.2f once running; "
             "bench 16 x 1: %s images/s; GPU busy %s", data["images"], data["seconds"], data["startup_seconds"],
             data["images_per_second"], data["steady_images_per_second"], dash(reference),
             dash(data["gpu_busy_share"]))
    table = Table("segment over a folder", ["images", "seconds (start-up)", "images/s overall", "images/s running",
                                            "bench 16 x 1 images/s", "share of bench", "GPU busy",
                                            "calls in flight per actor"],
                  [[data["images"], f"{data['seconds']:.1f} ({data['startup_seconds']:.1f})",
                    f"{data['images_per_second']:.2f}", f"{data['steady_images_per_second']:.2f}",
                    dash(reference), dash(data["share_of_bench"] and f"{data['share_of_bench']:.0%}"),
                    dash(data["gpu_busy_share"] and f"{data['gpu_busy_share']:.0%}"),
                    dash(data["actor_calls_in_flight"])]])
    notes = [f"{data['date']}: `sam3-aoti segment` over {images} photographs ({opts['images']} files, each under "
             f"{copies} name(s); {collection['jpeg']} JPEG, "
             f"{collection['png']} PNG; short side {opts['min_side']} px and up, {collection['large']} of them "
             f"{opts['large_width']} px wide) and {opts['broken']} broken files ({data['failed']} listed as errors), "
             f"prompt {opts['prompt']!r}, batches of {opts['batch_size']}, "
             f"{data['actors']} model actor(s) of {data['actor_cpus']} CPU(s); reading, decoding, upsampling, "
             "run-length encoding and Parquet included. 'Running' leaves out Ray's start and the package's load "
             "(until the first results); the GPU's busy share is nvidia-smi's utilization over the same span; calls in "
             "flight: an actor's calls under way, on average over that span (a GPU actor overlaps two; fewer: it "
             "waited for batches). "
             f"Bench column: {dash(column)}.",
             "Start-up, s: " + (", ".join(f"{k.removesuffix('_s').replace('_', ' ')} {v}"
                                          for k, v in data["startup"].items()) if data["startup"] else "-") + "."]
    report = Report(f"Throughput of segment ({settings.profile}, {settings.precision}, {settings.device})", notes,
                    None, [table], data=data)
    write_report(report, paths.throughput_json, paths.throughput_md)
    record(paths.manifest, "throughput", [paths.throughput_json, paths.throughput_md],
           settings.fingerprint("throughput"))


if __name__ == "__main__":
    from ..pipeline.runner import main

    main("throughput", run, __doc__.splitlines()[0])
