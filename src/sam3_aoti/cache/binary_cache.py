"""The binary cache, Nix's substituter model on any `store.Store`:

    blobs/sha256/<2>/<sha256>     file contents, named by their sha256
    entries/<stage>/<key>.json    a stage's outputs for one input-addressed key: path -> sha256, size; signed
    refs/<name>.json              a name (sam3-bf16-cuda@NVIDIA-H200) -> a verified package; signed

A record is signed (ed25519, `signing`) over its canonical JSON, so its signature covers the key or name it
answers for, every output's sha256 and what the builder said about it. Blobs go up before the record that
names them, so a reader never sees a half push; a reader takes a record only when a trusted key signed it,
and a blob only when its sha256 is the record's. Two builders pushing one key both write whole records of
whole blobs: the last one wins, and either is valid.
"""

from __future__ import annotations

import fcntl
import json
import os
import platform
import re
import shutil
import tempfile
import time
from pathlib import Path, PurePosixPath

from ..errors import InputError, Sam3AotiError
from ..runtime.files import human_size, sha256, write_text_atomic
from ..runtime.scratch import alive, cache_dir, owner_tag
from .signing import KEY_NAME, SecretKey, PublicKey, TrustError, signer
from .store import Store, StoreError

ENTRY_FORMAT = "sam3-aoti-entry/1"
REF_FORMAT = "sam3-aoti-ref/1"
# What a ref hands a node: the package, its digest (what load_package checks) and the verify report.
REF_FILES = ("sam3.pt2", "sam3.pt2.sha256", "report.json")


class Refused(Sam3AotiError):
    """A record or blob the cache offered that is not taken (why in the message); the caller builds instead."""


def canonical(record: dict) -> bytes:
    """The bytes a signature covers: the record without its signatures, keys sorted, no spaces."""
    body = {k: v for k, v in record.items() if k != "signatures"}
    return json.dumps(body, sort_keys=True, separators=(",", ":")).encode()


def blob_path(digest: str) -> str:
    return f"blobs/sha256/{digest[:2]}/{digest}"


def entry_path(stage: str, key: str) -> str:
    return f"entries/{stage}/{key}.json"


MAX_REF_NAME = 128
# The fields a reader uses and the JSON type each must have; checked before any is used (anyone who can
# write to the store can write a record, signed or not)
RECORD_FIELDS = {"format": str, "stage": str, "key": str, "name": str, "signatures": list, "outputs": dict,
                 "info": dict, "built_by": dict, "issued_ns": int}
RECORD_FIELD_NAMES = {str: "a string", list: "a list", dict: "an object", int: "an integer"}


def check_ref_name(name: str) -> str:
    """A ref's name as a store path allows it: letters, digits and . _ @ + -, no `..`, at most MAX_REF_NAME."""
    if not isinstance(name, str) or not KEY_NAME.match(name) or ".." in name or len(name) > MAX_REF_NAME:
        shown = name if len(str(name)) <= 40 else f"{str(name)[:40]}... ({len(name)} characters)"
        raise InputError(f"ref {shown!r}: use up to {MAX_REF_NAME} letters, digits and . _ @ + - (no slash, space or "
                         "`..`), e.g. sam3-bf16-cuda@NVIDIA-H200")
    return name


def ref_path(name: str) -> str:
    return f"refs/{check_ref_name(name)}.json"


def builder() -> dict:
    return {"host": platform.node(), "time": time.strftime("%Y-%m-%dT%H:%M:%S%z")}


def safe_relative(rel: str) -> bool:
    """A relative path with no way out of the folder it lands in."""
    path = PurePosixPath(rel)
    return bool(rel) and not path.is_absolute() and ".." not in path.parts and "\\" not in rel and path.parts[0] != ""


