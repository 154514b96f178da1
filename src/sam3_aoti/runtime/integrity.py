"""Is this the package the user vouches for? Checked before torch's loader opens the archive: a .pt2 holds
native code, and loading a package runs it. Imports no torch.

Trust comes from outside the archive: its sha256 against the `sam3.pt2.sha256` file beside it (`sha256sum`
format, written by the `package` stage and fetched with the package) or a digest the caller passes; without
either, only `trust=True` (`--trust`) loads it. The metadata's own part digests prove nothing about who made
the archive (a crafted one recomputes them): they only catch damage in a trusted package. Every entry name is
checked first, whatever the trust: no path out of the archive's folder, no link, only what a package holds.

Hashing 1.7 GB costs about a second, as much as loading it. A check that passed is remembered the way git's index
remembers a clean file: by the file's identity and change times (device, inode, size, mtime and ctime, in
nanoseconds; ctime moves on every write and cannot be set back), so a service's next start skips the hash until
the file changes. As in git, a file changed within the last second is never remembered: file times tick coarsely,
and a write in the same tick would leave them as they were. The record lives in the user's cache
($SAM3_AOTI_CACHE, else $XDG_CACHE_HOME/sam3-aoti, else ~/.cache/sam3-aoti); where it cannot be written, every
load hashes.

What is checked is what loads: the package is opened once (`reader.PackageFile`), hashed through that open file,
and read through it after (entries, metadata, the models' code), so a file renamed over the path in between is
never read; a change after it was opened is read again from a checked private copy (`reader`).
"""

from __future__ import annotations

import hashlib
import re
import stat
import time
from pathlib import Path
from typing import Callable, TypeVar

from ..errors import PackageError
from .archive import MODEL_NAMES, PART_NAMES
from .files import open_regular, sha256_once, stream_sha256, write_text_atomic
from .reader import AOTI_PREFIX, RACY_NS, ZIP_ERRORS, PackageChanged, PackageFile
from .scratch import cache_dir

KEEP_RECORDS = 256  # remembered checks; the oldest go first
T = TypeVar("T")


def recheck(package: PackageFile) -> str:
    """After PackageChanged: what is open, copied into this process's own folder and checked again as
    `check_package` checked it (the digest against the copy's bytes); read the copy from now on."""
    package.copy_next = True
    return check_package(package, *package.checked_with)


def read_consistently(package: PackageFile, read: Callable[[PackageFile], T]) -> T:
    """`read(package)` of a file that did not change meanwhile: once more, from a checked private copy of what
    was open, if it did (a second change is PackageChanged)."""
    try:
        result = read(package)
        package.check_unchanged()
        return result
    except PackageChanged:
        recheck(package)
        result = read(package)
        package.check_unchanged()
        return result


def hash_of(package: PackageFile) -> str:
    package.file.seek(0)
    return stream_sha256(package.file)


def _check_record(package: PackageFile, how: str) -> Path:
    """Where a passed check of this very file (same inode, size, mtime and ctime) and digest is remembered."""
    st = package.opened
    key = f"{package.path.resolve()}|{st.st_dev}|{st.st_ino}|{st.st_size}|{st.st_mtime_ns}|{st.st_ctime_ns}|{how}"
    return cache_dir() / "verified" / hashlib.sha256(key.encode()).hexdigest()


def _remember(package: PackageFile, record: Path) -> None:
    try:
        if package.copied or time.time_ns() - package.opened.st_ctime_ns < RACY_NS:
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
    write_text_atomic(digest_file(package), f"{sha256_once(package)}  {Path(package).name}\n")


# What a package (or its exported-program fallback) may hold, by name inside its root folder: nothing else
# reaches torch's loader, which unpacks entries by name and loads the shared objects among them.
SAFE_NAME = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.\-]*$")
_MODELS = "(" + "|".join(MODEL_NAMES + PART_NAMES) + ")"
PACKAGE_ENTRIES = (r"archive_format", r"archive_version", r"byteorder", r"\.data/version", r"\.data/serialization_id",
                   rf"data/aotinductor/{_MODELS}/[A-Za-z0-9_][A-Za-z0-9_.\-]*",
                   r"extra/metadata\.json", r"extra/tokenizer/bpe_simple_vocab_16e6\.txt",
                   # the exported programs (the fallback archive)
                   rf"models/{_MODELS}\.json", r"data/(weights|constants)/[A-Za-z0-9_.\-]+",
                   rf"data/sample_inputs/{_MODELS}\.pt")
KNOWN_ENTRY = re.compile("^(" + "|".join(PACKAGE_ENTRIES) + ")$")


