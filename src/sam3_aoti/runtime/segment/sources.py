"""What `segment` reads: a collection named by a folder, a glob, a text file of paths, or a prefix on object
storage, listed as sorted full names (local absolute paths, or URLs), each read whole and bounded. Object
storage goes through fsspec with the binary cache's time limits (`runtime.store`), so a bucket the cache can
read, `segment` can read."""

from __future__ import annotations

import io
import os
from pathlib import Path

from ...errors import ConfigError, PackageError, first_line

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".tif", ".tiff", ".webp", ".bmp", ".gif")
LIST_SUFFIXES = (".txt", ".lst")  # a text file naming one image per line
MAX_FILE_BYTES = 1 << 30  # an image file larger than this is refused before it is read (tile it)


def is_url(name: str) -> bool:
    return "://" in name and not name.startswith("file://")


def filesystem(url: str):
    """(fsspec filesystem, path inside it) for a URL, with the cache's time limits on connecting and reading."""
    from ..store import Store

    store = Store(url)
    return store.fs, store.root


def list_sources(spec: str) -> list[str]:
    """Every image the collection names, sorted, each once; one line when it names none."""
    spec = spec.removeprefix("file://")
    if not is_url(spec) and Path(spec).suffix.lower() in LIST_SUFFIXES and Path(spec).is_file():
        lines = Path(spec).read_text().splitlines()
        names = [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
        found = [n if is_url(n) else str(Path(spec).parent.joinpath(n.removeprefix("file://")).absolute())
                 for n in names]
    elif any(c in spec for c in "*?["):
        found = _glob(spec)
    elif is_url(spec):
        found = _find_remote(spec)
    else:
        root = Path(spec)
        if not root.is_dir():
            raise ConfigError(f"{spec} is not a folder, a glob, a .txt list of images or a bucket prefix: "
                              "pass one of those")
        found = [str(p.absolute()) for p in root.rglob("*") if p.suffix.lower() in IMAGE_SUFFIXES and p.is_file()]
    found = sorted(set(found))
    if not found:
        raise ConfigError(f"{spec} names no images ({', '.join(IMAGE_SUFFIXES)}): pass a folder, glob, list or "
                          "prefix that holds some")
    return found


def _glob(spec: str) -> list[str]:
    if not is_url(spec):
        import glob

        return [str(Path(p).absolute()) for p in glob.glob(spec, recursive=True) if os.path.isfile(p)]
    fs, pattern = filesystem(spec)
    scheme = spec.split("://", 1)[0]
    return [f"{scheme}://{p}" for p in _remote(spec, lambda: fs.glob(pattern))]


def _find_remote(spec: str) -> list[str]:
    fs, root = filesystem(spec)
    scheme = spec.split("://", 1)[0]
    return [f"{scheme}://{p}" for p in _remote(spec, lambda: fs.find(root))
            if Path(p).suffix.lower() in IMAGE_SUFFIXES]


def _remote(spec: str, listing) -> list[str]:
    try:
        return list(listing())
    except FileNotFoundError:
        return []
    except Exception as e:  # botocore, aiohttp: their own errors
        raise ConfigError(f"cannot list {spec} ({first_line(e)})") from None


def read_source(name: str) -> bytes:
    """The bytes of one image file, local or remote, refused past MAX_FILE_BYTES (PackageError: a bad file of the
    collection, listed in the run's errors)."""
    try:
        if is_url(name):
            fs, path = filesystem(name)
            with fs.open(path, "rb") as f:
                data = f.read(MAX_FILE_BYTES + 1)
        else:
            with open(name, "rb") as f:
                data = f.read(MAX_FILE_BYTES + 1)
    except Exception as e:  # OSError, a store's ConfigError, fsspec backends' own errors
        raise PackageError(f"cannot read {name} ({first_line(e)})") from None
    if len(data) > MAX_FILE_BYTES:
        raise PackageError(f"{name} is over {MAX_FILE_BYTES >> 30} GiB: tile it")
    return data


def decode(name: str):
    """HxWx3 uint8 RGB of one collection member, as `predict` reads a file (`images.decode_image`)."""
    from ..images import decode_image

    return decode_image(io.BytesIO(read_source(name)), name)
