"""`doit throughput`'s collection looks like a user's: mixed sizes, PNGs beside JPEGs, a few broken files."""

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
