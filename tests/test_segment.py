"""`sam3-aoti segment` on the tiny package on the CPU, with a real local Ray: a folder (and an S3 prefix on the
real S3 server) of the verify photographs gives the instances `predict` gives on each image, bad files are
listed with their reason, an interrupted run resumes with every image written once, and a model actor killed
mid-run is retried by Ray with no row lost or doubled."""

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import pytest

from helpers import overlapping_calls_give_each_batchs_rows

PHOTOS = ("astronaut", "chelsea", "coffee", "rocket", "camera", "coins")
PROMPTS = ("a person", "a cat")
THRESHOLD = "0.2"
SRC = str(Path(__file__).parent.parent / "src")
# Each run starts a local Ray of its own, in the driver's session: two tests' runs side by side (one per xdist
# worker) never touch each other's processes (`session_members`).


def write_photos(folder: Path, copies: int = 1) -> list[Path]:
    """The verify photographs as JPEG and PNG files (`copies` of each, other names, same pixels)."""
    import skimage.data
    from PIL import Image

    from sam3_aoti.runtime.images import array_to_rgb8

    folder.mkdir(parents=True, exist_ok=True)
    written = []
    for i, name in enumerate(PHOTOS):
        image = Image.fromarray(array_to_rgb8(getattr(skimage.data, name)()))
        for copy in range(copies):
            path = folder / f"{name}-{copy}.{'jpg' if i % 2 else 'png'}"
            image.save(path, quality=95) if path.suffix == ".jpg" else image.save(path)
            written.append(path)
    return written


