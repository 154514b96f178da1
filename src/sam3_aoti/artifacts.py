"""Atomic artifact writes and the manifest that records every artifact's hash, size and versions."""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
import shutil
import tempfile
import time
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


def sha256(path: Path, chunk: int = 1 << 24) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def describe(path: Path) -> dict:
    path = Path(path)
    if path.is_dir():
        return {"files": {p.name: describe(p) for p in sorted(path.iterdir()) if p.is_file()}}
    return {"sha256": sha256(path), "bytes": path.stat().st_size}


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


def human_size(n: int) -> str:
    for unit in ("B", "KB", "MB", "GB"):
        if n < 1024 or unit == "GB":
            return f"{n:.1f} {unit}" if unit != "B" else f"{n} B"
        n /= 1024
    return f"{n:.1f} GB"
