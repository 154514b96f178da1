"""The binary cache's storage: any URL fsspec opens (a local or NFS folder, `file://`, `s3://bucket/prefix` on
any S3-compatible store through s3fs, `https://` read-only through aiohttp). Writes are whole or absent: a
folder gets a temporary file renamed into place, an object store a single PUT (multipart for big files, which
the store makes visible only when complete). Downloads are checked against their sha256 before they are
renamed into place. S3 credentials and endpoint come from the usual places (AWS_ACCESS_KEY_ID,
AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL, ~/.aws)."""

from __future__ import annotations

import hashlib
import os
import uuid
from pathlib import Path

from ..errors import ConfigError, Sam3AotiError, first_line
from .files import human_size

MAX_RECORD_BYTES = 1 << 20  # entries and refs are small; anything bigger is not one
READ_ONLY = ("http", "https")
CHUNK = 1 << 23


class StoreError(Sam3AotiError):
    """The cache could not be read or written (unreachable, denied, a file missing or cut short)."""


def cache_extra(module: str):
    """A module of the `cache` extra, or the one-line error that says how to install it."""
    import importlib

    try:
        return importlib.import_module(module)
    except ImportError:
        raise ConfigError("the binary cache needs the `cache` extra: pip install 'sam3-aoti[cache]'") from None


def _options(url: str) -> dict:
    """S3: botocore's own checksums only where the protocol requires them. Its default (since 1.36) checks a
    whole object's CRC against each ranged read, which S3-compatible stores fail; every download here is checked
    against its sha256 anyway."""
    if url.split("://", 1)[0] in ("s3", "s3a"):
        return {"config_kwargs": {"request_checksum_calculation": "when_required",
                                  "response_checksum_validation": "when_required"}}
    return {}


class Store:
    def __init__(self, url: str):
        self.url = str(url).rstrip("/")
        try:
            # a filesystem of its own: fsspec's shared instances would keep an endpoint the environment has changed
            self.fs, self.root = cache_extra("fsspec").core.url_to_fs(self.url, skip_instance_cache=True, **_options(self.url))
        except ImportError as e:  # a known protocol whose backend is not installed (s3fs, aiohttp)
            raise ConfigError(f"cache {url}: {first_line(e)}: pip install 'sam3-aoti[cache]'") from None
        except ValueError as e:  # an unknown protocol
            raise ConfigError(f"cache {url}: {first_line(e)} (use a folder, file://, s3:// or https://)") from None
        protocol = self.fs.protocol if isinstance(self.fs.protocol, str) else self.fs.protocol[0]
        self.local = protocol in ("file", "local")
        self.writable = protocol not in READ_ONLY

    def _path(self, rel: str) -> str:
        return f"{self.root}/{rel}"

    def _fail(self, what: str, rel: str, e: BaseException) -> StoreError:
        return StoreError(f"cache {self.url}: cannot {what} {rel} ({first_line(e)})")

    def read(self, rel: str) -> bytes | None:
        """A small record, or None where there is none."""
        try:
            with self.fs.open(self._path(rel), "rb") as f:
                data = f.read(MAX_RECORD_BYTES + 1)
        except FileNotFoundError:
            return None
        except Exception as e:  # fsspec backends raise their own (aiohttp, botocore) besides OSError
            raise self._fail("read", rel, e) from None
        if len(data) > MAX_RECORD_BYTES:
            raise StoreError(f"cache {self.url}: {rel} is over {human_size(MAX_RECORD_BYTES)}: not a record")
        return data

    def size(self, rel: str) -> int | None:
        try:
            return int(self.fs.info(self._path(rel))["size"])
        except FileNotFoundError:
            return None
        except Exception as e:
            raise self._fail("look up", rel, e) from None

    def write(self, rel: str, data: bytes) -> None:
        self._put(rel, "write", lambda path: self.fs.pipe_file(path, data))

    def upload(self, source: Path, rel: str) -> None:
        self._put(rel, "upload", lambda path: self.fs.put_file(str(source), path))

    def _put(self, rel: str, what: str, put) -> None:
        """`put(path)` whole or not at all: into a folder through a temporary name renamed into place (two
        writers of one name: the last rename wins, each whole); to an object store straight, a PUT being whole."""
        self._check_writable()
        tmp = self._path(f"{rel}.{uuid.uuid4().hex[:12]}.tmp") if self.local else None
        try:
            if tmp:
                os.makedirs(os.path.dirname(tmp), exist_ok=True)
                put(tmp)
                with open(tmp, "rb") as f:
                    os.fsync(f.fileno())  # on disk before its name is
                os.replace(tmp, self._path(rel))
            else:
                put(self._path(rel))
        except Exception as e:
            raise self._fail(what, rel, e) from None
        finally:
            if tmp and os.path.exists(tmp):  # a failed write (disk full, denied) leaves no debris
                os.unlink(tmp)

    def holds(self, rel: str, sha256: str, size: int) -> bool:
        """Whether `rel` is there with this content: re-hashed in a folder store (a blob damaged in place is
        then replaced by the next push); an object store's object by its size."""
        if self.size(rel) != size:
            return False
        if not self.local:
            return True
        digest = hashlib.sha256()
        with open(self._path(rel), "rb") as f:
            while block := f.read(CHUNK):
                digest.update(block)
        return digest.hexdigest() == sha256

    def download(self, rel: str, dest: Path, sha256: str, size: int, progress=None) -> None:
        """`rel` into `dest` whole and checked, or not at all: streamed into a temporary file beside `dest`,
        hashed on the way, renamed only when its size and sha256 are the ones the signed record names.
        `progress(bytes so far, size)` is called after every block."""
        dest = Path(dest)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.parent / f".{dest.name}.{uuid.uuid4().hex[:8]}.part"
        digest, got = hashlib.sha256(), 0
        try:
            with self.fs.open(self._path(rel), "rb", block_size=CHUNK) as src, open(tmp, "wb") as out:
                while block := src.read(CHUNK):
                    got += len(block)
                    if got > size:
                        break
                    digest.update(block)
                    out.write(block)
                    if progress:
                        progress(got, size)
            if got != size:
                raise StoreError(f"cache {self.url}: {rel} has {'more' if got > size else got} bytes, its record "
                                 f"names {size}: refused")
            if digest.hexdigest() != sha256:
                raise StoreError(f"cache {self.url}: {rel} does not match its sha256 (altered or damaged): refused")
            os.replace(tmp, dest)
        except StoreError:
            raise
        except FileNotFoundError:
            raise StoreError(f"cache {self.url}: {rel} is missing") from None
        except Exception as e:
            raise self._fail("download", rel, e) from None
        finally:
            tmp.unlink(missing_ok=True)

    def _check_writable(self) -> None:
        if not self.writable:
            raise ConfigError(f"cache {self.url} is read-only (https): push to a folder or s3:// instead")
