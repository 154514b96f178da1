"""`doit throughput`'s collection looks like a user's: mixed sizes, PNGs beside JPEGs, a few broken files."""

import os

from PIL import Image

from sam3_aoti.errors import Sam3AotiError
from sam3_aoti.runtime.images import read_image
from sam3_aoti.measure.collection import LARGE_EVERY, write_collection


def test_the_collection_mixes_sizes_and_formats_and_holds_broken_files(tmp_path):
    folder = tmp_path / "collection"
    made = write_collection(folder, 12, 40, 300, 3)
    photos = sorted(p for p in folder.iterdir() if p.suffix in (".jpg", ".png") and not p.name.startswith("broken"))
    broken = sorted(folder.glob("broken-*"))
    assert len(photos) == 12 and len(broken) == 3
    assert {p.suffix for p in photos} == {".jpg", ".png"}
    assert made["png"] == sum(p.suffix == ".png" for p in photos) and made["jpeg"] + made["png"] == 12
    widths = [Image.open(p).width for p in photos]
    assert sum(w == 300 for w in widths) == made["large"] == len(range(0, 12, LARGE_EVERY))
    assert all(min(Image.open(p).size) >= 40 for p, w in zip(photos, widths) if w != 300)
    for path in photos:
        assert read_image(path).shape[2] == 3
    for path in broken:  # each is an error row of its own in segment, never the end of the run
        try:
            read_image(path)
        except Sam3AotiError:
            continue
        raise AssertionError(f"{path.name} read as an image")
    stamp = (folder / "collection.json").stat().st_mtime_ns
    assert write_collection(folder, 12, 40, 300, 3) == made  # written once
    assert (folder / "collection.json").stat().st_mtime_ns == stamp


def test_copies_are_more_names_for_the_same_photographs(tmp_path):
    """`copies`: each photograph under that many names (hard links), so segment times more images than were
    written; the counts are of the images segment sees."""
    folder = tmp_path / "collection"
    made = write_collection(folder, 5, 40, 300, 1, copies=3)
    photos = sorted(p for p in folder.iterdir() if p.suffix in (".jpg", ".png") and not p.name.startswith("broken"))
    assert len(photos) == 15 and made["images"] == 15 and made["unique"] == 5 and made["jpeg"] + made["png"] == 15
    first, twin = folder / "00000.jpg", folder / "00000-1.jpg"
    assert twin.read_bytes() == first.read_bytes() and twin.stat().st_ino == first.stat().st_ino  # no second write
    assert made["large"] == 3 * len(range(0, 5, LARGE_EVERY))


def test_writer_processes_write_the_collection_one_process_writes(tmp_path, monkeypatch):
    """Each photograph's size, crop and mirror are drawn in order before any is written, so the files are the same
    bytes whichever process writes which (here 3 processes against 1)."""
    from sam3_aoti.measure import collection

    monkeypatch.setattr(collection, "PER_WORKER", 4)
    monkeypatch.setattr(collection.os, "cpu_count", lambda: 3)
    several = write_collection(tmp_path / "several", 12, 40, 300, 0)
    monkeypatch.setattr(collection, "PER_WORKER", 10**6)
    one = write_collection(tmp_path / "one", 12, 40, 300, 0)
    names = sorted(p.name for p in (tmp_path / "one").iterdir())
    assert several == one and names == sorted(p.name for p in (tmp_path / "several").iterdir())
    assert all((tmp_path / "one" / n).read_bytes() == (tmp_path / "several" / n).read_bytes() for n in names)


def fake_nvidia_smi(folder):
    """A `nvidia-smi` of two GPUs on PATH: the index query lists them; the sampling query prints two samples of each
    (GPU 1 busier and holding the package) and a line that is no sample, then waits as the real one does."""
    tool = folder / "nvidia-smi"
    tool.write_text("#!/usr/bin/env bash\n"
                    "if [[ \" $* \" == *' --query-gpu=index '* ]]; then printf '0\\n1\\n'; exit 0; fi\n"
                    "printf '0, 10, 100\\n1, 80, 5000\\n[N/A]\\n0, 30, 120\\n1, 90, 5200\\n'\n"
                    "exec sleep 60\n")
    tool.chmod(0o755)
    return folder


