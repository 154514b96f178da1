"""Atomic artifact writes and the manifest that records every artifact's hash, size and versions."""

from __future__ import annotations

import contextlib
import fcntl
import functools
import json
import shutil
import sys
import time
from pathlib import Path

from ..runtime.files import human_size, sha256, sha256_once, write_text_atomic


def read_manifest(manifest: Path) -> dict:
    """The manifest, or an empty one where it is missing or damaged (not JSON, not a manifest): its stages are
    then not intact and rebuild, and the next `record` writes a whole one."""
    manifest = Path(manifest)
    try:
        data = json.loads(manifest.read_text())
        if isinstance(data, dict) and isinstance(data.get("stages"), dict):
            return data
    except FileNotFoundError:
        return {"stages": {}}
    except (OSError, ValueError):
        pass
    _say_damaged(str(manifest))
    return {"stages": {}}


@functools.lru_cache(maxsize=None)
def _say_damaged(manifest: str) -> None:
    print(f"sam3-aoti: {manifest} is damaged (not a manifest): every stage that recorded its outputs there "
          "rebuilds", file=sys.stderr)


def write_manifest(manifest: Path, data: dict) -> None:
    write_text_atomic(Path(manifest), json.dumps(data, indent=2, sort_keys=True) + "\n")


@contextlib.contextmanager
def updating(manifest: Path):
    """The manifest to change, read and written under an exclusive lock (`manifest.json.lock`): two stages that
    run at once (the fallback beside compile) each record their entry, and neither loses the other's."""
    manifest = Path(manifest)
    manifest.parent.mkdir(parents=True, exist_ok=True)
    with open(manifest.with_name(manifest.name + ".lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        data = read_manifest(manifest)
        before = json.dumps(data, sort_keys=True)
        yield data
        if json.dumps(data, sort_keys=True) != before:
            write_manifest(manifest, data)


def describe(path: Path) -> dict:
    path = Path(path)
    if path.is_dir():
        return {"files": {p.name: describe(p) for p in sorted(path.iterdir()) if p.is_file()}}
    stat = path.stat()
    return {"sha256": sha256_once(path), "bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns,
            "ctime_ns": stat.st_ctime_ns}


def changed(path: Path, recorded: dict, rehash: bool = False, refreshed: list | None = None) -> str | None:
    """Why `path` no longer holds what the manifest recorded (None if it does). Size first; the hash only when
    the file's mtime or ctime moved (or `rehash`), so an unchanged multi-GB package costs a stat, not a read.
    ctime moves on every write and cannot be set back: a byte changed in place with the size and mtime kept is
    found too. A file whose times moved but whose hash still matches (a copied checkout) is appended to
    `refreshed`, so that its new times can be recorded, as git's index refreshes a touched file."""
    path = Path(path)
    if "files" in recorded:
        if not path.is_dir():
            return "missing"
        extra = sorted({p.name for p in path.iterdir() if p.is_file()} - set(recorded["files"]))
        if extra:
            return f"holds {extra[0]}, which was not written by its stage"
        for name, entry in recorded["files"].items():
            why = changed(path / name, entry, rehash, refreshed)
            if why:
                return f"{name} {why}"
        return None
    if not path.is_file():
        return "missing"
    stat = path.stat()
    if stat.st_size != recorded["bytes"]:
        return f"has {stat.st_size} bytes, {recorded['bytes']} were written"
    moved = (stat.st_mtime_ns, stat.st_ctime_ns) != (recorded.get("mtime_ns"), recorded.get("ctime_ns"))
    if rehash or moved:
        if sha256(path) != recorded["sha256"]:
            return "was modified after its stage wrote it"
        if moved and refreshed is not None:
            refreshed.append((recorded, stat))
    return None


def recorded_files(manifest: Path) -> dict[str, tuple]:
    """Absolute path -> (bytes, mtime_ns, ctime_ns, sha256) of every file the manifest's stages recorded."""
    manifest, found = Path(manifest), {}

    def walk(path: Path, entry: dict) -> None:
        if "files" in entry:
            for name, child in entry["files"].items():
                walk(path / name, child)
        elif "sha256" in entry:
            found[str(path.absolute())] = (entry["bytes"], entry.get("mtime_ns"), entry.get("ctime_ns"),
                                           entry["sha256"])

    for stage in read_manifest(manifest)["stages"].values():
        for rel, entry in stage.get("outputs", {}).items():
            walk(manifest.parent / rel, entry)
    return found


def recorded_sha256(manifest: Path, path: Path) -> str:
    """`path`'s sha256 as the stage that wrote it recorded it, while the file is still what was recorded (size,
    mtime and ctime); read now otherwise (a checkpoint of GBs is not hashed by every stage)."""
    recorded, stat = recorded_files(manifest).get(str(Path(path).absolute())), Path(path).stat()
    if recorded and recorded[:3] == (stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns):
        return recorded[3]
    return sha256_once(path)


def manifest_changes(manifest: Path, stages: list[str] | None = None, rehash: bool = False,
                     refresh: bool = False) -> list[str]:
    """`STAGE: PATH WHY` for every recorded output that no longer matches (all stages, or those given), and
    `STAGE: not recorded` for a stage asked for by name that has no entry; `rehash` hashes every file, not only
    those whose times moved. `refresh` records the new times of files whose content still matches."""
    manifest = Path(manifest)
    with updating(manifest) if refresh else contextlib.nullcontext(read_manifest(manifest)) as data:
        found, refreshed = [], []
        for stage in stages or []:
            if stage not in data["stages"]:
                found.append(f"{stage}: not recorded in {manifest.name}")
        for stage, entry in sorted(data["stages"].items()):
            if stages is None or stage in stages:
                for rel, recorded in entry.get("outputs", {}).items():
                    why = changed(manifest.parent / rel, recorded, rehash, refreshed)
                    if why:
                        found.append(f"{stage}: {rel} {why}")
        if refresh and not found:
            for recorded, stat in refreshed:
                recorded.update(mtime_ns=stat.st_mtime_ns, ctime_ns=stat.st_ctime_ns)
    return found


def mark(manifest: Path, stage: str, **fields) -> None:
    """Set fields of a stage's manifest entry, if it has one (e.g. verified: false the moment verify starts)."""
    manifest = Path(manifest)
    if not manifest.exists():
        return
    with updating(manifest) as data:
        if stage in data["stages"]:
            data["stages"][stage].update(fields)


def record(manifest: Path, stage: str, outputs: list[Path], info: dict) -> dict:
    """Replace `stage`'s entry in the manifest: its outputs' hashes plus `info` (options, versions, ...)."""
    manifest = Path(manifest)
    root = manifest.parent
    entry = {
        "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "outputs": {str(Path(p).relative_to(root)): describe(p) for p in outputs},
        **info,
    }
    with updating(manifest) as data:
        data["stages"][stage] = entry
    return entry


def check_free_space(needs: dict[Path, int], stage: str) -> None:
    """Stop before the long work when a folder's filesystem cannot hold what the stage will write there
    (folders on one filesystem add up)."""
    from ..errors import Sam3AotiError

    by_device: dict[int, tuple[Path, int]] = {}
    for folder, size in needs.items():
        existing = next(p for p in [Path(folder), *Path(folder).parents] if p.exists())
        device = existing.stat().st_dev
        first, total = by_device.get(device, (existing, 0))
        by_device[device] = (first, total + size)
    for folder, size in by_device.values():
        free = shutil.disk_usage(folder).free
        if free < size:
            raise Sam3AotiError(f"{stage} needs about {human_size(size)} free on the disk of {folder}, "
                                f"{human_size(free)} is free: free some space (`uv run doit clean` of an old variant)")


