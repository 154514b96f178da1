"""The binary cache's storage: any URL fsspec opens (a local or NFS folder, `file://`, `s3://bucket/prefix` on
any S3-compatible store through s3fs, `https://` read-only through aiohttp). Writes are whole or absent: a
folder gets a temporary file renamed into place, an object store a single PUT (multipart for big files, which
the store makes visible only when complete). Downloads are checked against their sha256 before they are
renamed into place. S3 credentials and endpoint come from the usual places (AWS_ACCESS_KEY_ID,
AWS_SECRET_ACCESS_KEY, AWS_ENDPOINT_URL, ~/.aws).

Anyone who can write to a store can put anything in it, so a reader takes nothing on faith: records are read
bounded, a folder store's files only when they are regular files (a FIFO would hang the reader), every network
read has a time limit, and a failure is named for what it is (a folder or bucket that does not exist, a port
nothing answers on, a 403 or 500), never taken for a missing record."""

from __future__ import annotations

import hashlib
import os
import socket
import time
import uuid
from pathlib import Path

from ..errors import ConfigError, Sam3AotiError, first_line
from ..runtime.files import human_size, open_regular

MAX_RECORD_BYTES = 1 << 20  # entries and refs are small; anything bigger is not one
READ_ONLY = ("http", "https")
CHUNK = 1 << 23
CONNECT_TIMEOUT_S = 10  # a store that does not answer in this long is unreachable
READ_TIMEOUT_S = 60  # no byte for this long: the transfer has stalled
STALE_TEMPORARY_S = 3600  # a folder store's temporary file of another host untouched this long is a dead push's


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
    """Time limits on connecting and on every read. S3: botocore's own checksums only where the protocol requires
    them. Its default (since 1.36) checks a whole object's CRC against each ranged read, which S3-compatible
    stores fail; every download here is checked against its sha256 anyway."""
    protocol = url.split("://", 1)[0] if "://" in url else "file"
    if protocol in ("s3", "s3a"):
        return {"config_kwargs": {"request_checksum_calculation": "when_required",
                                  "response_checksum_validation": "when_required",
                                  "connect_timeout": CONNECT_TIMEOUT_S, "read_timeout": READ_TIMEOUT_S}}
    if protocol in READ_ONLY:
        import aiohttp

        return {"client_kwargs": {"timeout": aiohttp.ClientTimeout(total=None, connect=CONNECT_TIMEOUT_S,
                                                                   sock_read=READ_TIMEOUT_S)}}
    return {}