def test_every_gpu_is_sampled_and_the_actors_gpus_are_those_holding_the_most_memory(tmp_path, monkeypatch):
    import time

    from sam3_aoti.stages.throughput import GpuBusy, visible_gpus

    monkeypatch.setenv("PATH", f"{fake_nvidia_smi(tmp_path)}:{os.environ['PATH']}")
    assert visible_gpus() == 2
    with GpuBusy() as busy:
        deadline = time.monotonic() + 10
        while sum(map(len, busy.samples.values())) < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
    assert busy.per_gpu() == {0: {"busy_share": 0.2, "peak_mib": 120.0}, 1: {"busy_share": 0.85, "peak_mib": 5200.0}}
    assert busy.per_gpu(skip=1)[1]["busy_share"] == 0.9  # the first sample of each left out
    assert busy.share(gpus=1) == 0.85 and busy.share(gpus=2) == 0.525
    assert busy.proc.poll() is not None  # stopped on the way out


def test_no_nvidia_smi_is_no_gpu_and_no_samples(tmp_path, monkeypatch):
    from sam3_aoti.stages.throughput import GpuBusy, visible_gpus

    monkeypatch.setenv("PATH", str(tmp_path))
    assert visible_gpus() == 0
    with GpuBusy() as busy:
        pass
    assert busy.per_gpu() == {} and busy.share() is None


def test_actor_counts_are_one_and_all_gpus_or_as_asked_within_the_machine():
    import pytest

    from sam3_aoti.errors import ConfigError
    from sam3_aoti.stages.throughput import actor_counts

    assert actor_counts(None, 1, "cuda") == [None]  # segment's default: one per GPU
    assert actor_counts(None, 4, "cuda") == [1, 4]
    assert actor_counts(None, 0, "cpu") == [None]
    assert actor_counts([1, 2], 2, "cuda") == [1, 2] and actor_counts([1, 3], 0, "cpu") == [1, 3]
    assert actor_counts([1, 2], 0, "cuda") == [1, 2]  # no nvidia-smi to count them: as asked
    with pytest.raises(ConfigError, match=r"actors = \[1, 2\]: this machine has 1 GPU\(s\)"):
        actor_counts([1, 2], 1, "cuda")


def test_the_stage_runs_each_actor_count_and_sets_each_against_one_actor(tmp_path, monkeypatch):
    """`[throughput] actors = [1, 2]`: segment runs once per count over the same collection, and each count's rate
    is reported against that many times the one actor's (segment itself stands in here: its runs are the segment
    tests'; a machine of several GPUs is what the figure needs)."""
    import json
    from pathlib import Path

    from sam3_aoti import batch
    from sam3_aoti.pipeline.settings import load_settings
    from sam3_aoti.stages import throughput

    config = tmp_path / "pipeline.toml"
    text = (Path(__file__).parents[1] / "pipeline.toml").read_text()
    for old, new in [("images = 256", "images = 3"), ("copies = 16", "copies = 2"),
                     ("min_side = 1008", "min_side = 40"), ("large_width = 4000", "large_width = 90"),
                     ("broken = 4", "broken = 1\nactors = [1, 2]")]:
        assert old in text
        text = text.replace(old, new, 1)
    config.write_text(text)
    settings = load_settings(profile="tiny", device="cpu", config=config, artifacts=tmp_path / "artifacts")
    seen = []

    def segment(collection, output, prompts, package, *, batch_size, actors, actor_cpus):
        seen.append((sorted(p.name for p in Path(collection).iterdir() if p.suffix != ".json"), actors))
        return {"actors": actors, "actor_cpus": 1, "segmented": 6, "failed": 1, "seconds": 3.0, "first_result_s": 1.0,
                "startup": {"listing_and_checks_s": 0.1, "ray_start_s": 0.4, "ray_data_s": 0.2,
                            "actors_and_first_batch_s": 0.3},
                "images_per_second": 2.0, "steady_images_per_second": {1: 3.0, 2: 5.7}[actors],
                "actor_calls_in_flight": 0.9}

    monkeypatch.setattr(batch, "segment", segment)
    throughput.run(settings)
    assert [actors for _, actors in seen] == [1, 2] and seen[0][0] == seen[1][0] and len(seen[0][0]) == 7
    data = json.loads((tmp_path / "artifacts" / "tiny-fp32-cpu" / "throughput" / "throughput.json").read_text())
    data = data.get("data", data)
    assert [(r["actors"], r["scaling"]) for r in data["runs"]] == [(1, 1.0), (2, 0.95)]
    assert data["actors"] == 1 and data["steady_images_per_second"] == 3.0  # the headline: one actor's
    report = (tmp_path / "artifacts" / "tiny-fp32-cpu" / "throughput" / "throughput.md").read_text()
    assert "| 2 | 6 | 3.0 (1.0) | 2.00 | 5.70 |" in report and "95%" in report
    assert ("Start-up with 2 model actor(s), s: listing and checks 0.1, ray start 0.4, ray data 0.2, actors and first "
            "batch 0.3.") in report