class Cache:
    """One cache URL, the keys its records must be signed by, and (to push) the key that signs."""

    def __init__(self, url: str, trusted: dict[str, PublicKey], secret: SecretKey | None = None):
        self.store, self.trusted, self.secret = Store(url), trusted, secret
        self.url = self.store.url

    def _take(self, rel: str, fmt: str, answers: dict) -> tuple[dict, str] | None:
        """The signed record at `rel` and its signer, None where there is none; Refused when it is not one
        a trusted key signed for exactly what was asked (`answers`: the fields it must hold)."""
        data = self.store.read(rel)
        if data is None:
            return None
        try:
            record = json.loads(data)
            if not isinstance(record, dict) or record.get("format") != fmt:
                raise ValueError
        except (ValueError, RecursionError):
            raise Refused(f"{rel} in {self.url} is not a {fmt} record: refused") from None
        for field, kind in RECORD_FIELDS.items():
            if field in record and not isinstance(record[field], kind):
                raise Refused(f"{rel} in {self.url}: its field `{field}` is not {RECORD_FIELD_NAMES[kind]}: refused")
        if not all(isinstance(s, str) for s in record.get("signatures", [])):
            raise Refused(f"{rel} in {self.url}: its signatures are not strings: refused")
        try:
            name = signer(record.get("signatures") or [], canonical(record), self.trusted)
        except TrustError as e:
            raise Refused(f"{rel} in {self.url}: {e}: refused") from None
        for field, value in answers.items():
            if record.get(field) != value:
                raise Refused(f"{rel} in {self.url} is signed for {field} {record.get(field)!r}, not {value!r}: refused")
        outputs = record.get("outputs")
        if not isinstance(outputs, dict) or not all(
                safe_relative(rel_out) and isinstance(o, dict) and re.fullmatch(r"[0-9a-f]{64}", str(o.get("sha256")))
                and isinstance(o.get("bytes"), int) and o["bytes"] >= 0 for rel_out, o in outputs.items()):
            raise Refused(f"{rel} in {self.url} names outputs that are not relative paths with a sha256: refused")
        return record, name

    def entry(self, stage: str, key: str) -> tuple[dict, str] | None:
        return self._take(entry_path(stage, key), ENTRY_FORMAT, {"stage": stage, "key": key})

    def ref(self, name: str) -> tuple[dict, str] | None:
        return self._take(ref_path(name), REF_FORMAT, {"name": name})

    def fetch(self, record: dict, dest: Path, units: list[str], progress=None) -> list[Path]:
        """Every output of `record` under `dest`, each of `units` (files or folders, relative to `dest`) put in
        place whole only after all of them arrived checked. An output outside `units` is refused."""
        outputs = record["outputs"]
        for rel in outputs:
            if not any(rel == u or rel.startswith(u + "/") for u in units):
                raise Refused(f"the record names {rel}, which is not an output of this stage: refused")
        missing = [u for u in units if not any(rel == u or rel.startswith(u + "/") for rel in outputs)]
        if missing:
            raise Refused(f"the record lacks {missing[0]}: refused")
        dest.mkdir(parents=True, exist_ok=True)
        sweep_staging(dest)
        staging = Path(tempfile.mkdtemp(prefix=f".substitute.{owner_tag()}.", dir=dest))  # a dead one's: swept
        try:
            for rel, out in sorted(outputs.items()):
                try:
                    self.store.download(blob_path(out["sha256"]), staging / rel, out["sha256"], out["bytes"],
                                        _every(5.0, rel, progress))
                    if out.get("executable") is True:
                        (staging / rel).chmod(0o755)
                except StoreError as e:
                    raise Refused(f"{rel}: {e}") from None
            for unit in units:
                target = dest / unit
                if target.is_dir() and not target.is_symlink():
                    shutil.rmtree(target)
                target.parent.mkdir(parents=True, exist_ok=True)
                os.replace(staging / unit, target)
        finally:
            shutil.rmtree(staging, ignore_errors=True)
        return [dest / u for u in units]

    def push_files(self, files: dict[str, Path], progress=None) -> dict:
        """Upload every file not already in the store (content-addressed: present means done); the outputs map.
        A folder store's temporaries of pushes that died are removed first."""
        self.store.sweep_temporaries()
        outputs, last = {}, time.monotonic()
        for rel, path in sorted(files.items()):
            digest, size = sha256(path), path.stat().st_size
            outputs[rel] = {"sha256": digest, "bytes": size}
            if path.stat().st_mode & 0o111:
                outputs[rel]["executable"] = True  # a compiled .so comes back as it was built
            if not self.store.holds(blob_path(digest), digest, size):
                if progress and (size > 1 << 28 or time.monotonic() - last > 5):
                    progress(f"uploading {rel} ({size / 2**20:.0f} MB)")
                    last = time.monotonic()
                self.store.upload(path, blob_path(digest), digest)
        return outputs

    def _sign(self, record: dict) -> bytes:
        if self.secret is None:
            raise Sam3AotiError("pushing needs a signing key: set SAM3_AOTI_SIGNING_KEY to a file that "
                                "`sam3-aoti cache keygen` wrote")
        record["signatures"] = [self.secret.sign(canonical(record))]
        return (json.dumps(record, indent=2, sort_keys=True) + "\n").encode()

    def push_entry(self, stage: str, key: str, files: dict[str, Path], info: dict, progress=None) -> dict:
        outputs = self.push_files(files, progress)  # blobs first: the entry is written last
        record = {"format": ENTRY_FORMAT, "stage": stage, "key": key, "outputs": outputs, "info": info,
                  "built_by": builder()}
        self.store.write(entry_path(stage, key), self._sign(record))
        return record

    def push_ref(self, name: str, files: dict[str, Path], info: dict, progress=None) -> dict:
        """A ref, signed with the time it is issued (`issued_ns`): a node refuses one older than it pulled before."""
        outputs = self.push_files(files, progress)
        record = {"format": REF_FORMAT, "name": name, "outputs": outputs, "info": info, "built_by": builder(),
                  "issued_ns": time.time_ns()}
        self.store.write(ref_path(name), self._sign(record))
        return record


