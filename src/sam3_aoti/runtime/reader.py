"""One reader of a package: the file opened once, its zip directory read once, its metadata parsed once. The
integrity check, the loader and `info` all read through it, so what was checked is what loads. Imports no torch.

Whatever happens to the file after it was opened moves its ctime (a write into it, or a rename over its path,
which unlinks it): `check_unchanged` then raises PackageChanged, and `integrity.read_consistently` copies what is
open into this process's own folder (`private_copy`), checks the copy again and reads it from then on. A file
written within the last second, whose ctime could not show a second write in the same tick, is copied that way
from the start.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import struct
import tempfile
import time
import zipfile
import zlib
from pathlib import Path
from typing import Callable, TypeVar

from ..errors import PackageError
from .archive import METADATA_FILE, READ_LIMITS, VOCAB_FILE, archive_entries, parse_metadata, read_bounded
from .files import open_regular
from .scratch import process_folder

RACY_NS = 1_000_000_000  # a file changed this recently is hashed again next time
AOTI_PREFIX = "data/aotinductor/"
ZIP_ERRORS = (zipfile.BadZipFile, KeyError, OSError, EOFError, UnicodeDecodeError, zlib.error)
T = TypeVar("T")


class PackageChanged(PackageError):
    """The package file changed (written, or renamed over) after it was opened: read it again (`recheck`)."""


class PackageFile:
    """A package opened once, so that what is checked is what is read. `zip`, `entries`, `extra_files`,
    `metadata` and `built_for` are read the first time they are asked for and kept (until a private copy
    replaces the file); `check_unchanged` raises PackageChanged when the file changed since it was opened."""

    def __init__(self, path):
        self.path = Path(path)
        try:
            self.file = open_regular(self.path)
        except OSError as e:
            raise PackageError(f"{self.path} cannot be read ({e.strerror}): pass the .pt2 file the `package` "
                               "stage wrote") from None
        if self.file is None:
            raise PackageError(f"{self.path} is not a regular file (a folder, a FIFO or a device): pass the .pt2 "
                               "file the `package` stage wrote")
        self.opened = os.fstat(self.file.fileno())
        self.copied = self.copy_next = False
        self.checked_with: tuple = (False, None)  # check_package's trust and digest, for `recheck`
        self.verdict: str | None = None  # how check_package checked it, last
        self._read: dict = {}

    def __enter__(self) -> "PackageFile":
        return self

    def __exit__(self, *exc) -> None:
        self.file.close()

    @property
    def name(self) -> str:
        return self.path.name

    def truncated(self) -> PackageError:
        return PackageError(f"{self.path} is truncated or not a sam3-aoti package: rebuild it with "
                            "`uv run doit package`")

    def _once(self, key: str, read: Callable[[], T]) -> T:
        if key not in self._read:
            try:
                self._read[key] = read()
            except ZIP_ERRORS:
                raise self.truncated() from None
        return self._read[key]

    @property
    def zip(self) -> zipfile.ZipFile:
        """The archive, its directory read once, read through this open file."""
        return self._once("zip", lambda: zipfile.ZipFile(self.file))

    @property
    def infolist(self) -> list[zipfile.ZipInfo]:
        """Every entry as the zip directory lists it (names twice included), for the entry-name check."""
        return self._once("infolist", lambda: self.zip.infolist())

    @property
    def entries(self) -> dict[str, zipfile.ZipInfo]:
        """Each entry by its name inside the archive's root folder."""
        return self._once("entries", lambda: {inner: self.zip.getinfo(name)
                                              for inner, name in archive_entries(self.zip).items()})

    def read(self, inner: str, limit: int) -> bytes:
        """An entry's bytes, read only up to `limit` (the sizes a zip declares can lie)."""
        try:
            return read_bounded(self.zip, self.entries[inner].filename, limit)
        except ZIP_ERRORS:
            raise self.truncated() from None

    def copy_entry(self, inner: str, dst) -> None:
        """An entry's bytes into the open file `dst`. A stored entry of a package whose sha256 matched its digest is
        copied by the kernel, straight from the package's bytes (`copy_range`): a 1.6 GB weights blob read through
        zipfile costs a CRC pass and two copies through Python. Anything else goes through zipfile, CRC checked."""
        info = self.entries[inner]
        start = self.digest_matched and stored_data_offset(self.file, info)
        try:
            if start:
                copy_range(self.file.fileno(), dst.fileno(), start, info.file_size)
            else:
                with self.zip.open(info) as src:
                    shutil.copyfileobj(src, dst, 1 << 24)
        except (zipfile.BadZipFile, EOFError, zlib.error):  # a write's OSError (a full disk) is the caller's
            raise self.truncated() from None

    @property
    def extra_files(self) -> dict[str, str]:
        """The metadata and the vocabulary, by name, each read within its limit."""
        def read() -> dict[str, str]:
            if f"extra/{METADATA_FILE}" not in self.entries:
                raise KeyError(METADATA_FILE)
            return {name: self.read(f"extra/{name}", READ_LIMITS[name]).decode()
                    for name in (METADATA_FILE, VOCAB_FILE) if f"extra/{name}" in self.entries}
        return self._once("extra_files", read)

    @property
    def metadata(self) -> dict:
        """metadata.json, its fields' types checked (`archive.parse_metadata`)."""
        return self._once("metadata", lambda: parse_metadata(self.extra_files[METADATA_FILE], self.path))

    @property
    def built_for(self) -> dict[str, dict]:
        """Each AOTI model's build record (AOTI_DEVICE_KEY, AOTI_COMPUTE_CAPABILITY), by model name."""
        def read() -> dict[str, dict]:
            built = {}
            for inner in self.entries:
                if inner.startswith(AOTI_PREFIX) and inner.endswith(".wrapper_metadata.json"):
                    record = json.loads(self.read(inner, READ_LIMITS["wrapper_metadata.json"]))
                    built[inner.split("/")[2]] = record if isinstance(record, dict) else {}
            return built
        try:
            return self._once("built_for", read)
        except (ValueError, RecursionError):
            raise PackageError(f"{self.path}: a model's build record is not JSON: rebuild it with "
                               "`uv run doit package`") from None

    @property
    def digest_matched(self) -> bool:
        """Its bytes are the ones a digest vouches for (`check_package`'s verdict, "matches ...")."""
        return bool(self.verdict) and self.verdict.startswith("matches")

    @property
    def racy(self) -> bool:
        """Written within the last second: a second write in the same tick of the file's clock would not show."""
        return not self.copied and (self.copy_next or time.time_ns() - self.opened.st_ctime_ns < RACY_NS)

    def private_copy(self) -> str:
        """Copy the open file into this process's own folder (unlinked at once: only this open file reaches it),
        hashing the bytes copied; read the copy from now on. Returns their sha256."""
        fd, name = tempfile.mkstemp(suffix=".pt2", dir=process_folder())
        os.unlink(name)
        digest = hashlib.sha256()
        try:
            with os.fdopen(os.dup(fd), "wb") as copy:
                self.file.seek(0)
                while block := self.file.read(1 << 24):
                    digest.update(block)
                    copy.write(block)
        except OSError as e:
            os.close(fd)
            raise PackageError(f"cannot copy {self.path} into {process_folder()} to check it ({e.strerror}): free "
                               "space there, or set SAM3_AOTI_CACHE to a folder with room") from None
        self.file.close()
        self.file, self.copied, self._read = os.fdopen(fd, "rb"), True, {}
        self.opened = os.fstat(fd)
        return digest.hexdigest()

    def check_unchanged(self) -> None:
        """PackageChanged if the file changed since it was opened (its ctime moves on a write, and on a rename
        over its path)."""
        now = os.fstat(self.file.fileno())
        if (now.st_size, now.st_mtime_ns, now.st_ctime_ns) != (self.opened.st_size, self.opened.st_mtime_ns,
                                                                 self.opened.st_ctime_ns):
            raise PackageChanged(f"{self.path} changed while it loaded: load it again once whatever writes it "
                                 "is done")