def check_entries(package: Path | PackageFile) -> None:
    """Every entry of the archive is a plain file a package has, under one root folder: no absolute path, no
    `..`, no link, no device, no name twice. Checked before torch's loader sees the archive: it unpacks by name."""
    if not isinstance(package, PackageFile):
        with PackageFile(package) as opened:
            return check_entries(opened)
    package_path = package.path
    infos = package.infolist
    roots, seen = set(), set()
    for info in infos:
        name = info.filename
        root, _, inner = name.partition("/")
        kind = stat.S_IFMT(info.external_attr >> 16) if info.create_system == 3 else 0  # 0: no type recorded
        if (name.startswith("/") or "\\" in name or not SAFE_NAME.match(root) or not KNOWN_ENTRY.match(inner)
                or ".." in name.split("/") or kind not in (0, stat.S_IFREG) or name in seen):
            raise PackageError(f"{package_path} holds the entry {name!r}, which no sam3-aoti package has (a path out of "
                               "its folder, a link, or a file its build does not write): refusing to open it")
        roots.add(root)
        seen.add(name)
    if len(roots) != 1:
        raise PackageError(f"{package_path} has {len(roots)} root folders ({', '.join(sorted(roots)[:3])}), a package has "
                           "one: refusing to open it")


def normalize_digest(digest: str) -> str:
    digest = digest.strip().lower()
    if not re.fullmatch(r"[0-9a-f]{64}", digest):
        raise PackageError(f"sha256 {digest!r} is not a sha256 (64 hex digits): pass the digest of the package")
    return digest


def check_package(package: Path | PackageFile, trust: bool = False, digest: str | None = None) -> str:
    """Raise a one-line PackageError unless the archive is the one the user vouches for; returns how it was
    checked. A package is native code, and nothing it says about itself proves who made it: it loads when its
    sha256 equals a digest obtained beside or before it (`digest`, else the `.sha256` file beside it), or when
    the user trusts it (`trust`; its parts are then still checked against the metadata, to catch damage).
    Every entry name is checked first (`check_entries`), trusted or not. Pass a `PackageFile` to read the
    package after through the very file that was checked."""
    if not isinstance(package, PackageFile):
        with PackageFile(package) as opened:
            return check_package(opened, trust, digest)
    package.checked_with = (trust, digest)
    package.verdict = None
    package.verdict = _verdict(package, trust, digest)
    return package.verdict


def _verdict(package: PackageFile, trust: bool, digest: str | None) -> str:
    check_entries(package)
    recorded = digest_file(package.path)
    digest_passed = digest is not None
    source = "the digest passed in" if digest else recorded.name
    if digest is None and recorded.exists():
        digest = read_digest_file(recorded)
    if digest is not None:
        digest = normalize_digest(digest)
        record = None if package.racy else _check_record(package, digest)
        if record is not None and record.is_file():
            return f"matches {source} (checked before; file unchanged since)"
        if record is None:
            actual = package.private_copy()
            check_entries(package)  # the copy's, as the loader will read them
        else:
            actual = hash_of(package)
        if actual != digest:
            against = source if digest_passed else f"its digest {source}"
            raise PackageError(f"{package.path} does not match {against}: it was modified or damaged since it was "
                               "built; rebuild it (`uv run doit package`) or fetch it again")
        if record is not None:
            _remember(package, record)
        return f"matches {source}"
    if not trust:
        raise PackageError(f"{package.path} has no digest beside it ({recorded.name}) and none was passed: a package "
                           "is native code and a digest inside it proves nothing; fetch its .sha256 with it, pass "
                           "--sha256 (sha256=...), or --trust (trust=True) if you vouch for it")
    if package.racy:
        package.private_copy()
        check_entries(package)
    _check_parts(package)
    return "no digest: trusted (--trust); parts match the metadata's digests"


def read_digest_file(recorded: Path) -> str:
    """The digest in a `sha256sum` file (its first word), read only if it is a small regular file."""
    try:
        with open_regular(recorded) or _not_regular(recorded) as f:
            text = f.read(4096).decode()
    except (OSError, UnicodeDecodeError):
        raise PackageError(f"{recorded} cannot be read: fetch the package's digest file again") from None
    return (text.split() or [""])[0]


def _not_regular(path: Path):
    raise PackageError(f"{path} is not a regular file: fetch the package's digest file again")


def _check_parts(package: PackageFile) -> None:
    """A trusted package's parts against its metadata's digests: damage, not authenticity."""
    path, entries = package.path, package.entries
    parts = package.metadata.get("parts_sha256") or {}
    code = [name for name in entries if name.startswith(AOTI_PREFIX)]
    for name in code:
        if name not in parts:
            if not parts:
                return  # an older build without part digests: nothing to compare
            raise PackageError(f"{path} holds {name}, which its build did not write: refusing to load it")
        try:
            with package.zip.open(entries[name]) as part:
                digest = stream_sha256(part)
        except ZIP_ERRORS:
            raise package.truncated() from None
        if digest != parts[name]:
            raise PackageError(f"{path}: {name} does not match its recorded digest: the package was "
                               "modified; rebuild it (`uv run doit package`) or fetch it again")
    missing = sorted(set(parts) - set(code))
    if missing:
        raise PackageError(f"{path} lacks {missing[0]}, which its build wrote: rebuild it")