def _every(seconds: float, name: str, progress):
    """A download's per-block callback that says how far it got, at most every `seconds`."""
    if progress is None:
        return None
    last = [time.monotonic()]

    def report(got: int, size: int) -> None:
        if time.monotonic() - last[0] > seconds:
            progress(f"{name}: {human_size(got)} of {human_size(size)}")
            last[0] = time.monotonic()
    return report


def check_destination(dest: Path) -> None:
    """`pull`'s DEST is a folder it can write (made if missing), checked before anything is fetched."""
    import os

    if dest.exists() and not dest.is_dir():
        raise InputError(f"{dest} is a file: pull into a folder (it is made if missing)")
    try:
        dest.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise InputError(f"cannot make {dest} ({e.strerror or e}): pull into a folder you can write") from None
    if not os.access(dest, os.W_OK | os.X_OK):
        raise InputError(f"{dest} is not writable: pull into a folder you can write")


def sweep_staging(dest: Path) -> None:
    """Remove the staging folders a killed fetch (a pull, a substitution) left in `dest`: those whose process
    is gone. A user's own files are never touched: only `.substitute.<owner>.*` folders."""
    for staging in dest.glob(".substitute.*"):
        owner = staging.name.split(".")[2] if staging.name.count(".") >= 3 else ""
        if staging.is_dir() and not staging.is_symlink() and owner and not alive(owner):
            shutil.rmtree(staging, ignore_errors=True)


def seen_refs_file() -> Path:
    """Where a node remembers the newest ref it pulled, per cache and name (rollback: `check_not_older`)."""
    return cache_dir() / "pulled-refs.json"


def _seen_refs() -> dict:
    try:
        seen = json.loads(seen_refs_file().read_text())
        return seen if isinstance(seen, dict) else {}
    except (OSError, ValueError):
        return {}


def check_not_older(url: str, name: str, record: dict, allow_older: bool) -> None:
    """Refuse a ref issued before the newest this node pulled of that name from that cache: someone put an
    older signed ref back (a rollback, TUF's freeze and rollback attacks). `allow_older` is the operator's
    deliberate way back. A ref from before refs carried `issued_ns` counts as issued at 0."""
    seen = _seen_refs().get(f"{url.rstrip('/')} {name}")
    issued = record.get("issued_ns", 0)
    if isinstance(seen, dict) and isinstance(seen.get("issued_ns"), int) and issued < seen["issued_ns"] \
            and not allow_older:
        raise Refused(f"ref {name} in {url} was issued {_when(issued)}, before the one this node pulled already "
                      f"({_when(seen['issued_ns'])}): an older ref put back is refused; pass --allow-older to go "
                      "back on purpose")


