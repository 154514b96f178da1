"""A collection of photographs like a user's, for timing `segment` (the throughput stage, and
scripts/checks/segment_actor.py): mixed sizes, some very large, PNGs beside JPEGs, a few broken files."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

PHOTOS = ("astronaut", "chelsea", "coffee", "rocket", "camera", "coins", "hubble_deep_field", "immunohistochemistry")


LARGE_EVERY, PNG_EVERY = 8, 3  # every 8th photograph large_width px wide, every 3rd a PNG


def write_collection(folder: Path, count: int, min_side: int, large_width: int, broken: int, copies: int = 1) -> dict:
    """A collection like a user's, written once: `count` photographs, none alike (each short side `min_side` to
    `min_side` + 255 px, or `large_width` px wide; PNG or JPEG), each under `copies` names (hard links: a run
    long enough to time, at the cost of writing `count`), and `broken` files that are no image (a truncated
    JPEG, an empty file, text named .png). Returns what it holds (collection.json), the images as segment sees
    them: `count` x `copies`."""
    import numpy as np
    import skimage.data
    from PIL import Image, ImageOps

    from ..runtime.images import array_to_rgb8

    described = folder / "collection.json"
    wanted = {"count": count, "min_side": min_side, "large_width": large_width, "broken": broken, "copies": copies}
    if described.is_file() and json.loads(described.read_text()).get("wanted") == wanted:
        return json.loads(described.read_text())
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    rng = np.random.default_rng(0)
    sources = [Image.fromarray(array_to_rgb8(getattr(skimage.data, name)())) for name in PHOTOS]
    kinds = {"jpeg": 0, "png": 0, "large": 0, "broken": broken}
    for i in range(count):
        image = sources[i % len(sources)]
        side = min_side + int(rng.integers(0, 256))
        scale = side / min(image.size) if i % LARGE_EVERY else large_width / image.width
        image = image.resize((round(image.width * scale * 1.1), round(image.height * scale * 1.1)), Image.BILINEAR)
        x, y = (int(rng.integers(0, max(1, d - round(d / 1.1)))) for d in image.size)
        image = image.crop((x, y, x + round(image.width / 1.1), y + round(image.height / 1.1)))
        if i // len(sources) % 2:
            image = ImageOps.mirror(image)
        kind = "png" if i % PNG_EVERY == 1 else "jpeg"
        path = folder / f"{i:05d}.{'png' if kind == 'png' else 'jpg'}"
        image.save(path, **({} if kind == "png" else {"quality": 90}))
        for copy in range(1, copies):
            twin = path.with_name(f"{path.stem}-{copy}{path.suffix}")
            try:
                os.link(path, twin)
            except OSError:  # a file system without hard links
                shutil.copyfile(path, twin)
        kinds[kind] += copies
        kinds["large"] += copies * (not i % LARGE_EVERY)
    whole = next(folder.glob("*.jpg"), None)
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
