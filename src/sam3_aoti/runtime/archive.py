"""Reading a PT2 archive without torch: its entries, its extra files, the fallback beside it."""

from __future__ import annotations

import zipfile
from pathlib import Path

from ..errors import PackageError

METADATA_FILE = "metadata.json"
VOCAB_FILE = "tokenizer/bpe_simple_vocab_16e6.txt"
MODEL_NAMES = ("model", "transforms")  # in every package
# With `[export] split`, beside them: model = decode(*encode_image(images), *encode_text(token_ids)). They read
# `model`'s weights (the package stores them once) and are loaded all three or none.
PART_NAMES = ("encode_image", "encode_text", "encode_boxes", "decode")
# The parts that read model's weights in place (no blob of their own). encode_boxes has its own: the box
# encoder's layers are weights `model`, which never sees a box, does not hold.
SHARED_WEIGHT_PARTS = ("encode_image", "encode_text", "decode")


def read_extra_files(path: Path) -> dict:
    """The archive's metadata and vocabulary, by name (a one-line error for anything that is no package)."""
    try:
        with zipfile.ZipFile(path) as archive:
            entries = archive_entries(archive)
            if f"extra/{METADATA_FILE}" not in entries:
                raise KeyError(METADATA_FILE)
            return {name: archive.read(entries[f"extra/{name}"]).decode() for name in (METADATA_FILE, VOCAB_FILE)
                    if f"extra/{name}" in entries}
    except (zipfile.BadZipFile, KeyError, OSError, EOFError, UnicodeDecodeError):
        raise PackageError(f"{path} is truncated or not a sam3-aoti package: rebuild it with `uv run doit package`") from None


def archive_entries(archive) -> dict[str, str]:
    """A PT2 archive's (zipfile) entries by their name inside it, without the archive's root folder."""
    return {name.split("/", 1)[1]: name for name in archive.namelist() if "/" in name}


def fallback_of(package: Path) -> Path:
    """The exported-program fallback beside a package: sam3.pt2 -> sam3.exported.pt2."""
    package = Path(package)
    return package.with_name(f"{package.stem}.exported.pt2")
