"""What `segment` reads: a collection named by a folder, a glob, a text file of paths, or a prefix on object
storage, listed as sorted full names (local absolute paths, or URLs), each read whole and bounded. Object
storage goes through fsspec with the binary cache's time limits (`cache.store`), so a bucket the cache can
read, `segment` can read."""

from __future__ import annotations

import io
import os
import stat
from pathlib import Path

from ..errors import ConfigError, PackageError, first_line

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".tif", ".tiff", ".webp", ".bmp", ".gif")
LIST_SUFFIXES = (".txt", ".lst")  # a text file naming one image per line
MAX_FILE_BYTES = 1 << 30  # an image file larger than this is refused before it is read (tile it)


def is_url(name: str) -> bool:
    return "://" in name and not name.startswith("file://")


def filesystem(url: str):
    """(fsspec filesystem, path inside it) for a URL, with the cache's time limits on connecting and reading."""
    from ..cache.store import Store

    store = Store(url)
    return store.fs, store.root


def readable(name: str) -> str:
    """A file name as text whatever its bytes (one that is not UTF-8 with its odd bytes as \\xNN)."""
    return os.fsencode(name).decode("utf-8", "backslashreplace") if not is_url(name) else name


def list_sources(spec: str, problems: list | None = None) -> list[str]:
    """Every image the collection names, sorted, each once; one line when it names none. What it leaves out is
    appended to `problems` as (name, reason), for the run's errors: a folder it cannot list, a link to nothing,
    a file whose name is not UTF-8 (Arrow's strings, and so the dataset, cannot hold it)."""
    problems = [] if problems is None else problems
    spec = spec.removeprefix("file://")
    if not is_url(spec) and Path(spec).suffix.lower() in LIST_SUFFIXES and Path(spec).is_file():
        lines = Path(spec).read_text().splitlines()
        names = [line.strip() for line in lines if line.strip() and not line.lstrip().startswith("#")]
        found = [n if is_url(n) else str(Path(spec).parent.joinpath(n.removeprefix("file://")).absolute())
                 for n in names]
    elif not is_url(spec) and Path(spec).is_dir():  # before globs: a folder named "tiles [2024]" is that folder
        found = _walk(Path(spec), problems)
    elif any(c in spec for c in "*?["):
        found = _glob(spec)
    elif is_url(spec):
        found = _find_remote(spec)
    else:
        raise ConfigError(f"{spec} is not a folder, a glob, a .txt list of images or a bucket prefix: "
                          "pass one of those")
    found = sorted(set(found))
    for name in [n for n in found if readable(n) != n]:
        found.remove(name)
        problems.append((readable(name), "its name is not valid UTF-8: rename the file"))
    if not found and not problems:
        raise ConfigError(f"{spec} names no images ({', '.join(IMAGE_SUFFIXES)}): pass a folder, glob, list or "
                          "prefix that holds some")
    return found


def _walk(root: Path, problems: list) -> list[str]:
    """The image files under `root`, following links to folders, each real folder once (a link back up is no
    loop); a folder it cannot list and a link to nothing go to `problems`."""
    found, seen = [], set()
    cannot_list = lambda e: problems.append((readable(e.filename), f"cannot list this folder ({e.strerror})"))
    for folder, subfolders, files in os.walk(root, followlinks=True, onerror=cannot_list):
        where = os.stat(folder)
        if (where.st_dev, where.st_ino) in seen:
            subfolders.clear()
            continue
        seen.add((where.st_dev, where.st_ino))
        for name in files:
            path = Path(folder, name).absolute()
            if path.suffix.lower() not in IMAGE_SUFFIXES:
                continue
            if path.is_file():
                found.append(str(path))
            elif path.is_symlink():
                problems.append((readable(str(path)), "a link to nothing: mend or remove it"))
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
        else:  # opened without blocking, then refused unless a regular file: a FIFO or a device never hangs the run
            fd = os.open(name, os.O_RDONLY | os.O_NONBLOCK)
            if not stat.S_ISREG(os.fstat(fd).st_mode):
                os.close(fd)
                raise PackageError(f"{name} is not a regular file (a FIFO, a device or a folder): name image files")
            with os.fdopen(fd, "rb") as f:
                data = f.read(MAX_FILE_BYTES + 1)
    except PackageError:
        raise
    except Exception as e:  # OSError, a store's ConfigError, fsspec backends' own errors
        raise PackageError(f"cannot read {name} ({first_line(e)})") from None
    if len(data) > MAX_FILE_BYTES:
        raise PackageError(f"{name} is over {MAX_FILE_BYTES >> 30} GiB: tile it")
    return data


def decode(name: str, sha256: str | None = None, as_bytes: bool = False):
    """HxWx3 uint8 RGB of one collection member, as `predict` reads a file (`images.decode_image`); with `sha256`,
    only if its bytes are those (the exemplar image a run's settings name by content); `as_bytes`: its bytes and
    (H, W) instead of the array."""
    import hashlib

    from ..runtime.images import decode_image

    data = read_source(name)
    if sha256 and hashlib.sha256(data).hexdigest() != sha256:
        raise ConfigError(f"{name} changed since the run began (its sha256 is not the one in segment.json): "
                          "put the exemplar image back, or start a new --output")
    return decode_image(io.BytesIO(data), name, as_bytes)

