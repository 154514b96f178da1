"""Is this the package its build wrote? Checked before any shared object in it is loaded: a .pt2 holds native
code, and loading a package runs it. Imports no torch.

Two records, written by the `package` stage: `sam3.pt2.sha256` beside the archive (the whole file, in
`sha256sum` format) and, inside the metadata, the sha256 of every compiled part (code and weights), for a
package that travels without its digest file.

Hashing 1.7 GB costs about a second, as much as loading it. A check that passed is remembered the way git's index
remembers a clean file: by the file's identity and change times (device, inode, size, mtime and ctime, in
nanoseconds; ctime moves on every write and cannot be set back), so a service's next start skips the hash until
the file changes. As in git, a file changed within the last second is never remembered: file times tick coarsely,
and a write in the same tick would leave them as they were. The record lives in the user's cache
($SAM3_AOTI_CACHE, else $XDG_CACHE_HOME/sam3-aoti, else ~/.cache/sam3-aoti); where it cannot be written, every
load hashes.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
import zipfile
from pathlib import Path

from ..errors import PackageError
from .archive import archive_entries
from .files import sha256, stream_sha256, write_text_atomic

AOTI_PREFIX = "data/aotinductor/"
KEEP_RECORDS = 256  # remembered checks; the oldest go first
RACY_NS = 1_000_000_000  # a file changed this recently is hashed again next time


def cache_dir() -> Path:
    if os.environ.get("SAM3_AOTI_CACHE"):
        return Path(os.environ["SAM3_AOTI_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "sam3-aoti"


def _check_record(package: Path, how: str) -> Path:
    """Where a passed check of this very file (same inode, size, mtime and ctime) and digest is remembered."""
    st = package.stat()
    key = f"{package.resolve()}|{st.st_dev}|{st.st_ino}|{st.st_size}|{st.st_mtime_ns}|{st.st_ctime_ns}|{how}"
    return cache_dir() / "verified" / hashlib.sha256(key.encode()).hexdigest()


def _remember(package: Path, record: Path) -> None:
    try:
        if time.time_ns() - package.stat().st_ctime_ns < RACY_NS:
            return
        record.parent.mkdir(parents=True, exist_ok=True)
        record.touch()
        old = sorted(record.parent.iterdir(), key=lambda p: p.stat().st_mtime_ns)[:-KEEP_RECORDS]
        for path in old:
            path.unlink(missing_ok=True)
    except OSError:
        pass  # a read-only home: every load hashes


def digest_file(package: Path) -> Path:
    package = Path(package)
    return package.with_name(f"{package.name}.sha256")


def write_digest(package: Path) -> None:
    write_text_atomic(digest_file(package), f"{sha256(package)}  {Path(package).name}\n")


def check_package(package: Path, trust: bool = False) -> str:
    """Raise a one-line PackageError unless the archive is what its build recorded; returns how it was
    checked. `trust` loads a package that carries no digest at all (never one that mismatches)."""
    package = Path(package)
    recorded = digest_file(package)
    if recorded.is_file():
        digest = (recorded.read_text().split() or [""])[0]
        record = _check_record(package, digest)
        if record.is_file():
            return f"matches {recorded.name} (checked before; file unchanged since)"
        if sha256(package) != digest:
            raise PackageError(f"{package} does not match its digest {recorded.name}: it was modified or damaged "
                               "since it was built; rebuild it (`uv run doit package`) or fetch it again")
        _remember(package, record)
        return f"matches {recorded.name}"
    try:
        record = _check_record(package, "parts")
    except OSError:
        raise PackageError(f"{package} does not exist or cannot be read") from None
    if record.is_file():
        return "parts match the metadata's digests (checked before; file unchanged since)"
    try:
        with zipfile.ZipFile(package) as archive:
            entries = archive_entries(archive)
            metadata = json.loads(archive.read(entries["extra/metadata.json"]))
            parts = metadata.get("parts_sha256")
            if not parts:
                if trust:
                    return "no digest (trusted)"
                raise PackageError(f"{package} carries no digest ({recorded.name} beside it, or parts_sha256 in its "
                                   "metadata): load it only if you vouch for it (--trust / trust=True)")
            code = [name for name in entries if name.startswith(AOTI_PREFIX)]
            for name in code:
                if name not in parts:
                    raise PackageError(f"{package} holds {name}, which its build did not write: refusing to load it")
                with archive.open(entries[name]) as part:
                    digest = stream_sha256(part)
                if digest != parts[name]:
                    raise PackageError(f"{package}: {name} does not match its recorded digest: the package was "
                                       "modified; rebuild it (`uv run doit package`) or fetch it again")
            missing = sorted(set(parts) - set(code))
            if missing:
                raise PackageError(f"{package} lacks {missing[0]}, which its build wrote: rebuild it")
    except (zipfile.BadZipFile, KeyError, OSError, EOFError, ValueError):
        raise PackageError(f"{package} is truncated or not a sam3-aoti package: rebuild it with `uv run doit package`") from None
    _remember(package, record)
    return "parts match the metadata's digests"