def remember_ref(url: str, name: str, record: dict) -> None:
    seen = _seen_refs()
    seen[f"{url.rstrip('/')} {name}"] = {"issued_ns": record.get("issued_ns", 0),
                                         "sha256": record["outputs"]["sam3.pt2"]["sha256"]}
    try:
        write_text_atomic(seen_refs_file(), json.dumps(seen, indent=1, sort_keys=True) + "\n")
    except OSError as e:
        from ..errors import first_line

        raise Refused(f"cannot remember ref {name} in {seen_refs_file()} ({first_line(e)}): set SAM3_AOTI_CACHE "
                      "to a folder you can write") from None


def _when(ns: int) -> str:
    return time.strftime("%Y-%m-%d %H:%M:%S UTC", time.gmtime(ns / 1e9)) if ns else "before refs carried a time"


def signed_ref(cache: Cache, url: str, name: str, allow_older: bool = False) -> tuple[dict, str]:
    """(record, signer) of the ref `name`: signed by a trusted key, naming a verified package and its files,
    not older than one this node saw (then remembered as seen)."""
    found = cache.ref(name)
    if found is None:
        raise Refused(f"{url} has no ref {name!r} (a builder publishes it: `uv run doit cache=URL ref=NAME`)")
    record, signed_by = found
    if set(record["outputs"]) != set(REF_FILES):
        raise Refused(f"ref {name} names {sorted(record['outputs'])}, not {list(REF_FILES)}: refused")
    if record.get("info", {}).get("verified") is not True:
        raise Refused(f"ref {name} points at a package that did not pass verify: refused")
    check_not_older(url, name, record, allow_older)
    remember_ref(url, name, record)  # seen signed: anything older is a rollback, whether or not this fetch ends
    return record, signed_by


def pull_once(url: str, name: str, root: Path, trusted: dict[str, PublicKey], progress=None) -> Path:
    """The folder `root/<sha256>` holding the package the signed ref `name` names now: pulled as `pull` pulls,
    unless a whole earlier pull of that sha256 is there (its `origin.json`, written last). One copy per
    package on a machine, however many runs and processes use it (they take turns under a lock). A copy found
    there is not trusted for being there: load it against the folder's name, the sha256 the ref signed."""
    check_ref_name(name)
    check_destination(Path(root))
    cache = Cache(url, trusted)
    record, signed_by = signed_ref(cache, url, name)
    folder = Path(root) / record["outputs"]["sam3.pt2"]["sha256"]
    with open(folder.parent / f"{folder.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not (folder / "origin.json").is_file():
            fetch_ref(cache, url, name, record, signed_by, folder, progress)
    return folder


def pull(url: str, name: str, dest: Path, trusted: dict[str, PublicKey], progress=None,
         allow_older: bool = False) -> dict:
    """`sam3-aoti pull`: the package a signed ref names, its digest file and its verify report into `dest`,
    each checked against the ref; `dest/origin.json` says where they came from and who signed them. A ref older
    than one this node pulled before is refused unless `allow_older`."""
    check_ref_name(name)
    check_destination(Path(dest))
    cache = Cache(url, trusted)
    record, signed_by = signed_ref(cache, url, name, allow_older)
    return fetch_ref(cache, url, name, record, signed_by, Path(dest), progress)


def fetch_ref(cache: Cache, url: str, name: str, record: dict, signed_by: str, dest: Path, progress=None) -> dict:
    """The files of a checked ref's `record` into `dest`, then `origin.json` (written last: a whole pull)."""
    digest = record["outputs"]["sam3.pt2"]["sha256"]
    cache.fetch(record, dest, list(REF_FILES), progress)
    if (dest / "sam3.pt2.sha256").read_text().split()[:1] != [digest]:
        (dest / "sam3.pt2.sha256").unlink()  # a digest file that disagrees with the signed record is no digest
        raise Refused(f"ref {name}: its sam3.pt2.sha256 does not name the package's sha256: refused")
    origin = {"ref": name, "url": url, "signed_by": signed_by, "built_by": record.get("built_by"),
              "issued": _when(record.get("issued_ns", 0)), "pulled": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
              "info": record.get("info", {})}
    write_text_atomic(dest / "origin.json", json.dumps(origin, indent=2) + "\n")
    return origin
