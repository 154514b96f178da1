"""`Segmenter`: the package loaded once, then batches of decoded images in, one row per image out, each with its
instances (what `predict` finds: the same inference and thresholds, `runtime.inference`, `postprocess`), masks
packed into bits; `encode_masks` then turns the bits into COCO run-length encoding on a CPU. Callables, the form
Ray Data's `map_batches` runs (the model in actors, the encoding in CPU tasks after them); a loop of your own can
call them too: `encode_masks(segmenter(decode_batch(batch)))`."""

from __future__ import annotations

import logging
import time
from pathlib import Path

from ..errors import PackageError, Sam3AotiError
from .schemas import decoded_schema, found_schema

log = logging.getLogger(__name__)


def decode_batch(batch: dict):
    """CPU side: each `source` read and decoded (`sources.decode`, as `predict` reads a file) into `pixels` (the
    HxWx3 uint8 bytes), `width`, `height`; a file that cannot be segmented gets its one-line reason in `error`
    instead (not an image, truncated, too small), and the rest go on. Each image's bytes, as PIL writes them, are
    its value in the column, a chunk of its own: no array, no copy into one buffer (47-49 ms an image of
    throughput's collection before, 39 after: benchmarks/cpu-2026-12-05-decode/)."""
    import pyarrow as pa

    from .sources import decode

    out = {"source": [], "width": [], "height": [], "error": []}
    chunks = []
    for source in batch["source"]:
        source = str(source)
        try:
            pixels, (height, width) = decode(source, as_bytes=True)
            error = ""
        except Sam3AotiError as e:
            pixels, height, width, error = b"", 0, 0, str(e)
        chunks.append(one_value(pa.py_buffer(pixels)))
        for key, value in zip(out, (source, width, height, error)):
            out[key].append(value)
    schema = decoded_schema()
    columns = {name: pa.array(values, schema.field(name).type) for name, values in out.items()}
    columns["pixels"] = pa.chunked_array(chunks, schema.field("pixels").type)
    return pa.Table.from_pydict(columns, schema=schema)


def one_value(buffer):
    """A large_binary Arrow array of one value whose bytes are `buffer` itself."""
    import pyarrow as pa

    offsets = pa.array([0, buffer.size], pa.int64()).buffers()[1]
    return pa.LargeBinaryArray.from_buffers(pa.large_binary(), 1, [None, offsets, buffer])


def columns_of(batch) -> tuple:
    """(sources, widths, heights, errors, each image's pixel bytes) of a decoded batch: `decode_batch`'s Arrow
    table, whose pixels are then views of its buffers (`values_in_place`), or a dict of its columns."""
    if isinstance(batch, dict):
        return batch["source"], batch["width"], batch["height"], batch["error"], batch["pixels"]
    return (*(batch.column(name).to_pylist() for name in ("source", "width", "height", "error")),
            values_in_place(batch.column("pixels")))


def values_in_place(column) -> list:
    """Each value of a large_binary column as an Arrow buffer over the column's own memory. A scalar's
    `as_buffer()` copies its bytes: 40 ms for a batch of 16 images of 4 MB on one core, and the actor's CPU is the
    GPU's feed."""
    import numpy as np

    values = []
    for chunk in getattr(column, "chunks", [column]):
        _, offsets, data = chunk.buffers()
        ends = np.frombuffer(offsets, np.int64, len(chunk) + 1, chunk.offset * 8).tolist()
        values += [data.slice(start, end - start) if data is not None else memoryview(b"")
                   for start, end in zip(ends, ends[1:])]
    return values


def pixels_in_place(buffer, height: int, width: int):
    """An image's decoded bytes as a uint8 `[height, width, 3]` tensor over the same memory, never written. Through
    a memoryview: Ray's shared-memory object store hands a large batch's Arrow buffers read-only, and
    `torch.frombuffer` refuses a read-only Arrow buffer ("could not retrieve buffer from object"), not a read-only
    memoryview."""
    import torch

    return torch.frombuffer(memoryview(buffer), dtype=torch.uint8).view(height, width, 3)


def coco_counts(bits, height: int, width: int) -> str:
    """A mask packed into bits column by column (`postprocess.pack_bits`) as COCO's compressed run-length `counts`
    (pycocotools' own codec): `{"size": [height, width], "counts": counts}` is what `pycocotools.mask.decode`
    takes."""
    import numpy as np
    from pycocotools import mask as coco_mask

    columns = np.unpackbits(np.frombuffer(bits, np.uint8), count=height * width).reshape(width, height)
    return coco_mask.encode(columns.T)["counts"].decode("ascii")  # .T: [height, width] in column order, uncopied


