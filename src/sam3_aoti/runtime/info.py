"""`sam3-aoti info`: what a package holds, read from the zip alone (no torch, no native code run)."""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import PackageError
from .archive import BLOB_SUFFIX, fallback_of
from .files import human_size
from .integrity import PackageFile, check_entries, check_package, read_consistently


def archive_info(path: str | Path, trust: bool = False, sha256: str | None = None) -> dict:
    """What a package holds, read from the zip alone (no torch, no native code run): models and backends,
    inputs and outputs, dynamic dims, precision, the GPU it was built for, versions, weights hash, sizes."""
    path = Path(path)
    if not path.is_file():
        raise PackageError(f"no package at {path}: pass the .pt2 file the `package` stage wrote")
    with PackageFile(path) as package:  # what is described is what is checked
        check_package(package, trust=trust, digest=sha256)
        described = read_consistently(package, _describe)
        return {**described, "integrity": package.verdict}


def _describe(package: PackageFile) -> dict:
    path = package.path
    check_entries(package)
    try:
        entries = package.entries
        if package.read("archive_format", 16) != b"pt2":
            raise KeyError("archive_format")
        metadata = package.metadata
        aoti = {}
        for name, item in entries.items():
            if name.startswith("data/aotinductor/"):
                model, file = name.split("/")[2:4]
                part = aoti.setdefault(model, {"code_bytes": 0, "weights_bytes": 0})
                part["weights_bytes" if file.endswith(BLOB_SUFFIX) else "code_bytes"] += item.file_size
        for model, built in package.built_for.items():
            aoti.setdefault(model, {"code_bytes": 0, "weights_bytes": 0}).update(
                device=built.get("AOTI_DEVICE_KEY"), compute_capability=built.get("AOTI_COMPUTE_CAPABILITY") or None)
    except KeyError:
        raise PackageError(f"{path} is not a sam3-aoti PT2 package: rebuild it with `uv run doit package` or pass "
                           "another file") from None
    fallback = fallback_of(path)
    models = {}
    for name, described in metadata.get("models", {}).items():
        backends = (["aoti"] if name in aoti else []) + (["exported (fallback)"] if fallback.is_file() else [])
        models[name] = {**described, "backends": backends, **aoti.get(name, {})}
    versions = metadata.get("versions", {})
    return {
        "path": str(path), "bytes": package.opened.st_size, "format": metadata.get("format"), "integrity": None,
        "profile": metadata.get("profile"), "precision": metadata.get("precision"), "device": metadata.get("device"),
        "gpu": versions.get("gpu"), "compute_capability": versions.get("compute_capability"),
        "versions": {k: versions.get(k) for k in ("torch", "transformers", "cuda", "triton", "python")},
        "weights": metadata.get("weights"),
        "weights_sha256": {part.split("/")[2]: sha for part, sha in metadata.get("parts_sha256", {}).items()
                           if part.endswith(BLOB_SUFFIX)},
        "fallback": {"path": str(fallback), "bytes": fallback.stat().st_size} if fallback.is_file() else None,
        "origin": origin_of(path),
        "models": models,
    }


def origin_of(path: Path) -> dict | None:
    """Where the package came from, as the place it lies in says: built or substituted (the build's manifest,
    two folders up), or pulled by a ref (`sam3-aoti pull`'s origin.json beside it)."""
    def read(file: Path):
        try:
            return json.loads(file.read_text())
        except (OSError, ValueError):
            return None

    pulled = read(path.parent / "origin.json")
    if isinstance(pulled, dict) and "ref" in pulled:
        return {"how": "pulled", **{k: pulled.get(k) for k in ("ref", "url", "signed_by", "built_by", "pulled")}}
    manifest = read(path.parent.parent / "manifest.json")
    entry = manifest.get("stages", {}).get("package", {}) if isinstance(manifest, dict) else {}
    if f"{path.parent.name}/{path.name}" not in entry.get("outputs", {}):
        return None
    origin = entry.get("origin", {})
    if "substituted" in origin:
        return {"how": "substituted", "url": origin["substituted"], "signed_by": origin.get("signed_by"),
                "built_by": origin.get("built_by"), "key": entry.get("key")}
    return {"how": "built", "host": origin.get("built"), "key": entry.get("key")}


def format_info(info: dict) -> str:
    """`sam3-aoti info` for people."""
    built = info["gpu"] and f"{info['gpu']} (compute capability {info['compute_capability']})"
    lines = [f"{info['path']}: {human_size(info['bytes'])}, {info['format']}, profile {info['profile']}, "
             f"{info['precision']} on {info['device']}{', built on ' + built if built else ''}",
             "versions: " + ", ".join(f"{k} {v}" for k, v in info["versions"].items() if v),
             f"integrity: {info['integrity']}"]
    fallback = info["fallback"]
    lines.append(f"fallback: {Path(fallback['path']).name} ({human_size(fallback['bytes'])})" if fallback
                 else "fallback: none beside it (AOTI only)")
    origin = info.get("origin")
    if origin:
        lines.append({"built": lambda o: f"origin: built here ({o.get('host') or 'this machine'})",
                      "substituted": lambda o: f"origin: substituted from {o['url']}, signed by {o['signed_by']}",
                      "pulled": lambda o: f"origin: pulled ref {o['ref']} from {o['url']}, signed by {o['signed_by']}",
                      }[origin["how"]](origin))
    lines.append(f"weights: {info['weights']}")
    for name, model in info["models"].items():
        sizes = f"code {human_size(model.get('code_bytes', 0))}, weights {human_size(model.get('weights_bytes', 0))}"
        weights = (f"reads {model['weights_from']}'s weights" if model.get("weights_from") else
                   f"weights sha256 {info['weights_sha256'].get(name, 'none')[:16]}")
        lines.append(f"{name}: backends {', '.join(model['backends']) or 'none'}; {sizes}; {weights}")
        dims = ", ".join(f"{d} >= {r['min']}" for d, r in model.get("dynamic_dims", {}).items())
        if dims:
            lines.append(f"  dynamic: {dims}")
        for kind in ("inputs", "outputs"):
            order = model.get(f"{kind[:-1]}_order", [])
            names = order + [n for n in model.get(kind, {}) if n not in order]
            for n in names:
                t = model[kind][n]
                lines.append(f"  {kind[:-1]:6} {n:20} {t['dtype']:9} [{', '.join(map(str, t['shape']))}]")
    return "\n".join(lines)
