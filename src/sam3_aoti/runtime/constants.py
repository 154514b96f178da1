"""A model's weights built on its device straight from the package's own bytes.

AOTInductor's runner reads weights from a blob file (`update_constant_buffer_from_blob`, which mmaps a path), so
torch's loaders, and this one before, wrote the 1.6 GB blob out of the archive and read it back. The blob is a
stored (uncompressed) entry of the package, and the package records how the compiled code lays it out
(`metadata["weights_layout"]`: each constant's name, dtype, shape, stride, storage offset and bytes, in blob order,
as AOTInductor's wrapper declares them). So each tensor is copied from the open package file's pages to its
device, and the runner is pointed at them (`AotiRunner`): nothing is written. A package without the layout, or one
no digest vouched for, loads through the blob file as before.
"""

from __future__ import annotations

import mmap
import warnings
from typing import NamedTuple

from .archive import BLOB_SUFFIX
from .reader import PackageFile, stored_data_offset

DTYPES = ("float32", "bfloat16", "float16", "float8_e4m3fn", "float8_e5m2", "float64", "int64", "int32", "int16",
          "int8", "uint8", "bool")


class InPlace(NamedTuple):
    """A model's weights as they lie in the package: the blob's entry, where its bytes start in the file, and
    its layout (`metadata["weights_layout"][model]`)."""
    entry: str
    start: int
    layout: list


def readable_layout(package: PackageFile, name: str, device: str) -> InPlace | None:
    """The model's weights as they lie in the package when they can be read in place: a layout recorded for a
    stored blob it adds up to, dtypes torch knows, one device for every constant, and a package whose sha256
    matched its digest (what the pages hold is what was checked). Else None."""
    layout = (package.metadata.get("weights_layout") or {}).get(name)
    prefix = f"data/aotinductor/{name}/"
    blobs = [inner for inner in package.entries if inner.startswith(prefix) and inner.endswith(BLOB_SUFFIX)]
    if not package.digest_matched or not isinstance(layout, list) or len(blobs) != 1:
        return None
    try:
        if any(dtype not in DTYPES or on_cuda != (device == "cuda") or nbytes < 0
               for _, dtype, _, _, _, nbytes, on_cuda in layout):
            return None
        sizes = sum(nbytes for *_, nbytes, _ in layout)
    except (TypeError, ValueError):  # not the shape of a layout
        return None
    info = package.entries[blobs[0]]
    start = stored_data_offset(package.file, info)
    return InPlace(blobs[0], start, layout) if start is not None and sizes == info.file_size else None


def read_constants(package: PackageFile, weights: InPlace, device: str) -> dict:
    """Each constant of the weights' layout, its bytes copied from the package file into memory of its own on
    `device`, viewed as the compiled code declares it: name -> tensor."""
    import torch

    tensors, at = {}, weights.start
    pages = mmap.mmap(package.file.fileno(), 0, access=mmap.ACCESS_READ)  # unmapped once nothing views it
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "The given buffer is not writable")  # only read, into copies
        for name, dtype, shape, stride, offset, nbytes, _ in weights.layout:
            storage = torch.empty(nbytes, dtype=torch.uint8, device=device)
            if nbytes:
                storage.copy_(torch.frombuffer(pages, dtype=torch.uint8, count=nbytes, offset=at))
            tensors[name] = storage.view(getattr(torch, dtype)).as_strided(shape, stride, offset)
            at += nbytes
    return tensors