def encode_masks(found):
    """CPU side, after the model actor: the Arrow table `Segmenter` returns with each instance's `mask_bits`
    replaced by its COCO `mask_counts` (`schemas.segmented_schema`), every other column as it came."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from .schemas import INSTANCE_FIELDS, instance_type, segmented_schema

    lists = found.column("instances").combine_chunks()
    flat = lists.flatten()  # every instance of the table, row after row
    rows = pc.list_parent_indices(lists).to_numpy()
    heights, widths = found.column("height").to_numpy(), found.column("width").to_numpy()
    counts = pa.array([coco_counts(bits, int(heights[r]), int(widths[r]))
                       for bits, r in zip(flat.field("mask_bits").to_numpy(zero_copy_only=False), rows)], pa.string())
    structs = pa.StructArray.from_arrays([*(flat.field(n) for n in INSTANCE_FIELDS[:-1]), counts],
                                         fields=list(instance_type()))
    offsets = pc.subtract(lists.offsets, lists.offsets[0])
    instances = pa.ListArray.from_arrays(offsets, structs, type=pa.list_(instance_type()))
    return found.set_column(found.schema.get_field_index("instances"), "instances", instances).cast(
        segmented_schema())


def pulled_packages() -> Path:
    """Where `segment` keeps the packages it pulled by ref on this machine: one folder per sha256, shared by
    every run (`binary_cache.pull_once`)."""
    from ..runtime.scratch import cache_dir

    return cache_dir() / "segment" / "packages"


def pulled_package(spec: dict) -> Path:
    """A package named by a signed ref, pulled (and checked as `sam3-aoti pull` checks it) once per machine: the
    first actor of a machine pulls it under a lock, the others (and later runs) find it there. Its sha256 must be
    the one the run started with (`spec["sha256"]`): a ref moved mid-run is refused, not mixed into one
    dataset."""
    from ..cache.binary_cache import pull_once
    from ..cache.signing import trusted_keys

    folder = pull_once(spec["cache"], spec["ref"], pulled_packages(), trusted_keys(spec["trusted"]))
    if folder.name != spec["sha256"]:
        raise PackageError(f"ref {spec['ref']} moved to {folder.name[:12]} during the run (it began with "
                           f"{spec['sha256'][:12]}): run again to segment with the new package")
    return folder / "sam3.pt2"


class Segmenter:
    """`Segmenter(package, prompts)(batch)`: `batch` has `source`, `pixels`, `width`, `height`, `error` columns
    (`decode_batch`); the result has `source`, `width`, `height`, `error`, `seconds` and `instances` (a list per
    image of `schemas.INSTANCE_FIELDS`). `package`: a path (checked against `sha256` or the `.sha256` beside it), or
    `{"cache", "ref", "trusted", "sha256"}` (pulled on each machine). Exemplar `boxes` (pixel corners,
    `labels` 1 or 0) are drawn on the image `boxes_on` (whose bytes must have `boxes_on_sha256`, when given) and
    searched for in every image. On a GPU the model replays a CUDA graph per batch shape, batches short of
    `batch_size` padded to it."""

    def __init__(self, package, prompts=(), threshold: float = 0.5, boxes=(), labels=(), boxes_on: str | None = None,
                 sha256: str | None = None, trust: bool = False, boxes_on_sha256: str | None = None,
                 batch_size: int | None = None):
        import torch

        from ..runtime.contract import VISUAL_PROMPT
        from ..runtime.exemplars import normalized_boxes
        from ..runtime.inference import encode_exemplars, package_device
        from ..runtime.loader import load_package
        from .sources import decode

        t0 = time.perf_counter()
        if isinstance(package, dict):  # checked against the digest the signed ref named, not the file beside it
            path, sha256 = pulled_package(package), package["sha256"]
        else:
            path = Path(package)
        self.package = load_package(path, trust=trust, sha256=sha256)
        self.startup_s = {"load_package": round(time.perf_counter() - t0, 2)}  # where an actor's start goes
        self.device = package_device(self.package.metadata)
        self.prompts = list(prompts) or [VISUAL_PROMPT]
        self.masks_stream = None  # where the masks are made: the current stream
        # Where the model replays a CUDA graph per batch shape, a batch short of `batch_size` (a file that did not
        # decode, the last batch) is padded to it: one graph serves every batch, where each new count would cost a
        # capture (a run of the model and its recording) in the middle of the run.
        self.pad_to = batch_size if self.package.cuda_graphs == "on" else None
        self.threshold = threshold
        self.exemplars = None
        t0 = time.perf_counter()
        with torch.inference_mode():
            self.token_ids = self.package.encode_prompts(self.prompts).to(self.device)
            if boxes:
                drawn_on = decode(boxes_on, boxes_on_sha256)
                normalized = normalized_boxes(list(boxes), list(labels), drawn_on.shape[1], drawn_on.shape[0])
                self.exemplars = encode_exemplars(self.package, normalized, drawn_on, self.device)
        self.startup_s["prompts_and_exemplars"] = round(time.perf_counter() - t0, 2)
        log.info("segment actor ready: %s", ", ".join(f"{k} {v} s" for k, v in self.startup_s.items()))

    def __call__(self, batch):
        """`batch`: `decode_batch`'s table (its pixels are then read where Ray's object store holds them, uncopied)
        or a dict of its columns."""
        from ..runtime.postprocess import waited

        return waited(self.steps(batch))

    def steps(self, batch):
        """The call in steps: a generator that yields each CUDA event the call must wait for and returns its table
        (`postprocess.batch_instances_steps`)."""
        import warnings

        import torch

        from ..runtime.inference import run_prompts
        from ..runtime.postprocess import batch_instances_steps, transformed

        t0 = time.perf_counter()
        sources, widths, heights, errors, pixel_bytes = columns_of(batch)
        sizes = [(int(h), int(w)) for h, w in zip(heights, widths)]
        good = [i for i, error in enumerate(errors) if not error]
        found = {}
        if good:
            with torch.inference_mode(), warnings.catch_warnings():
                # the decoded bytes, read in place (never written: they are copied to the device, or into floats)
                warnings.filterwarnings("ignore", "The given buffer is not writable")
                pixels = transformed(self.package.transforms, [pixels_in_place(pixel_bytes[i], *sizes[i])
                                                               for i in good], self.device)
                outputs = run_prompts(self.package, padded(pixels, self.pad_to), self.token_ids, self.exemplars)
                outputs = tuple(o[:len(good) * len(self.token_ids)] for o in outputs)  # the padding's pairs left out
            kept = yield from batch_instances_steps(outputs, self.prompts, [sizes[i] for i in good], self.threshold,
                                                    self.masks_stream)
            for i, image in zip(good, kept):
                found[i] = [{"prompt": inst.prompt, "query": inst.query, "score": inst.score,
                             "box_xyxy": list(inst.box_xyxy), "mask_area": inst.area, "mask_bits": inst.bits.tobytes()}
                            for inst in image]
        return found_table(sources, sizes, errors, found, (time.perf_counter() - t0) / max(len(good), 1))


def found_table(sources, sizes: list, errors, found: dict, seconds: float):
    """The rows of a call (`schemas.found_schema`): each image's source, size, error, the call's seconds an image
    (0 for an image that failed) and the instances found in it (`found`, by the image's index)."""
    import pyarrow as pa

    return pa.Table.from_pydict({
        "source": [str(s) for s in sources], "width": [w for _, w in sizes],
        "height": [h for h, _ in sizes], "error": [str(e) for e in errors],
        "seconds": [seconds if i in found else 0.0 for i in range(len(sizes))],
        "instances": [found.get(i, []) for i in range(len(sizes))]}, schema=found_schema())


def padded(pixels, size: int | None):
    """`pixels [N, 3, S, S]` with zero images after them up to `size` (as they are when N is not below it)."""
    import torch

    if not size or pixels.shape[0] >= size:
        return pixels
    return torch.cat([pixels, pixels.new_zeros((size - pixels.shape[0], *pixels.shape[1:]))])


class OverlappingSegmenter(Segmenter):
    """`Segmenter` for Ray Data's GPU actors, whose calls overlap: each is a coroutine (Ray Data runs an actor's
    coroutines on one event loop) that gives way while its batch is on the GPU, so with two calls in flight the
    next batch's pixels are staged and its model queued while this one's runs, and the GPU does not wait for the
    actor's Python between batches. The masks of a batch are made on a stream of their own, not behind the next
    batch's model. The same rows as `Segmenter`'s."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        if self.device == "cuda":
            import torch

            self.masks_stream = torch.cuda.Stream()

    async def __call__(self, batch):
        yield await awaited(self.steps(batch))


async def awaited(steps, poll_s: float = 0.0005):
    """What a generator of steps (`Segmenter.steps`) returns, giving way to the event loop until each event it
    yields has fired."""
    import asyncio

    try:
        event = next(steps)
        while True:
            while not event.query():
                await asyncio.sleep(poll_s)
            event = steps.send(None)
    except StopIteration as done:
        return done.value