def true_cause(e: BaseException) -> BaseException | None:
    """What a FileNotFoundError hides, None where the file is really missing: fsspec's HTTP filesystem reports a
    403, a 500 or a closed port as FileNotFoundError, with the real error as its cause."""
    cause = e.__cause__
    if cause is None or isinstance(cause, FileNotFoundError) or getattr(cause, "status", None) == 404:
        return None
    return cause


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
        self.protocol = protocol
        self.local = protocol in ("file", "local")
        self.writable = protocol not in READ_ONLY
        self._root_seen = False

    def _path(self, rel: str) -> str:
        return f"{self.root}/{rel}"

    def _fail(self, what: str, rel: str, e: BaseException) -> StoreError:
        if isinstance(e, FileNotFoundError) and true_cause(e) is not None:
            e = true_cause(e)
        if "NoSuchBucket" in first_line(e):
            return StoreError(f"cache {self.url}: the bucket {self.root.split('/', 1)[0]} does not exist: make it, "
                              "or fix the URL")
        status = getattr(e, "status", None)
        reason = f"the server answered {status} {getattr(e, 'message', '')}".rstrip() if status else first_line(e)
        return StoreError(f"cache {self.url}: cannot {what} {rel} ({reason})")

    def _missing(self, rel: str, e: FileNotFoundError) -> None:
        """A record or blob that is not there: None to the caller, unless that is not what happened (the
        cache's folder or bucket does not exist, or the server said something else than 404)."""
        if true_cause(e) is not None:
            raise self._fail("read", rel, e) from None
        self.check_root()

    def check_root(self) -> None:
        """One line when the cache's folder or bucket does not exist: every record would look missing."""
        if self._root_seen or not self.writable:
            return
        where = self.root if self.local else self.root.split("/", 1)[0]
        try:
            exists = os.path.isdir(where) if self.local else self.fs.exists(where)
        except Exception as e:
            raise StoreError(f"cache {self.url}: cannot look up {where} ({first_line(e)})") from None
        if not exists:
            kind = "folder" if self.local else "bucket"
            raise StoreError(f"cache {self.url}: the {kind} {where} does not exist: make it, or fix the URL")
        self._root_seen = True

    def _open(self, rel: str, **options):
        """`rel` for reading; in a folder store only a regular file (a FIFO or a device is refused, not read)."""
        if not self.local:
            return self.fs.open(self._path(rel), "rb", **options)
        f = open_regular(self._path(rel))
        if f is None:
            raise StoreError(f"cache {self.url}: {rel} is not a regular file: refused")
        return f

    def read(self, rel: str) -> bytes | None:
        """A small record, or None where there is none."""
        try:
            with self._open(rel) as f:
                data = f.read(MAX_RECORD_BYTES + 1)
        except StoreError:
            raise
        except FileNotFoundError as e:
            return self._missing(rel, e)
        except Exception as e:  # fsspec backends raise their own (aiohttp, botocore) besides OSError
            raise self._fail("read", rel, e) from None
        if len(data) > MAX_RECORD_BYTES:
            raise StoreError(f"cache {self.url}: {rel} is over {human_size(MAX_RECORD_BYTES)}: not a record")
        return data

    def size(self, rel: str) -> int | None:
        try:
            info = self.fs.info(self._path(rel))
        except FileNotFoundError as e:  # a push asks: a folder store's missing folder is made by the first write
            if true_cause(e) is not None:
                raise self._fail("look up", rel, e) from None
            return None
        except Exception as e:
            raise self._fail("look up", rel, e) from None
        if info.get("type") not in (None, "file"):  # a folder store's FIFO, device or folder is no blob
            return None
        return int(info["size"])

    def write(self, rel: str, data: bytes) -> None:
        self._put(rel, "write", lambda path: self.fs.pipe_file(path, data))

    def upload(self, source: Path, rel: str, sha256: str | None = None) -> None:
        """`source` to `rel`; on S3 with its sha256 in the object's metadata, which `holds` compares."""
        extra = {"Metadata": {"sha256": sha256}} if sha256 and self.protocol in ("s3", "s3a") else {}
        self._put(rel, "upload", lambda path: self.fs.put_file(str(source), path, **extra))

    def _put(self, rel: str, what: str, put) -> None:
        """`put(path)` whole or not at all: into a folder through a temporary name renamed into place (two
        writers of one name: the last rename wins, each whole); to an object store straight, a PUT being whole.
        A temporary's name says which host and process writes it: `sweep_temporaries` removes a dead one's."""
        self._check_writable()
        if not self.local:  # a folder is made; a bucket is not
            self.check_root()
        tmp = self._path(f"{rel}.{temporary_tag()}.{uuid.uuid4().hex[:12]}.tmp") if self.local else None
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
        """Whether `rel` is there with this content, so that a blob damaged in place is replaced by the next
        push: re-hashed in a folder store; on S3 by the sha256 its upload put in the object's metadata (an
        object written by anything else, or before, has none: uploaded again); other stores by size."""
        if self.size(rel) != size:
            return False
        if self.protocol in ("s3", "s3a"):
            try:
                return self.fs.metadata(self._path(rel)).get("sha256") == sha256
            except Exception as e:
                raise self._fail("look up", rel, e) from None
        if not self.local:
            return True
        digest = hashlib.sha256()
        with self._open(rel) as f:
            while block := f.read(CHUNK):
                digest.update(block)
        return digest.hexdigest() == sha256

    def sweep_temporaries(self, older_than_s: float = STALE_TEMPORARY_S) -> list[str]:
        """Remove the temporary files of pushes that died (killed mid-upload) from a folder store: this host's
        whose process is gone, and any untouched for `older_than_s` (another host's). Object stores show no
        partial object (an unfinished multipart upload is the store's to expire: a lifecycle rule)."""
        from ..runtime.scratch import alive

        if not self.local or not os.path.isdir(self.root):
            return []
        removed, now, host = [], time.time(), temporary_tag().partition("~")[0]
        for folder, _, names in os.walk(self.root):
            for name in (n for n in names if n.endswith(".tmp")):
                path = os.path.join(folder, name)
                tag_host, _, owner = (name.rsplit(".", 3)[-3] if name.count(".") >= 3 else "").partition("~")
                try:
                    if (tag_host == host and not alive(owner)) or now - os.lstat(path).st_mtime > older_than_s:
                        os.unlink(path)
                        removed.append(os.path.relpath(path, self.root))
                except OSError:
                    pass  # removed by another sweeper, or not ours to remove
        return removed

    def download(self, rel: str, dest: Path, sha256: str, size: int, progress=None) -> None:
        """`rel` into `dest` whole and checked, or not at all: streamed into a temporary file beside `dest`,
        hashed on the way, renamed only when its size and sha256 are the ones the signed record names.
        `progress(bytes so far, size)` is called after every block."""
        dest = Path(dest)
        dest.parent.mkdir(parents=True, exist_ok=True)
        tmp = dest.parent / f".{dest.name}.{uuid.uuid4().hex[:8]}.part"
        digest, got = hashlib.sha256(), 0
        try:
            with self._open(rel, block_size=CHUNK) as src, open(tmp, "wb") as out:
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
        except FileNotFoundError as e:
            if true_cause(e) is not None:
                raise self._fail("download", rel, e) from None
            raise StoreError(f"cache {self.url}: {rel} is missing") from None
        except Exception as e:
            raise self._fail("download", rel, e) from None
        finally:
            tmp.unlink(missing_ok=True)

    def _check_writable(self) -> None:
        if not self.writable:
            raise ConfigError(f"cache {self.url} is read-only (https): push to a folder or s3:// instead")


def temporary_tag() -> str:
    """`<host>~<pid>-<start time>`: which host and process writes a folder store's temporary file."""
    from ..runtime.scratch import owner_tag

    return f"{socket.gethostname().replace('.', '_').replace('~', '_')}~{owner_tag()}"
