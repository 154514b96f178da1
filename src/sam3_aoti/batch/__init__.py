"""`sam3-aoti segment` (the `batch` extra: Ray, pyarrow, pycocotools): a package over a collection of images (a
folder, a glob, a list, a bucket prefix) on Ray Data, into a resumable Parquet dataset of instances. The runtime
never imports it (import-linter)."""

from .engine import segment
from .worker import OverlappingSegmenter, Segmenter, decode_batch, encode_masks

__all__ = ["OverlappingSegmenter", "Segmenter", "decode_batch", "encode_masks", "segment"]
