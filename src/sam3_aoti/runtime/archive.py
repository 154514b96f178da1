"""Reading a PT2 archive without torch: its entries by name, bounded reads, the metadata's field types, the fallback
beside it. One package's reads go through `reader.PackageFile`."""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import PackageError

METADATA_FILE = "metadata.json"
VOCAB_FILE = "tokenizer/bpe_simple_vocab_16e6.txt"
MODEL_NAMES = ("model", "transforms")  # in every package
# With `[export] split`, beside them: model = decode(*encode_image(images), *encode_text(token_ids)). They read
# `model`'s weights (the package stores them once; encode_boxes some of its own) and are loaded all or none.
PART_NAMES = ("encode_image", "encode_text", "encode_boxes", "decode")
# The parts that read model's weights in place (no blob of their own). encode_boxes has its own: the box
# encoder's layers are weights `model`, which never sees a box, does not hold.
SHARED_WEIGHT_PARTS = ("encode_image", "encode_text", "decode")
# The loader's calls of the parts (`split_call`), not models of the package: text alone, and with exemplar boxes.
SPLIT_CALLS = ("model_from_parts", "model_with_boxes")
BLOB_SUFFIX = "_weights.blob"  # a model's AOTInductor weights blob, beside its code


# The most any entry read before (or without) the digest check may inflate to: a package's are far smaller.
READ_LIMITS = {METADATA_FILE: 4 << 20, VOCAB_FILE: 16 << 20, "wrapper_metadata.json": 1 << 20}
# metadata.json's fields a reader uses, and the JSON type each must have
METADATA_TYPES = {"format": str, "profile": str, "precision": str, "device": str, "weights": str, "models": dict,
                  "versions": dict, "tokenizer": dict, "parts_sha256": dict, "inductor_options": dict,
                  "fp32_parts": list, "fp8_parts": list, "weights_layout": dict}


def read_bounded(archive, name: str, limit: int) -> bytes:
    """An entry's bytes, read only up to `limit` (the sizes a zip declares can lie: the stream is what counts)."""
    with archive.open(name) as entry:
        data = entry.read(limit + 1)
    if len(data) > limit:
        raise PackageError(f"{archive.filename}: {name} inflates past {limit >> 20} MiB, more than any package's: "
                           "not a sam3-aoti package")
    return data


def parse_metadata(text: str | bytes, path: Path) -> dict:
    """metadata.json as a dict of the fields' types (METADATA_TYPES), or one line naming what is wrong."""
    try:
        metadata = json.loads(text)
    except (ValueError, RecursionError):
        raise PackageError(f"{path}: its {METADATA_FILE} is not JSON: rebuild it with `uv run doit package`") from None
    if not isinstance(metadata, dict):
        raise PackageError(f"{path}: its {METADATA_FILE} is {_json_type(metadata)}, not an object: rebuild it")
    for field, kind in METADATA_TYPES.items():
        if field in metadata and not isinstance(metadata[field], kind):
            raise PackageError(f"{path}: {METADATA_FILE} field `{field}` is {_json_type(metadata[field])}, not "
                               f"{_json_type(kind())}: rebuild it with `uv run doit package`")
    for name, model in metadata.get("models", {}).items():
        if not isinstance(model, dict):
            raise PackageError(f"{path}: {METADATA_FILE} field `models.{name}` is not an object: rebuild it")
    return metadata


def _json_type(value) -> str:
    kinds = ((bool, "a boolean"), ((int, float), "a number"), (str, "a string"), (list, "an array"), (dict, "an object"))
    return next((name for kind, name in kinds if isinstance(value, kind)), "null")


def archive_entries(archive) -> dict[str, str]:
    """A PT2 archive's (zipfile) entries by their name inside it, without the archive's root folder."""
    return {name.split("/", 1)[1]: name for name in archive.namelist() if "/" in name}


def fallback_of(package: Path) -> Path:
    """The exported-program fallback beside a package: sam3.pt2 -> sam3.exported.pt2."""
    package = Path(package)
    return package.with_name(f"{package.stem}.exported.pt2")
