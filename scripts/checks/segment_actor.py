"""Where a `segment` actor's time goes, without Ray: the package loaded as an actor loads it, a collection like `doit
throughput`'s decoded as the CPU tasks decode it (Arrow batches, as Ray hands them on), then each batch through the
actor's `OverlappingSegmenter`: one call at a time, two calls overlapping on an event loop (as segment's GPU actors
run them; their rows checked equal), and one at a time with its steps timed apart (the device synchronized around
each): pixels to the device and through `transforms` (one call per size), the model, the masks (select, resize,
threshold, pack into bits, one copy back), the batch's columns, the pixel views, the padding and the rows' Arrow
table, and the rest (the call's own Python). Then the CPU stage after the actor (`encode_masks`: bits to COCO
counts) on one core. Writes segment-actor.json and prints a table.

Usage: python scripts/checks/segment_actor.py PACKAGE [--images 64] [--batch 16] [--prompt "a person"] [--out DIR]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import sys
import tempfile
import time
from collections import defaultdict
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))


def timed_steps(device: str, totals: dict):
    """Wrap the functions `Segmenter.__call__` reaches for, each timed with the device synchronized."""
    import torch

    from sam3_aoti.batch import worker
    from sam3_aoti.runtime import inference, postprocess

    def synchronized():
        if device == "cuda":
            torch.cuda.synchronize()
        return time.perf_counter()

    def wrap(owner, name, step):
        original = getattr(owner, name)

        def timed(*args, **kwargs):
            t0 = synchronized()
            out = original(*args, **kwargs)
            totals[step] += synchronized() - t0
            return out

        def timed_steps(*args, **kwargs):  # a generator of steps (`batch_instances_steps`): timed to its end
            t0 = synchronized()
            out = yield from original(*args, **kwargs)
            totals[step] += synchronized() - t0
            return out
        setattr(owner, name, timed_steps if name.endswith("_steps") else timed)
        return lambda: setattr(owner, name, original)

    return [wrap(worker, "columns_of", "the batch's columns (Arrow to Python, pixels as views)"),
            wrap(worker, "pixels_in_place", "each image's bytes as a tensor"),
            wrap(postprocess, "transformed", "pixels to the device and transformed"),
            wrap(worker, "padded", "the batch padded to its graph's size"),
            wrap(inference, "run_prompts", "model"),
            wrap(postprocess, "batch_instances_steps", "masks (select, resize, threshold, pack, one copy back)"),
            wrap(worker, "found_table", "the rows as an Arrow table")]


ROUNDS = 3  # passes over the batches a rate is measured on


async def overlapped(segmenter, batches: list, in_flight: int = 2) -> list:
    """Each batch through `segmenter` (an `OverlappingSegmenter`), `in_flight` calls under way at once on this event
    loop, as a Ray Data actor runs them; the tables in the batches' order."""
    gate = asyncio.Semaphore(in_flight)

    async def one(batch):
        async with gate:
            return [table async for table in segmenter(batch)][0]

    return await asyncio.gather(*(one(b) for b in batches))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("package", type=Path)
    parser.add_argument("--images", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--prompt", default="a person")
    parser.add_argument("--out", type=Path, default=Path("."))
    args = parser.parse_args()

    t0 = time.perf_counter()  # what an actor's process imports before it can load the package
    import torch

    from sam3_aoti.batch.worker import OverlappingSegmenter, Segmenter, decode_batch, encode_masks
    from sam3_aoti.measure.collection import write_collection
    import_s = time.perf_counter() - t0

    folder = Path(tempfile.mkdtemp(prefix="segment-actor-"))
    try:
        write_collection(folder, args.images, 1008, 4000, 0)
        sources = sorted(str(p) for p in folder.iterdir() if p.suffix in (".jpg", ".png"))
        t0 = time.perf_counter()
        decoded = decode_batch({"source": sources})
        decode_s = time.perf_counter() - t0
    finally:
        shutil.rmtree(folder, ignore_errors=True)
    t0 = time.perf_counter()
    if torch.cuda.is_available():
        torch.zeros(1, device="cuda")  # the CUDA context, apart from the load
    context_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    segmenter = OverlappingSegmenter(str(args.package), [args.prompt], batch_size=args.batch)  # as segment makes it
    load_s = time.perf_counter() - t0
    batches = [decoded.slice(i, args.batch) for i in range(0, len(sources), args.batch)]  # Arrow, as Ray hands them
    t0 = time.perf_counter()
    Segmenter.__call__(segmenter, batches[0])  # the first call captures the CUDA graph of the batch's shape
    first_call_s = time.perf_counter() - t0  # a part of segment's start-up, as the load is
    t0 = time.perf_counter()
    for _ in range(ROUNDS):
        found = [Segmenter.__call__(segmenter, b) for b in batches]
    as_run = (time.perf_counter() - t0) / (ROUNDS * len(sources))
    t0 = time.perf_counter()
    overlapping = asyncio.run(overlapped(segmenter, batches * ROUNDS))
    overlapped_s = (time.perf_counter() - t0) / (ROUNDS * len(sources))
    same_rows = len(overlapping) == ROUNDS * len(found) and all(  # every column but the call's own time
        a.drop_columns(["seconds"]).equals(b.drop_columns(["seconds"])) for a, b in zip(overlapping, found * ROUNDS))
    t0 = time.perf_counter()
    instances = sum(len(row) for table in found for row in encode_masks(table).column("instances").to_pylist())
    encode_s = (time.perf_counter() - t0) / len(sources)
    totals = defaultdict(float)
    restore = timed_steps("cuda" if "cuda" in str(segmenter.device) else "cpu", totals)
    try:
        t0 = time.perf_counter()
        for b in batches:
            Segmenter.__call__(segmenter, b)
        stepped = (time.perf_counter() - t0) / len(sources)
    finally:
        for undo in restore:
            undo()
    steps = {name: round(seconds / len(sources) * 1e3, 2) for name, seconds in totals.items()}
    steps["the rest (the call's own Python)"] = round(stepped * 1e3 - sum(steps.values()), 2)
    result = {"package": str(args.package), "images": len(sources), "batch": args.batch, "prompt": args.prompt,
              "instances": instances, "decode_ms_per_image_one_core": round(decode_s / len(sources) * 1e3, 1),
              "import_s": round(import_s, 2), "cuda_context_s": round(context_s, 2), "load_s": round(load_s, 2),
              "load_steps_s": segmenter.startup_s, "first_call_s": round(first_call_s, 2),
              "ms_per_image": round(as_run * 1e3, 2), "ms_per_image_overlapping": round(overlapped_s * 1e3, 2),
              "overlapping_gives_the_same_rows": same_rows,
              "encode_masks_ms_per_image_one_core": round(encode_s * 1e3, 2),
              "ms_per_image_with_steps_synchronized": round(stepped * 1e3, 2), "steps_ms_per_image": steps}
    args.out.mkdir(parents=True, exist_ok=True)
    (args.out / "segment-actor.json").write_text(json.dumps(result, indent=2) + "\n")
    print(f"{len(sources)} images ({instances} instances), batches of {args.batch}: {result['ms_per_image']} ms an "
          f"image one call at a time, {result['ms_per_image_overlapping']} with two calls overlapping (the same rows: "
          f"{same_rows}); decoding {result['decode_ms_per_image_one_core']} ms and the masks' COCO counts "
          f"{result['encode_masks_ms_per_image_one_core']} ms an image on one core; start: imports {import_s:.2f} s, "
          f"CUDA context {context_s:.2f} s, load {result['load_s']} s ({segmenter.startup_s}), first call "
          f"{result['first_call_s']} s")
    for name, ms in steps.items():
        print(f"  {name:55s} {ms:8.2f} ms an image")


if __name__ == "__main__":
    main()
