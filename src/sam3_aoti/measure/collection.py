"""A collection of photographs like a user's, for timing `segment` (the throughput stage, and
scripts/checks/segment_actor.py): mixed sizes, some very large, PNGs beside JPEGs, a few broken files."""

from __future__ import annotations

import functools
import json
import os
import shutil
from pathlib import Path

PHOTOS = ("astronaut", "chelsea", "coffee", "rocket", "camera", "coins", "hubble_deep_field", "immunohistochemistry")


LARGE_EVERY, PNG_EVERY = 8, 3  # every 8th photograph large_width px wide, every 3rd a PNG
PER_WORKER = 32  # photographs a writer process takes on at least (a process costs its imports, about a second)


@functools.cache
def _source(index: int):
    """The photograph `PHOTOS[index]` as an RGB PIL image, read once per process (it is resized into a new one)."""
    import skimage.data
    from PIL import Image

    from ..runtime.images import array_to_rgb8

    return Image.fromarray(array_to_rgb8(getattr(skimage.data, PHOTOS[index])()))


def _plans(count: int, min_side: int, large_width: int) -> list[dict]:
    """Each photograph's source, size, crop, mirror and format, drawn in order from one seeded generator (so the
    collection is the same whichever process writes which photograph)."""
    import numpy as np

    rng = np.random.default_rng(0)
    sizes = [_source(i).size for i in range(min(count, len(PHOTOS)))]
    plans = []
    for i in range(count):
        width, height = sizes[i % len(PHOTOS)]
        side = min_side + int(rng.integers(0, 256))
        scale = side / min(width, height) if i % LARGE_EVERY else large_width / width
        resized = (round(width * scale * 1.1), round(height * scale * 1.1))
        x, y = (int(rng.integers(0, max(1, d - round(d / 1.1)))) for d in resized)
        plans.append({"index": i, "source": i % len(PHOTOS), "resized": resized, "crop": (x, y),
                      "mirror": bool(i // len(PHOTOS) % 2), "kind": "png" if i % PNG_EVERY == 1 else "jpeg"})
    return plans


def _write(folder: Path, plan: dict, copies: int) -> None:
    """One photograph of the collection, under `copies` names (hard links where the file system has them)."""
    from PIL import Image, ImageOps

    image = _source(plan["source"]).resize(plan["resized"], Image.BILINEAR)
    x, y = plan["crop"]
    image = image.crop((x, y, x + round(image.width / 1.1), y + round(image.height / 1.1)))
    if plan["mirror"]:
        image = ImageOps.mirror(image)
    path = folder / f"{plan['index']:05d}.{'png' if plan['kind'] == 'png' else 'jpg'}"
    image.save(path, **({} if plan["kind"] == "png" else {"quality": 90}))
    for copy in range(1, copies):
        twin = path.with_name(f"{path.stem}-{copy}{path.suffix}")
        try:
            os.link(path, twin)
        except OSError:  # a file system without hard links
            shutil.copyfile(path, twin)


def write_collection(folder: Path, count: int, min_side: int, large_width: int, broken: int, copies: int = 1) -> dict:
    """A collection like a user's, written once: `count` photographs, none alike (each short side `min_side` to
    `min_side` + 255 px, or `large_width` px wide; PNG or JPEG), each under `copies` names (hard links: a run
    long enough to time, at the cost of writing `count`), and `broken` files that are no image (a truncated
    JPEG, an empty file, text named .png). Returns what it holds (collection.json), the images as segment sees
    them: `count` x `copies`. Written by a process per core (PNG encoding of 4000 px photographs took 113 s in
    one on the GPU machine)."""
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    described = folder / "collection.json"
    wanted = {"count": count, "min_side": min_side, "large_width": large_width, "broken": broken, "copies": copies}
    if described.is_file() and json.loads(described.read_text()).get("wanted") == wanted:
        return json.loads(described.read_text())
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    plans = _plans(count, min_side, large_width)
    workers = max(1, min(os.cpu_count() or 1, count // PER_WORKER))
    if workers == 1:
        for plan in plans:
            _write(folder, plan, copies)
    else:
        with ProcessPoolExecutor(workers, get_context("spawn")) as pool:
            for done in [pool.submit(_write, folder, plan, copies) for plan in plans]:
                done.result()
    kinds = {"jpeg": 0, "png": 0, "large": 0, "broken": broken}
    for plan in plans:
        kinds[plan["kind"]] += copies
        kinds["large"] += copies * (not plan["index"] % LARGE_EVERY)
    whole = min(folder.glob("*.jpg"), default=None)
    for i in range(broken):
        name = folder / f"broken-{i:03d}{('.jpg', '.jpg', '.png')[i % 3]}"
        if i % 3 == 0 and whole is not None:
            name.write_bytes(whole.read_bytes()[: whole.stat().st_size // 2])  # truncated
        elif i % 3 == 1:
            name.write_bytes(b"")
        else:
            name.write_text("not an image\n")
    collection = {"wanted": wanted, "files": count * copies + broken, "images": count * copies, "unique": count, **kinds}
    described.write_text(json.dumps(collection, indent=2) + "\n")
    return collection
