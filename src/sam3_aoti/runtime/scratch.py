"""The runtime's temporaries (a model's unpacked code, while it runs) live in a folder this package owns: one per
process under the user's cache, removed at exit, and swept by a later process once its owner is dead (a killed
service leaves nothing behind for long). Nothing is ever looked for by name in /tmp."""

from __future__ import annotations

import atexit
import functools
import os
import shutil
from pathlib import Path

from ..errors import PackageError


def cache_dir() -> Path:
    """$SAM3_AOTI_CACHE, else $XDG_CACHE_HOME/sam3-aoti, else ~/.cache/sam3-aoti."""
    if os.environ.get("SAM3_AOTI_CACHE"):
        return Path(os.environ["SAM3_AOTI_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "sam3-aoti"


def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (Linux), so that a reused pid is not its owner."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def owner_tag() -> str:
    """`<pid>-<start time>` of this process: what names a temporary it owns, so a later process can tell a dead
    owner's (`alive`)."""
    return f"{os.getpid()}-{_start_time(os.getpid()) or 'none'}"


def alive(owner: str) -> bool:
    """Whether the process an `owner_tag` names still runs (anything not such a tag counts as alive: left alone)."""
    pid, _, start = owner.partition("-")
    if not pid.isdigit():
        return True  # not one of ours: left alone
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return start in ("", "none") or _start_time(int(pid)) in (None, start)


def sweep(root: Path) -> list[Path]:
    """Remove the folders of processes that are gone; returns them."""
    gone = [p for p in root.iterdir() if p.is_dir() and not alive(p.name)] if root.is_dir() else []
    for folder in gone:
        shutil.rmtree(folder, ignore_errors=True)
    return gone


@functools.lru_cache(maxsize=1)
def process_folder() -> Path:
    """This process's own temporary folder, made on first use (dead owners' folders swept then)."""
    root = cache_dir() / "tmp"
    folder = root / owner_tag()
    try:
        root.mkdir(parents=True, exist_ok=True)
        sweep(root)
        folder.mkdir(exist_ok=True)
    except OSError as e:
        raise PackageError(f"cannot make the runtime's temporary folder {folder} ({e.strerror}): set "
                           "SAM3_AOTI_CACHE to a writable folder") from None
    atexit.register(shutil.rmtree, folder, True)
    return folder