LOCAL_HEADER = struct.Struct("<4s22xHH")  # a zip entry's local header: its signature, its name's and extra's lengths


def stored_data_offset(file, info: zipfile.ZipInfo) -> int | None:
    """Where an uncompressed, unencrypted entry's bytes start in the archive (after its local header, whose name
    must be the directory's), else None."""
    if info.compress_type != zipfile.ZIP_STORED or info.flag_bits & 0x1 or info.compress_size != info.file_size:
        return None
    header = os.pread(file.fileno(), LOCAL_HEADER.size, info.header_offset)
    if len(header) != LOCAL_HEADER.size:
        return None
    signature, name_length, extra_length = LOCAL_HEADER.unpack(header)
    name = os.pread(file.fileno(), name_length, info.header_offset + LOCAL_HEADER.size)
    encoding = "utf-8" if info.flag_bits & 0x800 else "cp437"
    if signature != zipfile.stringFileHeader or name != info.orig_filename.encode(encoding):
        return None
    return info.header_offset + LOCAL_HEADER.size + name_length + extra_length


def copy_range(src: int, dst: int, offset: int, count: int) -> None:
    """`count` bytes of the file `src` from `offset` appended to `dst`: copied in the kernel (copy_file_range, on
    Linux), else read and written in blocks; EOFError if `src` ends first."""
    kernel = getattr(os, "copy_file_range", None)
    while count:
        try:
            done = kernel(src, dst, count, offset) if kernel else _copy_block(src, dst, offset, count)
        except OSError as e:
            if kernel is None or e.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
                raise
            kernel = None  # another file system, or an old kernel: blocks
            continue
        if done == 0:
            raise EOFError(f"{count} bytes short")
        offset, count = offset + done, count - done


def _copy_block(src: int, dst: int, offset: int, count: int) -> int:
    block = os.pread(src, min(count, 1 << 24), offset)
    os.write(dst, block)  # a regular file takes a write whole
    return len(block)
