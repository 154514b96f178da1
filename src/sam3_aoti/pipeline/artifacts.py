"""Atomic artifact writes and the manifest that records every artifact's hash, size and versions."""

from __future__ import annotations

import json
import shutil
import time
from pathlib import Path

from ..runtime.files import human_size, sha256, write_text_atomic


def describe(path: Path) -> dict:
    path = Path(path)
    if path.is_dir():
        return {"files": {p.name: describe(p) for p in sorted(path.iterdir()) if p.is_file()}}
    stat = path.stat()
    return {"sha256": sha256(path), "bytes": stat.st_size, "mtime_ns": stat.st_mtime_ns}


def changed(path: Path, recorded: dict, rehash: bool = False) -> str | None:
    """Why `path` no longer holds what the manifest recorded (None if it does). Size and mtime first; the
    hash only when they moved, so an unchanged multi-GB package costs a stat, not a read."""
    path = Path(path)
    if "files" in recorded:
        if not path.is_dir():
            return "missing"
        extra = sorted({p.name for p in path.iterdir() if p.is_file()} - set(recorded["files"]))
        if extra:
            return f"holds {extra[0]}, which was not written by its stage"
        for name, entry in recorded["files"].items():
            why = changed(path / name, entry, rehash)
            if why:
                return f"{name} {why}"
        return None
    if not path.is_file():
        return "missing"
    stat = path.stat()
    if stat.st_size != recorded["bytes"]:
        return f"has {stat.st_size} bytes, {recorded['bytes']} were written"
    if (rehash or stat.st_mtime_ns != recorded.get("mtime_ns")) and sha256(path) != recorded["sha256"]:
        return "was modified after its stage wrote it"
    return None


def manifest_changes(manifest: Path, stages: list[str] | None = None, rehash: bool = False) -> list[str]:
    """`STAGE: PATH WHY` for every recorded output that no longer matches (all stages, or those given);
    `rehash` hashes every file, not only those whose size or mtime moved."""
    manifest = Path(manifest)
    data = json.loads(manifest.read_text()) if manifest.exists() else {"stages": {}}
    found = []
    for stage, entry in sorted(data["stages"].items()):
        if stages is None or stage in stages:
            for rel, recorded in entry.get("outputs", {}).items():
                why = changed(manifest.parent / rel, recorded, rehash)
                if why:
                    found.append(f"{stage}: {rel} {why}")
    return found


def mark(manifest: Path, stage: str, **fields) -> None:
    """Set fields of a stage's manifest entry, if it has one (e.g. verified: false the moment verify starts)."""
    manifest = Path(manifest)
    if not manifest.exists():
        return
    data = json.loads(manifest.read_text())
    if stage in data["stages"]:
        data["stages"][stage].update(fields)
        write_text_atomic(manifest, json.dumps(data, indent=2, sort_keys=True) + "\n")


def record(manifest: Path, stage: str, outputs: list[Path], info: dict) -> dict:
    """Replace `stage`'s entry in the manifest: its outputs' hashes plus `info` (options, versions, ...)."""
    manifest = Path(manifest)
    data = json.loads(manifest.read_text()) if manifest.exists() else {"stages": {}}
    root = manifest.parent
    entry = {
        "finished": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "outputs": {str(Path(p).relative_to(root)): describe(p) for p in outputs},
        **info,
    }
    data["stages"][stage] = entry
    write_text_atomic(manifest, json.dumps(data, indent=2, sort_keys=True) + "\n")
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


