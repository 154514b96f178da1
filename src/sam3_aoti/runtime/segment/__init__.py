"""`sam3-aoti segment`: a package over a collection of images (a folder, a glob, a list, a bucket prefix) on Ray
Data, into a resumable Parquet dataset of instances. Needs the `batch` extra (Ray, pyarrow, pycocotools); the
rest of the runtime does not import it."""

from .engine import segment
from .worker import Segmenter, decode_batch

__all__ = ["Segmenter", "decode_batch", "segment"]
