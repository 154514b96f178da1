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


def without_bytecode(module: str) -> Path | None:
    """The folder of an installed `module` whose sources have no bytecode where Python writes none either
    (PYTHONDONTWRITEBYTECODE, as some images set, or a folder it cannot write): every new process then compiles them
    as it imports them. For torch on a GPU machine that was 3.2-3.6 s an import against 1.4-1.7 s with its bytecode
    (benchmarks/h100-2026-12-07-bytecode/), paid by each stage and each Ray worker. None where the bytecode is there
    or the first import writes it; `module` is found, not imported."""
    import importlib.util
    import sys

    spec = importlib.util.find_spec(module)
    if spec is None or not (spec.origin or "").endswith(".py"):
        return None
    if os.path.exists(importlib.util.cache_from_source(spec.origin)):
        return None
    folder = Path(spec.origin).parent
    cache = folder / "__pycache__"
    if not sys.dont_write_bytecode and os.access(cache if cache.exists() else folder, os.W_OK):
        return None
    return folder


def bytecode_advice(module: str) -> str | None:
    """One line for a user whose `module` is compiled by every process (`without_bytecode`), with the fix."""
    folder = without_bytecode(module)
    if folder is None:
        return None
    return (f"{module} in {folder} has no bytecode and Python writes none here: every process compiles it as it "
            f"imports it (seconds each); compile it once: python -m compileall -q -j 0 {folder.parent}")
