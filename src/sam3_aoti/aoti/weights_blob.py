"""AOTInductor's weights blob, rebuilt from an exported archive's tensors: the one copy of the weights in a
package, and the reason new weights need no recompile (the `compile` stage checks it byte for byte)."""

from __future__ import annotations

import json
import zipfile
from pathlib import Path

from ..errors import PackageError
from ..runtime.archive import archive_entries

ALIGN_BYTES = 64  # AOTInductor pads each constant to this in a blob unless every constant is on the GPU


def tensor_entries(archive: zipfile.ZipFile, model: str) -> dict[str, str]:
    """Exported-program tensor name -> archive entry holding its storage's bytes (weights and constants)."""
    entries = archive_entries(archive)
    found = {}
    for kind, folder in (("weights", "data/weights"), ("constants", "data/constants")):
        config = json.loads(archive.read(entries[f"{folder}/{model}_{kind}_config.json"]))["config"]
        for fqn, meta in config.items():
            if meta["use_pickle"]:
                raise PackageError(f"{model} tensor {fqn} is pickled in the exported archive: no raw bytes to package")
            found[fqn] = entries[f"{folder}/{meta['path_name']}"]
    return found


def weights_blob_pieces(exported: Path, model: str, compiled: dict):
    """AOTInductor's weights blob for `model`, piece by piece: the exported archive's tensors in the order the
    compiled wrapper reads them, each padded as AOTInductor pads it, with every size checked."""
    constants = [c for c in compiled["constants"] if not c["folded"]]
    pad = not all(c["cuda"] for c in constants)
    size = 0
    with zipfile.ZipFile(exported) as archive:
        entries = tensor_entries(archive, model)
        for c in constants:
            if c["fqn"] not in entries:
                raise PackageError(f"compiled {model} needs tensor {c['fqn']!r}, which the exported program lacks: "
                                   "run `uv run doit compile`")
            data = archive.read(entries[c["fqn"]])
            if pad and len(data) % ALIGN_BYTES:
                data += bytes(ALIGN_BYTES - len(data) % ALIGN_BYTES)
            if len(data) != c["bytes"]:
                raise PackageError(f"{model} tensor {c['fqn']!r} has {len(data)} bytes, the compiled code expects "
                                   f"{c['bytes']}: run `uv run doit compile`")
            size += len(data)
            yield data
    if size != compiled["blob_bytes"]:
        raise PackageError(f"{model}'s weights blob has {size} bytes, the compiled code expects "
                           f"{compiled['blob_bytes']}: run `uv run doit compile`")


def write_weights_blob(exported: Path, model: str, compiled: dict, out: Path) -> int:
    """AOTInductor's weights blob for `model`, built from the exported archive's tensors. Returns its size. The
    `compile` stage checks that the same pieces make AOTInductor's own blob (`blob_matches`)."""
    size = 0
    with open(out, "wb") as blob:
        for data in weights_blob_pieces(exported, model, compiled):
            blob.write(data)
            size += len(data)
    return size


def blob_matches(exported: Path, model: str, compiled: dict, blob: Path) -> bool:
    """Whether the blob the package stage would write for `model` is AOTInductor's `blob`, byte for byte: compared
    piece by piece as it is rebuilt, with nothing written (a full-size blob is 1.6 GB)."""
    with open(blob, "rb") as theirs:
        for data in weights_blob_pieces(exported, model, compiled):
            if theirs.read(len(data)) != data:
                return False
        return theirs.read(1) == b""
