"""Files written whole or not at all, and their sha256: what the loader, the cache and the build share."""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import tempfile
from pathlib import Path


@contextlib.contextmanager
def atomic_output(target: Path):
    """Yield a temporary path beside `target`; rename it over `target` only if the block succeeds.

    An interrupted stage so never leaves a target that doit would take as up to date.
    Works for files and folders alike (the block decides what it writes at the path).
    """
    target = Path(target)
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp_dir = Path(tempfile.mkdtemp(prefix=f".{target.name}.", dir=target.parent))
    tmp = tmp_dir / target.name
    try:
        yield tmp
        if target.is_dir() and not target.is_symlink():
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp_dir, ignore_errors=True)


def write_text_atomic(target: Path, text: str) -> None:
    with atomic_output(target) as tmp:
        tmp.write_text(text)


def write_bytes_atomic(target: Path, data: bytes) -> None:
    with atomic_output(target) as tmp:
        tmp.write_bytes(data)


def open_regular(path: Path):
    """`path` opened for reading, only if it is a regular file (None where it is not: a FIFO, a socket, a device,
    a folder). Opened without blocking, so a FIFO put in a file's place cannot hang the reader; `OSError` where
    it cannot be opened."""
    import fcntl
    import stat

    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        return None
    fcntl.fcntl(fd, fcntl.F_SETFL, fcntl.fcntl(fd, fcntl.F_GETFL) & ~os.O_NONBLOCK)
    return os.fdopen(fd, "rb")


def sha256(path: Path) -> str:
    with open(path, "rb") as f:
        return stream_sha256(f)


_hashed: dict = {}


def sha256_once(path: Path) -> str:
    """A file's sha256, read once per process and state of the file (inode, size, mtime, ctime: any write moves
    the ctime), for a build that records the digest it just wrote (a GB package is not read twice)."""
    stat = Path(path).stat()
    state = (str(path), stat.st_ino, stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns)
    if state not in _hashed:
        _hashed[state] = sha256(path)
    return _hashed[state]


def stream_sha256(f, chunk: int = 1 << 24) -> str:
    """sha256 of a binary stream (a file, a zip entry), read in chunks."""
    h = hashlib.sha256()
    while block := f.read(chunk):
        h.update(block)
    return h.hexdigest()


def human_size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024
    return f"{n:.1f} GB"