def write_bad_files(folder: Path) -> dict[str, str]:
    """Files of the collection that cannot be segmented -> words their error names."""
    from PIL import Image

    (folder / "notes.jpg").write_text("not an image")
    good = folder / "rocket-0.jpg"
    (folder / "cut.jpg").write_bytes(good.read_bytes()[: len(good.read_bytes()) // 3])
    Image.new("RGB", (1, 1)).save(folder / "dot.png")
    return {"notes.jpg": "cannot read", "cut.jpg": "truncated", "dot.png": "at least 2 x 2 pixels"}


def uv() -> str | None:
    """The uv binary that runs this test run, if any (uv tells its children: $UV), else one on the PATH."""
    return os.environ.get("UV") or shutil.which("uv")


def segment(*args: str, env: dict | None = None, check: bool = True, ray_tmp: Path | None = None,
            via_uv: bool = False) -> subprocess.CompletedProcess:
    """`sam3-aoti segment ARGS`; `via_uv`: as the README runs it, under `uv run` (where uv is here); `ray_tmp`:
    the folder its Ray keeps its sessions in (short: Ray's sockets live there)."""
    command = [sys.executable, "-m", "sam3_aoti", "segment", *args]
    if via_uv and uv():
        command = [uv(), "run", *command]
    extra = {"RAY_TMPDIR": str(ray_tmp)} if ray_tmp else {}
    proc = subprocess.run(command, capture_output=True, text=True, cwd=Path(SRC).parent,
                          env={**os.environ, "PYTHONPATH": SRC, **extra, **(env or {})}, timeout=900)
    if check:
        assert proc.returncode == 0, proc.stderr[-4000:]
    return proc


def summary_of(stdout: str) -> dict:
    """The run's summary: stdout holds it alone (Ray's messages go to stderr), so `| jq` works."""
    return json.loads(stdout)


def prompt_args() -> list[str]:
    return [a for p in PROMPTS for a in ("--prompt", p)] + ["--threshold", THRESHOLD]


def rows(output: Path) -> list[dict]:
    from sam3_aoti.batch.dataset import read_instances

    return read_instances(output).to_pylist()


def committed_sources(output: Path) -> list[str]:
    import pyarrow.parquet as pq

    return pq.read_table(output / "images", columns=["source"]).column(0).to_pylist()


def by_image(found: list[dict], key=lambda source: Path(source).name) -> dict:
    """source name -> {(prompt, query): row}"""
    out: dict = {}
    for row in found:
        out.setdefault(key(row["source"]), {})[(row["prompt"], row["query"])] = row
    return out


def same_instances(a: dict, b: dict) -> None:
    """Two runs' instances of one image: the same (prompt, query) pairs, scores, boxes and masks."""
    from pycocotools import mask as coco_mask

    assert a.keys() == b.keys()
    for key in a:
        x, y = a[key], b[key]
        assert abs(x["score"] - y["score"]) < 1e-4 and np.allclose(x["box_xyxy"], y["box_xyxy"], atol=0.1), key
        masks = [coco_mask.decode({"size": [r["height"], r["width"]], "counts": r["mask_counts"]}) for r in (x, y)]
        assert (masks[0] != masks[1]).mean() < 1e-3, key


@pytest.fixture(scope="module")
def reference(package_path, tmp_path_factory) -> dict:
    """`predict` on each photograph: image name -> {(prompt, query): its instance as predict writes it}."""
    from sam3_aoti.cli import predict

    folder = tmp_path_factory.mktemp("photos")
    found = {}
    for path in write_photos(folder):
        result = predict(package_path, path, list(PROMPTS), float(THRESHOLD), folder / "out" / path.stem)
        found[path.name] = {(i["prompt"], i["query"]): i for i in result["instances"]}
    assert sum(map(len, found.values())) > 10  # the threshold keeps enough to compare
    return found


def test_a_folder_gives_what_predict_gives_row_for_row_and_lists_bad_files(package_path, reference, tmp_path):
    from pycocotools import mask as coco_mask

    photos = tmp_path / "photos"
    write_photos(photos)
    bad = write_bad_files(photos)
    (photos / "gone.jpg").symlink_to(photos / "nothing.jpg")
    (photos / "sub").mkdir()
    (photos / "sub" / b"caf\xe9.png".decode("utf-8", "surrogateescape")).write_bytes((photos / "dot.png").read_bytes())
    bad.update({"gone.jpg": "a link to nothing", "caf\\xe9.png": "its name is not valid UTF-8"})
    out, ray_tmp = tmp_path / "out", Path(tempfile.mkdtemp(prefix="ray-"))
    proc = segment(str(photos), "--package", str(package_path), *prompt_args(), "--output", str(out),
                   "--batch-size", "4", via_uv=True, ray_tmp=ray_tmp)
    # Under `uv run`, Ray's own hook would zip the checkout and have each worker sync a venv of its own from it
    sessions = list(ray_tmp.glob("ray/session_2*"))
    uploaded = [p for s in sessions for p in s.glob("runtime_resources/working_dir_files/*")]
    shutil.rmtree(ray_tmp, ignore_errors=True)
    assert sessions and uploaded == [], uploaded
    summary = summary_of(proc.stdout)
    assert summary["segmented"] == len(PHOTOS) and summary["failed"] == len(bad), summary
    startup = summary["startup"]  # where the time until the first results went, in order
    assert list(startup) == ["listing_and_checks_s", "ray_start_s", "ray_data_s", "actors_and_first_batch_s"], startup
    assert min(startup.values()) >= 0 and startup["ray_start_s"] > 0
    assert abs(sum(startup.values()) - summary["first_result_s"]) <= 0.05, summary
    assert summary["actor_calls_in_flight"] > 0, summary  # the actor's calls over the span after the first results
    found = by_image(rows(out))
    assert set(found) <= set(reference) and sorted(committed_sources(out)) == sorted(
        str(photos / name) for name in reference)
    for name, instances in reference.items():
        mine = found.get(name, {})
        assert mine.keys() == instances.keys(), name
        for key, expected in instances.items():
            row = mine[key]
            assert abs(row["score"] - expected["score"]) < 2e-4, (name, key)
            assert np.allclose(row["box_xyxy"], expected["box_xyxy"], atol=0.2), (name, key)
            mask = coco_mask.decode({"size": [row["height"], row["width"]], "counts": row["mask_counts"]})
            assert mask.sum() == row["mask_area"] and abs(row["mask_area"] - expected["mask_pixels"]) <= max(
                2, expected["mask_pixels"] // 500), (name, key)
    import pyarrow.parquet as pq

    errors = {Path(r["source"]).name: r["error"] for r in pq.read_table(out / "errors").to_pylist()}
    assert errors.keys() == bad.keys()
    assert all(bad[name] in errors[name] and "\n" not in errors[name] for name in bad), errors
    again = summary_of(segment(str(photos), "--package", str(package_path), *prompt_args(), "--output",
                               str(out)).stdout)
    assert again["segmented"] == 0 and again["skipped"] == len(PHOTOS)  # done; only the bad files tried again
    assert pq.read_table(out / "errors").num_rows == len(bad)  # each listed once
    assert len(rows(out)) == sum(map(len, found.values()))


def test_an_s3_prefix_gives_what_the_folder_gives(package_path, s3_server, tmp_path):
    photos = s3_server.data / s3_server.bucket / "photos"
    write_photos(photos)
    local = tmp_path / "local"
    shutil.copytree(photos, local)
    outs = {}
    for name, collection in (("s3", f"s3://{s3_server.bucket}/photos/"), ("folder", str(local))):
        outs[name] = tmp_path / name
        segment(collection, "--package", str(package_path), *prompt_args(), "--output", str(outs[name]),
                "--batch-size", "3", env=s3_server.env)
    remote, folder = (by_image(rows(outs[n])) for n in ("s3", "folder"))
    assert remote.keys() == folder.keys() and remote
    for name in remote:
        same_instances(remote[name], folder[name])
    assert all(s.startswith(f"s3://{s3_server.bucket}/photos/") for s in committed_sources(outs["s3"]))


def test_a_package_pulled_by_a_signed_ref_is_segmented_with_and_kept_once_per_machine(package_path, s3_server,
                                                                                      tmp_path):
    """--ref with --cache (the real S3 server): the run pulls and checks the ref, its actors load that sha256, and
    a second run finds the pull there (one copy per package on a machine, not one per run); the same rows as
    --package. A key the ref is not signed by is one line and segments nothing."""
    from sam3_aoti.cache.binary_cache import Cache
    from sam3_aoti.cache.signing import SecretKey

    key = SecretKey.generate("builder-a")
    report = tmp_path / "report.json"
    report.write_text("{}")
    files = {"sam3.pt2": package_path, "sam3.pt2.sha256": package_path.with_name("sam3.pt2.sha256"),
             "report.json": report}
    Cache(s3_server.url(), {}, key).push_ref("tiny-prod", files, {"verified": True})
    digest = package_path.with_name("sam3.pt2.sha256").read_text().split()[0]
    photos = tmp_path / "photos"
    write_photos(photos)
    env = {**s3_server.env, "SAM3_AOTI_CACHE": str(tmp_path / "node")}
    by_ref = ("--ref", "tiny-prod", "--cache", s3_server.url(), *prompt_args())
    outs = {name: tmp_path / name for name in ("first", "second", "path")}
    for name in ("first", "second"):
        summary = summary_of(segment(str(photos), *by_ref, "--trusted-key", str(key.public), "--output",
                                     str(outs[name]), env=env).stdout)
        assert summary["segmented"] == len(PHOTOS)
        assert json.loads((outs[name] / "segment.json").read_text())["package_sha256"] == digest
    pulled = [p.name for p in (tmp_path / "node" / "segment" / "packages").iterdir() if p.is_dir()]
    assert pulled == [digest]
    segment(str(photos), "--package", str(package_path), *prompt_args(), "--output", str(outs["path"]), env=env)
    for name in ("first", "second"):
        found, expected = by_image(rows(outs[name])), by_image(rows(outs["path"]))
        assert found.keys() == expected.keys() and found
        for image in found:
            same_instances(found[image], expected[image])
    proc = segment(str(photos), *by_ref, "--trusted-key", str(SecretKey.generate("builder-x").public), "--output",
                   str(tmp_path / "untrusted"), env=env, check=False)
    assert proc.returncode != 0 and proc.stdout == ""
    assert "Traceback" not in proc.stderr and "trusted" in proc.stderr.strip().splitlines()[-1]
    assert not (tmp_path / "untrusted" / "instances").exists()


def run_in_background(*args: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "sam3_aoti", "segment", *args], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": SRC},
                            start_new_session=True)


def wait_for(what, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while not what():
        assert time.monotonic() < deadline, "timed out"
        time.sleep(0.05)


def parts(output: Path) -> list[Path]:
    return list((output / "images").glob("part-*.parquet")) if (output / "images").is_dir() else []


def segmenter_pids(sid: int) -> list[int]:
    """The processes of the Ray actors running `Segmenter` (Ray names each actor's process after its class) in
    the session `sid` (a driver started with start_new_session and the local Ray it started): another test's
    run beside this one is not touched."""
    found = []
    for pid in session_members(sid):
        try:
            if b"Segmenter" in Path(f"/proc/{pid}/cmdline").read_bytes():
                found.append(pid)
        except OSError:
            pass
    return found


def run_until_a_part(package_path, tmp_path, copies: int) -> tuple[subprocess.Popen, Path, list[str]]:
    """`segment` of `copies` of each photograph into tmp_path/out, batches and parts of two, in the background,
    once its first part is committed: (the process, the output, its arguments)."""
    photos, out = tmp_path / "photos", tmp_path / "out"
    write_photos(photos, copies=copies)
    args = [str(photos), "--package", str(package_path), *prompt_args(), "--output", str(out), "--batch-size", "2",
            "--part-images", "2"]
    run = run_in_background(*args)
    wait_for(lambda: parts(out) or run.poll() is not None)
    return run, out, args


def test_an_interrupted_run_resumes_and_writes_each_image_once(package_path, tmp_path):
    run, out, args = run_until_a_part(package_path, tmp_path, copies=3)
    photos = tmp_path / "photos"
    os.killpg(run.pid, signal.SIGKILL)  # the driver and its local Ray, as a power cut would
    run.wait()
    first = set(committed_sources(out))
    assert 0 < len(first) < 3 * len(PHOTOS)
    orphan = out / "instances" / "part-killed-00000.parquet"  # killed between a part's two renames
    shutil.copy(next((out / "instances").glob("part-*.parquet")), orphan)
    summary = summary_of(segment(*args).stdout)
    assert summary["skipped"] == len(first) and summary["segmented"] == 3 * len(PHOTOS) - len(first)
    assert not orphan.exists()
    sources = committed_sources(out)
    assert len(sources) == len(set(sources)) == 3 * len(PHOTOS)
    found = rows(out)
    keys = [(r["source"], r["prompt"], r["query"]) for r in found]
    assert len(keys) == len(set(keys))
    per_image = by_image(found, key=lambda s: s)
    for name in PHOTOS:  # each copy of a photograph: the same instances
        copies = [per_image.get(str(p), {}) for p in sorted(photos.glob(f"{name}-*"))]
        for other in copies[1:]:
            same_instances(copies[0], other)


def test_a_model_actor_killed_mid_run_is_retried_and_nothing_is_lost_or_doubled(package_path, tmp_path):
    run, out, _ = run_until_a_part(package_path, tmp_path, copies=4)
    photos = tmp_path / "photos"
    pids = segmenter_pids(run.pid)
    assert pids and run.poll() is None, "no Segmenter actor to kill"
    for pid in pids:
        os.kill(pid, signal.SIGKILL)
    stdout, stderr = run.communicate(timeout=900)
    assert run.returncode == 0, stderr[-4000:]
    assert summary_of(stdout)["segmented"] == 4 * len(PHOTOS)
    sources = committed_sources(out)
    assert len(sources) == len(set(sources)) == 4 * len(PHOTOS)
    found = rows(out)
    keys = [(r["source"], r["prompt"], r["query"]) for r in found]
    assert len(keys) == len(set(keys))
    per_image = by_image(found, key=lambda s: s)
    for name in PHOTOS:
        copies = [per_image.get(str(p), {}) for p in sorted(photos.glob(f"{name}-*"))]
        for other in copies[1:]:
            same_instances(copies[0], other)


def read_only_pixels(table):
    """`decode_batch`'s table with its pixels in a read-only buffer, as Ray's shared-memory object store holds a
    batch too large to pass inline (small test batches are passed inline, in writable memory)."""
    import pyarrow as pa

    pixels = table.column("pixels").combine_chunks()
    validity, offsets, data = pixels.buffers()
    frozen = pa.py_buffer(data.to_pybytes())  # bytes: read-only
    assert not frozen.is_mutable
    column = pa.Array.from_buffers(pixels.type, len(pixels), [validity, offsets, frozen], pixels.null_count)
    return table.set_column(table.schema.get_field_index("pixels"), "pixels", column)


def test_pixels_are_read_in_place_from_a_read_only_buffer():
    """An image's bytes in a read-only Arrow buffer (Ray's shared memory) become a tensor over that very memory;
    `torch.frombuffer` alone refuses such a buffer."""
    import pyarrow as pa
    import torch

    from sam3_aoti.batch.worker import pixels_in_place

    buffer = pa.py_buffer(bytes(range(12)))
    with pytest.raises(RuntimeError, match="could not retrieve buffer"):
        torch.frombuffer(buffer, dtype=torch.uint8)  # what the actor did before, on the H100
    pixels = pixels_in_place(buffer, 2, 2)
    assert pixels.shape == (2, 2, 3) and pixels.data_ptr() == buffer.address and pixels[1, 1, 2] == 11


def test_a_batchs_pixels_are_each_images_bytes_where_the_table_holds_them():
    """`columns_of` hands each image's bytes as a view of the decoded table's memory, whether each image is a
    chunk of its own (as `decode_batch` makes them), several share one chunk (as Ray may concatenate them) or the
    table is a slice of one; an empty value (a file that did not decode) is empty."""
    import pyarrow as pa

    from sam3_aoti.batch.worker import columns_of, one_value, values_in_place

    images = [bytes([i]) * (3 * (i + 1)) for i in range(5)] + [b""]
    chunked = pa.chunked_array([one_value(pa.py_buffer(b)) for b in images], pa.large_binary())
    for column, want in ((chunked, images), (chunked.combine_chunks(), images),
                         (chunked.combine_chunks().slice(2, 3), images[2:5])):
        got = values_in_place(column)
        assert [bytes(g) for g in got] == want
        chunk_data = [c.buffers()[2] for c in getattr(column, "chunks", [column])]
        assert all(any(d.address <= g.address < d.address + d.size for d in chunk_data) for g in got if len(g))
    table = pa.table({"source": [str(i) for i in range(6)], "width": [1] * 6, "height": [i + 1 for i in range(6)],
                      "error": [""] * 5 + ["not an image"], "pixels": chunked})
    assert [bytes(p) for p in columns_of(table)[4]] == images


def test_the_segmenter_runs_in_a_loop_of_ones_own(package_path, tmp_path):
    """The Python form: `decode_batch`, `Segmenter` and `encode_masks` are what a user's own `map_batches` would
    call, and give what segment writes."""
    from pycocotools import mask as coco_mask

    from sam3_aoti.batch import Segmenter, decode_batch, encode_masks

    paths = write_photos(tmp_path / "photos")[:3]
    decoded = decode_batch({"source": np.array([str(p) for p in paths])})
    segmenter = Segmenter(str(package_path), list(PROMPTS), float(THRESHOLD))
    found = segmenter(decoded)  # the Arrow table, its pixels read in place, as segment's actors take it
    by_columns = segmenter(decoded.to_pydict())  # or its columns
    assert found.drop_columns(["seconds"]).equals(by_columns.drop_columns(["seconds"]))
    shared = segmenter(read_only_pixels(decoded))  # as Ray's shared-memory store hands a large batch on
    assert found.drop_columns(["seconds"]).equals(shared.drop_columns(["seconds"]))
    overlapping_calls_give_each_batchs_rows(str(package_path), list(PROMPTS), float(THRESHOLD),
                                            [decoded, decoded.slice(1), decoded.slice(0, 1)])
    result = encode_masks(found.slice(1)).to_pylist()  # a slice, as Ray may hand a block on
    assert [r["source"] for r in result] == [str(p) for p in paths[1:]]
    assert all(r["error"] == "" and r["width"] > 0 for r in result)
    assert any(r["instances"] for r in result)
    for row in result:
        for inst in row["instances"]:
            mask = coco_mask.decode({"size": [row["height"], row["width"]], "counts": inst["mask_counts"]})
            assert mask.shape == (row["height"], row["width"]) and mask.sum() == inst["mask_area"]


def test_a_short_batch_padded_to_the_batch_size_finds_what_it_finds_alone(package_path, tmp_path):
    """Where the model replays CUDA graphs (not on this CPU: `pad_to` is set by hand), a batch short of the batch
    size runs padded with blank images: each real image's instances are the ones it gets unpadded, to the float
    rounding any other batch size gives, and the padding's own are left out."""
    from sam3_aoti.batch import Segmenter, decode_batch

    paths = write_photos(tmp_path / "photos")[:3]
    decoded = decode_batch({"source": np.array([str(p) for p in paths])})
    alone = Segmenter(str(package_path), list(PROMPTS), float(THRESHOLD), batch_size=8)
    assert alone.pad_to is None  # a CPU package replays no graphs: nothing to pad for
    padded = Segmenter(str(package_path), list(PROMPTS), float(THRESHOLD))
    padded.pad_to = 8
    for batch in (decoded, decoded.slice(1, 1)):
        want, got = alone(batch).to_pylist(), padded(batch).to_pylist()
        assert [r["source"] for r in got] == [r["source"] for r in want]
        for mine, theirs in zip(got, want):
            assert [(i["prompt"], i["query"]) for i in mine["instances"]] == \
                [(i["prompt"], i["query"]) for i in theirs["instances"]], mine["source"]
            for a, b in zip(mine["instances"], theirs["instances"]):
                assert abs(a["score"] - b["score"]) < 1e-4 and np.allclose(a["box_xyxy"], b["box_xyxy"], atol=1e-2)
                assert abs(a["mask_area"] - b["mask_area"]) <= 0.01 * b["mask_area"] + 2


@pytest.mark.parametrize("change, words", [
    (["--prompt", "a dog"], "holds a run with other settings (prompts)"),
    (["--threshold", "0.3"], "holds a run with other settings (threshold)"),
])
def test_resuming_with_other_settings_is_one_line(package_path, tmp_path, change, words):
    from sam3_aoti.batch.dataset import Output

    out = tmp_path / "out"
    digest = Path(f"{package_path}.sha256").read_text().split()[0]
    Output(out, {"package_sha256": digest, "prompts": ["a person"], "threshold": 0.5, "boxes": [], "labels": [],
                 "boxes_on": None})
    write_photos(tmp_path / "photos")
    proc = segment(str(tmp_path / "photos"), "--package", str(package_path), "--prompt", "a person", *change,
                   "--output", str(out), check=False)
    assert proc.returncode != 0 and words in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


@pytest.mark.parametrize("collection, words", [
    ("{tmp}/nowhere", "is not a folder, a glob, a .txt list of images or a bucket prefix"),
    ("{tmp}/empty", "names no images"),
    ("{tmp}/*.nothing", "names no images"),
])
def test_a_collection_with_nothing_to_segment_is_one_line(package_path, tmp_path, collection, words):
    (tmp_path / "empty").mkdir()
    proc = segment(collection.format(tmp=tmp_path), "--package", str(package_path), "--prompt", "a cat",
                   "--output", str(tmp_path / "out"), check=False)
    assert proc.returncode != 0 and words in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert not (tmp_path / "out").exists()


def test_a_collection_is_a_folder_a_glob_or_a_list_each_image_once(tmp_path):
    from sam3_aoti.batch.sources import list_sources

    photos = write_photos(tmp_path / "photos")
    (tmp_path / "photos" / "deeper").mkdir()
    nested = tmp_path / "photos" / "deeper" / "x.PNG"
    shutil.copy(photos[0], nested)
    (tmp_path / "photos" / "readme.md").write_text("not an image")
    everything = sorted(str(p) for p in [*photos, nested])
    assert list_sources(str(tmp_path / "photos")) == everything
    assert list_sources(f"file://{tmp_path / 'photos'}") == everything
    assert list_sources(str(tmp_path / "photos" / "*.jpg")) == sorted(str(p) for p in photos if p.suffix == ".jpg")
    listing = tmp_path / "list.txt"
    listing.write_text(f"# tiles\n{photos[1].name}\n\n{photos[0]}\n{photos[1]}\n".replace(
        photos[1].name, f"photos/{photos[1].name}", 1))
    assert list_sources(str(listing)) == sorted({str(photos[0]), str(photos[1])})


def test_listing_follows_linked_folders_once_and_takes_a_bracketed_folder_for_itself(tmp_path):
    """A folder named like a glob is that folder; a linked folder is listed, a link back up is no loop."""
    from PIL import Image

    from sam3_aoti.batch.sources import list_sources

    tiles, elsewhere = tmp_path / "tiles [2024]*", tmp_path / "elsewhere"
    (tiles / "a").mkdir(parents=True)
    elsewhere.mkdir()
    Image.new("RGB", (4, 4)).save(tiles / "a" / "x.png")
    Image.new("RGB", (4, 4)).save(elsewhere / "y.png")
    (tiles / "linked").symlink_to(elsewhere)
    (tiles / "a" / "up").symlink_to(tiles)
    assert list_sources(str(tiles)) == [str(tiles / "a" / "x.png"), str(tiles / "linked" / "y.png")]


@pytest.mark.parametrize("option, value", [("batch_size", 0), ("part_images", 0), ("actors", 0), ("actor_cpus", 0)])
def test_counts_below_one_are_one_line_before_anything_starts(tmp_path, option, value):
    from sam3_aoti.batch.engine import segment
    from sam3_aoti.errors import ConfigError

    flag = "--" + option.replace("_", "-")
    with pytest.raises(ConfigError, match=f"must each be 1 or more .*{flag}"):
        segment(str(tmp_path), tmp_path / "out", ["a cat"], str(tmp_path / "none.pt2"), **{option: value})
    assert not (tmp_path / "out").exists()


def test_a_ray_segment_starts_runs_as_this_interpreter_and_sends_no_usage_statistics(tmp_path, monkeypatch):
    """For the Ray it starts (no --ray-address), segment switches off Ray's `uv run` workers and its usage
    statistics before Ray is imported, unless the user set them: Ray Data's statistics call into Ray after the last
    batch, and such a call after ray.shutdown ends the process with exit 1."""
    from sam3_aoti.batch.engine import segment
    from sam3_aoti.errors import ConfigError

    for name in ("RAY_ENABLE_UV_RUN_RUNTIME_ENV", "RAY_USAGE_STATS_ENABLED"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ConfigError):  # stops before Ray starts
        segment(str(tmp_path), tmp_path / "out", ["a cat"], str(tmp_path / "none.pt2"), batch_size=0)
    assert os.environ["RAY_ENABLE_UV_RUN_RUNTIME_ENV"] == os.environ["RAY_USAGE_STATS_ENABLED"] == "0"
    monkeypatch.setenv("RAY_USAGE_STATS_ENABLED", "1")  # the user's own choice stands
    with pytest.raises(ConfigError):
        segment(str(tmp_path), tmp_path / "out", ["a cat"], str(tmp_path / "none.pt2"), batch_size=0)
    assert os.environ["RAY_USAGE_STATS_ENABLED"] == "1"


@pytest.mark.slow  # a process of its own
def test_the_local_rays_connect_settings_are_ones_ray_reads():
    """A misspelt Ray setting is ignored without a word: a process with segment's settings for its own Ray sees
    them in Ray's config (1000 ms and 10 tries without them)."""
    from sam3_aoti.batch.engine import LOCAL_RAY_ENV

    code = ("import ray._raylet as r; c = r.Config; "
            "print(c.raylet_client_connect_timeout_milliseconds(), c.raylet_client_num_connect_attempts())")
    seen = subprocess.run([sys.executable, "-c", code], env={**os.environ, **LOCAL_RAY_ENV}, capture_output=True,
                          text=True, check=True, timeout=120).stdout.split()
    assert seen == [LOCAL_RAY_ENV["RAY_raylet_client_connect_timeout_milliseconds"],
                    LOCAL_RAY_ENV["RAY_raylet_client_num_connect_attempts"]], seen


@pytest.mark.slow  # a local Ray of its own
def test_ray_data_imported_beside_rays_start_runs_a_pipeline():
    """Where segment imports Ray Data in a thread while `ray.init` starts Ray (a machine of 8 CPUs and more, or a
    cluster joined), both imports finish whole: the pipeline after them runs (forced here on any machine)."""
    from sam3_aoti.batch.engine import LOCAL_RAY_ENV

    code = ("import ray, sys; from sam3_aoti.batch.engine import start_ray; start_ray(ray, None, data_beside=True); "
            "assert 'ray.data' in sys.modules; "
            "rows = ray.data.range(8).map_batches(lambda b: {'id': b['id'] * 2}).take_all(); ray.shutdown(); "
            "print(sorted(r['id'] for r in rows))")
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, **LOCAL_RAY_ENV}, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0 and out.stdout.split("\n")[-2] == str(list(range(0, 16, 2))), out.stderr[-2000:]


@pytest.mark.slow  # a local Ray of its own
def test_a_local_rays_start_asks_for_its_raylet_once_it_has_registered():
    """Ray's driver sleeps a whole second between asks for its raylet; segment's start polls GCS briskly first, so
    Ray's own ask (spied on here) comes when the raylet is already alive, and Ray's function is put back after. If a
    Ray release calls another function, the spy sees the raylet not yet alive (or no call) and this fails."""
    from sam3_aoti.batch.engine import LOCAL_RAY_ENV

    code = """
import json, ray
from ray._private import services, state
from sam3_aoti.batch.engine import start_ray
asks = []
ray_own = services.get_node
def spy(gcs_address, node_id):
    nodes = state.GlobalState()
    nodes._initialize_global_state(services._get_gcs_client_options(gcs_address))
    asks.append(any(n["NodeID"] == node_id and n["Alive"] for n in nodes.node_table()))
    return ray_own(gcs_address, node_id)
services.get_node = spy
start_ray(ray, None, data_beside=False)
ray.shutdown()
print(json.dumps({"alive_when_asked": asks, "put_back": services.get_node is spy}))
"""
    out = subprocess.run([sys.executable, "-c", code], env={**os.environ, **LOCAL_RAY_ENV}, capture_output=True,
                         text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    seen = json.loads(out.stdout.splitlines()[-1])
    assert seen == {"alive_when_asked": [True], "put_back": True}, seen


def test_a_fifo_or_a_folder_named_as_an_image_is_refused_without_blocking(tmp_path):
    import threading

    from sam3_aoti.errors import PackageError
    from sam3_aoti.batch.sources import read_source

    fifo, folder = tmp_path / "pipe.png", tmp_path / "folder.png"
    os.mkfifo(fifo)
    folder.mkdir()
    for name in (fifo, folder):
        raised = []
        reader = threading.Thread(target=lambda: raised.append(pytest.raises(PackageError, read_source, str(name))),
                                  daemon=True)
        reader.start()
        reader.join(timeout=20)
        assert not reader.is_alive(), f"reading {name.name} blocked"
        assert raised and "is not a regular file" in str(raised[0].value)


def test_errors_list_each_failing_file_once_across_reruns_until_it_is_segmented(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from sam3_aoti.batch.dataset import Output
    from sam3_aoti.batch.schemas import segmented_schema

    def results(*rows):
        return pa.Table.from_pylist([{"source": s, "width": 4, "height": 4, "error": e, "seconds": 0.1,
                                      "instances": []} for s, e in rows], schema=segmented_schema())

    def listed() -> list[str]:
        return sorted(pq.read_table(tmp_path / "out" / "errors").column("source").to_pylist())

    settings = {"prompts": ["a roof"]}
    for run in range(3):  # each rerun retries the failing files and fails again
        out = Output(tmp_path / "out", settings)
        out.add(results(("a.png", "cannot read a.png"), ("b.png", "truncated"), ("c.png", None)))
        out.flush()
        out.close()
        assert out.failed == 2 and listed() == ["a.png", "b.png"]
    out = Output(tmp_path / "out", settings)  # a.png mended: segmented, and no longer listed as failing
    out.add(results(("a.png", None), ("b.png", "truncated")))
    out.flush()
    assert listed() == ["b.png"] and out.done == {"a.png", "c.png"}


def test_a_second_run_into_an_output_a_live_run_holds_refuses(tmp_path):
    from sam3_aoti.errors import ConfigError
    from sam3_aoti.batch.dataset import Output

    first = Output(tmp_path / "out", {"prompts": ["a roof"]})
    with pytest.raises(ConfigError, match=rf"{tmp_path / 'out'} is being written by another segment run \(pid {os.getpid()}\)"):
        Output(tmp_path / "out", {"prompts": ["a roof"]})
    first.close()  # the first run ends: the next one resumes
    assert Output(tmp_path / "out", {"prompts": ["a roof"]}).done == set()


def test_listing_names_what_it_leaves_out(tmp_path):
    from sam3_aoti.batch.sources import list_sources

    folder = tmp_path / "tiles"
    folder.mkdir()
    (folder / "a.png").write_bytes(b"")
    (folder / "gone.jpg").symlink_to(folder / "nothing.jpg")
    (folder / b"caf\xe9.png".decode("utf-8", "surrogateescape")).write_bytes(b"")
    problems = []
    assert list_sources(str(folder), problems) == [str(folder / "a.png")]
    assert sorted(problems) == [(str(folder / "caf\\xe9.png"), "its name is not valid UTF-8: rename the file"),
                                (str(folder / "gone.jpg"), "a link to nothing: mend or remove it")]


@pytest.mark.parametrize("folder, damage", [
    ("images", lambda data: data[: len(data) // 2]),
    ("instances", lambda data: b""),
    ("instances", lambda data: b"not parquet at all, " * 20),
])
def test_a_damaged_committed_part_is_named_and_its_images_are_done_again(tmp_path, folder, damage):
    import pyarrow as pa

    from sam3_aoti.batch.dataset import Output
    from sam3_aoti.batch.schemas import segmented_schema

    settings = {"prompts": ["a roof"]}
    out = Output(tmp_path / "out", settings, part_images=2)
    for pair in (("a.png", "b.png"), ("c.png", "d.png")):  # two parts
        out.add(pa.Table.from_pylist([{"source": s, "width": 4, "height": 4, "error": None, "seconds": 0.1,
                                       "instances": []} for s in pair], schema=segmented_schema()))
    out.flush()
    out.close()
    first = sorted((tmp_path / "out" / folder).glob("part-*.parquet"))[0]
    first.write_bytes(damage(first.read_bytes()))
    again = Output(tmp_path / "out", settings)
    assert again.done == {"c.png", "d.png"}  # the damaged part's images are segmented again
    assert len(again.damaged) == 1 and again.damaged[0].startswith(first.name)
    assert not (tmp_path / "out" / "images" / first.name).exists()


def test_the_exemplar_image_is_named_by_its_content(package_path, tmp_path):
    """Other pixels under the same name are other settings: a resumed run refuses them in one line."""
    from sam3_aoti.batch.dataset import Output

    write_photos(tmp_path / "photos")
    exemplar, out = tmp_path / "photos" / "astronaut-0.png", tmp_path / "out"
    digest = Path(f"{package_path}.sha256").read_text().split()[0]
    Output(out, {"package_sha256": digest, "prompts": ["a person"], "threshold": 0.5, "boxes": [[10.0, 10.0, 60.0, 60.0]],
                 "labels": [1], "boxes_on": str(exemplar), "boxes_on_sha256": "0" * 64}).close()
    proc = segment(str(tmp_path / "photos"), "--package", str(package_path), "--prompt", "a person", "--box",
                   "10,10,60,60", "--boxes-on", str(exemplar), "--output", str(out), check=False)
    assert proc.returncode == 2 and "holds a run with other settings (boxes_on_sha256)" in proc.stderr, proc.stderr
    assert "Traceback" not in proc.stderr


@pytest.mark.parametrize("errno_, words", [(28, "No space left on device"), (30, "Read-only file system"),
                                           (13, "Permission denied")])
def test_writing_under_the_output_fails_in_one_line_and_leaves_nothing_half_written(tmp_path, monkeypatch,
                                                                                    errno_, words):
    import pyarrow as pa
    import pyarrow.parquet as pq

    from sam3_aoti.errors import Sam3AotiError
    from sam3_aoti.batch.dataset import Output
    from sam3_aoti.batch.schemas import segmented_schema

    out = Output(tmp_path / "out", {"prompts": ["a roof"]})
    out.add(pa.Table.from_pylist([{"source": "a.png", "width": 4, "height": 4, "error": None, "seconds": 0.1,
                                   "instances": []}], schema=segmented_schema()))
    real = pq.write_table

    def fails(table, where, *args, **kwargs):
        real(table, where, *args, **kwargs)  # the temporary exists, then the disk says no
        raise OSError(errno_, os.strerror(errno_), str(where))

    monkeypatch.setattr(pq, "write_table", fails)
    with pytest.raises(Sam3AotiError, match=rf"cannot write under --output {tmp_path / 'out'}: {words}") as failed:
        out.flush()
    assert "\n" not in str(failed.value) and failed.value.exit_code == 1
    assert sorted(p.name for p in (tmp_path / "out").rglob("*") if p.is_file()) == [".lock", "segment.json"]


def session_members(sid: int) -> list[int]:
    """The processes of a session (a driver started with start_new_session, and the local Ray it started)."""
    found = []
    for proc in Path("/proc").iterdir():
        if proc.name.isdigit():
            try:
                fields = (proc / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[3]) == sid and fields[0] != "Z":
                found.append(int(proc.name))
    return found


@pytest.mark.parametrize("how", [signal.SIGINT, signal.SIGTERM])
def test_a_signal_to_the_driver_commits_what_came_back_ends_its_ray_and_exits_130(package_path, tmp_path, how):
    # many images past the first part, so the run is still going when the signal comes, however fast it decodes
    run, out, _ = run_until_a_part(package_path, tmp_path, copies=8)
    assert len(session_members(run.pid)) > 1  # the driver and the Ray it started
    run.send_signal(how)  # the driver alone: its Ray is its business
    _, err = run.communicate(timeout=180)
    assert run.returncode == 130 and err.strip().splitlines()[-1] == "sam3-aoti: interrupted", err[-3000:]
    assert "Traceback" not in err
    wait_for(lambda: not session_members(run.pid), timeout=30)  # nothing of the run or its Ray is left
    assert 0 < len(committed_sources(out)) < 8 * len(PHOTOS)


def test_a_part_holds_each_instance_of_each_image_as_the_rows_say(tmp_path):
    """The writer keeps Arrow tables as they come (no Python rows): a part's instances are every image's
    instances in order, with the image's source and size, and its images table counts them; errors and
    images delivered twice are left out."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from sam3_aoti.batch.dataset import Output, read_instances
    from sam3_aoti.batch.schemas import segmented_schema

    def instance(prompt, query, score):
        return {"prompt": prompt, "query": query, "score": score, "box_xyxy": [1.0, 2.0, 3.0 + query, 4.0],
                "mask_area": 10 * query, "mask_counts": f"rle{query}"}

    rows = [{"source": "a.jpg", "width": 4, "height": 3, "error": "", "seconds": 0.5,
             "instances": [instance("roof", 1, 0.875), instance("tree", 7, 0.625)]},
            {"source": "b.png", "width": 5, "height": 6, "error": "", "seconds": 0.25, "instances": []},
            {"source": "c.jpg", "width": 0, "height": 0, "error": "not an image", "seconds": 0.0, "instances": []},
            {"source": "d.jpg", "width": 8, "height": 9, "error": "", "seconds": 0.125,
             "instances": [instance("roof", 3, 0.75)]}]
    out = Output(tmp_path / "out", {"prompts": ["roof", "tree"]}, part_images=100)
    out.add(pa.Table.from_pylist(rows[:2], schema=segmented_schema()))
    out.add(pa.Table.from_pylist(rows[1:], schema=segmented_schema()))  # b.png delivered twice
    out.flush()
    out.close()
    expected = [{"source": r["source"], "width": r["width"], "height": r["height"], **inst}
                for r in rows if not r["error"] for inst in r["instances"]]
    assert read_instances(tmp_path / "out").to_pylist() == expected
    [images] = (tmp_path / "out" / "images").glob("*.parquet")
    assert pq.read_table(images).to_pylist() == [
        {"source": r["source"], "width": r["width"], "height": r["height"], "instances": len(r["instances"]),
         "seconds": r["seconds"]} for r in rows if not r["error"]]
    assert out.failed == 1 and out.written == 3
