"""Model outputs -> instances on the original image: scores, pixel boxes, full-size masks."""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import numpy as np
import torch
import torch.nn.functional as F


@dataclass
class Instance:
    prompt: str
    query: int
    score: float
    box_xyxy: tuple[float, float, float, float]  # pixels of the original image
    mask: np.ndarray | None  # bool HxW, or None where `bits` stand for it
    area: int  # the mask's pixels
    bits: np.ndarray | None = None  # the mask packed into bits column by column (`pack_bits`), COCO's order

    def as_json(self) -> dict:
        return {"prompt": self.prompt, "query": self.query, "score": round(self.score, 4),
                "box_xyxy": [round(v, 1) for v in self.box_xyxy], "mask_pixels": self.area}


MASK_BYTES = 1 << 28  # the most float32 memory full-size masks are resized in at once (64 of 1024 x 1024)


def instances(outputs, prompts: list[str], image_hw: tuple[int, int], image_index: int = 0,
              threshold: float = 0.5, top_k: int | None = None) -> list[Instance]:
    """Instances of one image across its prompts: score >= threshold, or the top_k best when given. The kept
    queries are picked, resized and brought to the host together (a wait for the device per image, not per
    instance); boxes are scaled in Python floats, as ever."""
    h, w = image_hw
    _, boxes, masks, _ = outputs
    pairs = image_index * len(prompts) + torch.arange(len(prompts), device=boxes.device)
    s = scores(outputs)[pairs]  # [P, Q]
    if top_k:
        k = min(top_k, s.shape[1])
        prompt_of, query = torch.arange(len(prompts), device=s.device).repeat_interleave(k), s.topk(k).indices.flatten()
    else:
        prompt_of, query = (s >= threshold).nonzero().unbind(1)
    picked_pairs = pairs[prompt_of]
    kept_masks = masks[picked_pairs, query]
    full_masks = [m for chunk in resized(kept_masks, h, w) for m in chunk.cpu().numpy()]
    found = [Instance(prompts[p], q, score, pixel_box(box, h, w), full_masks[j], int(full_masks[j].sum()))
             for j, (p, q, score, box) in enumerate(zip(prompt_of.tolist(), query.tolist(),
                                                         s[prompt_of, query].tolist(),
                                                         boxes[picked_pairs, query].tolist()))]
    return sorted(found, key=lambda i: -i.score)


def batch_instances(outputs, prompts: list[str], sizes: list[tuple[int, int]],
                    threshold: float = 0.5) -> list[list[Instance]]:
    """`instances` of every image of a batch (image b holds the pairs b·P to b·P + P - 1; `sizes`: each image's
    (h, w)), each mask packed into bits (`Instance.bits`) instead of whole. One wait for the device, for the
    scores (which queries are kept); the masks are resized, thresholded and packed where they are, and come
    back with the boxes and areas in one copy: no wait per image or per instance (segment's model actor)."""
    return waited(batch_instances_steps(outputs, prompts, sizes, threshold))


def batch_instances_steps(outputs, prompts: list[str], sizes: list[tuple[int, int]], threshold: float = 0.5,
                          stream=None):
    """`batch_instances` in steps: a generator that yields each CUDA event it must wait for (two: the scores, then
    the masks; none off a GPU) and returns the instances, so that a caller can do other work at each wait
    (`waited` just waits). With `stream`, a CUDA stream, the device work runs there once the work queued so far
    on the current stream (the model's) is done, and so not behind what is queued on the current stream later (a
    next batch's model)."""
    _, boxes, masks, _ = outputs
    if stream is not None:
        stream.wait_stream(torch.cuda.current_stream(stream.device))
    with torch.inference_mode(), on_stream(stream):  # entered and left between waits, never across one
        s = scores(outputs)
        copying = to_host_started(s.float(), s >= threshold)
    if copying.event is not None:
        yield copying.event
    host_scores, keep = copying.arrays()
    pair, query = np.nonzero(keep)  # row-major: by image, then prompt, then query, as `instances` finds them
    with torch.inference_mode(), on_stream(stream):
        on_device = to_device(torch.from_numpy(np.stack([pair, query])), masks.device)  # the one upload
        bits, areas, per = [], [], len(prompts)
        starts = np.searchsorted(pair, np.arange(len(sizes) + 1) * per)  # each image's kept queries: a range
        for b, (h, w) in enumerate(sizes):
            mine = on_device[:, starts[b]:starts[b + 1]]
            for chunk in resized(masks[mine[0], mine[1]], h, w):
                columns = chunk.transpose(1, 2).flatten(1)  # column-major, as COCO counts
                areas.append(columns.sum(1))
                bits.append(pack_bits(columns).flatten())
        copying = to_host_started(boxes[on_device[0], on_device[1]].float(), cat(areas, torch.int64),
                                  cat(bits, torch.uint8))
    if copying.event is not None:
        yield copying.event
    host_boxes, host_areas, host_bits = copying.arrays()
    found: list[list[Instance]] = [[] for _ in sizes]
    at = 0
    for j, (p, q) in enumerate(zip(pair.tolist(), query.tolist())):
        h, w = sizes[p // per]
        size = -(-h * w // 8)
        found[p // per].append(Instance(prompts[p % per], q, host_scores[p, q].item(),
                                         pixel_box(host_boxes[j].tolist(), h, w), None, int(host_areas[j]),
                                         host_bits[at:at + size]))
        at += size
    return [sorted(image, key=lambda i: -i.score) for image in found]


def waited(steps):
    """What a generator of steps (`batch_instances_steps`) returns, waiting on the host for each event it yields."""
    try:
        event = next(steps)
        while True:
            event.synchronize()
            event = steps.send(None)
    except StopIteration as done:
        return done.value


def on_stream(stream):
    """`torch.cuda.stream(stream)`, or nothing for None."""
    return torch.cuda.stream(stream) if stream is not None else contextlib.nullcontext()


def resized(masks, h: int, w: int):
    """Mask logits [K, h', w'] resized to the image (bilinear) and thresholded, as bool [k, h, w] chunks of at most
    MASK_BYTES of float32 each."""
    step = max(1, MASK_BYTES // (4 * h * w))
    for i in range(0, masks.shape[0], step):
        yield F.interpolate(masks[i:i + step, None].float(), size=(h, w), mode="bilinear")[:, 0] > 0


def pixel_box(box, h: int, w: int) -> tuple[float, float, float, float]:
    """A normalized (cx, cy, w, h) box as pixel corners (x0, y0, x1, y1), in Python floats."""
    cx, cy, bw, bh = box
    return (cx - bw / 2) * w, (cy - bh / 2) * h, (cx + bw / 2) * w, (cy + bh / 2) * h


def pack_bits(rows) -> torch.Tensor:
    """Bool [K, N] -> uint8 [K, ceil(N / 8)], eight values a byte, the first in the high bit (numpy.packbits'
    order; the last byte padded with 0s): an eighth of the bytes to bring back."""
    k, n = rows.shape
    eights = F.pad(rows.to(torch.uint8), (0, -n % 8)).view(k, -1, 8)
    shifts = torch.arange(7, -1, -1, dtype=torch.uint8, device=rows.device)  # made there: no upload, no wait
    return (eights << shifts).sum(-1, dtype=torch.uint8)


def cat(tensors: list, dtype) -> torch.Tensor:
    return torch.cat(tensors) if tensors else torch.zeros(0, dtype=dtype)


NUMPY_TYPES = {torch.float32: np.float32, torch.int64: np.int64, torch.uint8: np.uint8, torch.bool: np.bool_}


def to_host(*tensors) -> list[np.ndarray]:
    """Tensors of one device as numpy arrays, brought to the host in one copy (`to_host_started`), waited for."""
    copying = to_host_started(*tensors)
    if copying.event is not None:
        copying.event.synchronize()
    return copying.arrays()


class OnTheWay:
    """Tensors on their way to the host in one copy: once `event` has fired (None: they are there already),
    `arrays()` gives them as numpy arrays."""

    def __init__(self, tensors, host, event):
        self.tensors, self.host, self.event = tensors, host, event

    def arrays(self) -> list[np.ndarray]:
        arrays, at = [], 0
        for t in self.tensors:
            size = t.numel() * t.element_size()
            arrays.append(self.host[at:at + size].numpy().view(NUMPY_TYPES[t.dtype]).reshape(tuple(t.shape)))
            at += size
        return arrays


def to_host_started(*tensors) -> OnTheWay:
    """Tensors of one device, copied to the host in one copy, not waited for. On a GPU the copy lands in pinned
    memory and its event is recorded after it on the current stream: a wait on it is for the work queued before
    it there, not for what was queued since (in segment's actor, the next batch's model)."""
    raw = [t.contiguous().flatten().view(torch.uint8) for t in tensors]
    device = next((t.device for t in tensors if t.numel()), torch.device("cpu"))  # an empty one may be the CPU's
    flat = torch.cat([r.to(device) for r in raw])
    if not flat.is_cuda:
        return OnTheWay(tensors, flat, None)
    host = torch.empty(flat.shape, dtype=torch.uint8, pin_memory=True).copy_(flat, non_blocking=True)
    copied = torch.cuda.Event()
    copied.record()
    return OnTheWay(tensors, host, copied)


PALETTE = np.array([(230, 25, 75), (60, 180, 75), (0, 130, 200), (245, 130, 48), (145, 30, 180),
                    (70, 240, 240), (240, 50, 230), (210, 245, 60)], dtype=np.float32)


def overlay(image: np.ndarray, found: list[Instance], title: str, exemplars=()):
    """An RGB PIL image: masks tinted, boxes drawn, one label per instance; `exemplars` (pixel corners, label),
    the boxes the prompt gave, apart from the detections: white (positive) or black (negative), thick, each
    marked "+" or "-" inside its top left corner."""
    from PIL import Image, ImageDraw

    canvas = image.astype(np.float32).copy()
    for i, inst in enumerate(found):
        canvas[inst.mask] = 0.5 * canvas[inst.mask] + 0.5 * PALETTE[i % len(PALETTE)]
    picture = Image.fromarray(canvas.clip(0, 255).astype(np.uint8))
    draw = ImageDraw.Draw(picture)
    for i, inst in enumerate(found):
        color = tuple(int(c) for c in PALETTE[i % len(PALETTE)])
        draw.rectangle(inst.box_xyxy, outline=color, width=2)
        x, y = inst.box_xyxy[0], max(inst.box_xyxy[1] - 12, 0)
        draw.text((x + 2, y), f"{inst.prompt} {inst.score:.2f}", fill=color)
    for corners, label in exemplars:
        color = (255, 255, 255) if label else (0, 0, 0)
        draw.rectangle(corners, outline=(128, 128, 128), width=5)
        draw.rectangle(corners, outline=color, width=3)
        draw.text((corners[0] + 5, corners[1] + 4), "+" if label else "-", fill=color)
    draw.rectangle((0, 0, picture.width, 14), fill=(0, 0, 0))
    draw.text((3, 1), title, fill=(255, 255, 255))
    return picture


def to_device(tensor: torch.Tensor, device) -> torch.Tensor:
    """A CPU tensor on `device`. To a GPU through pinned memory, copied without a wait: a copy from pageable memory
    first waits for everything queued on the stream (in segment's actor, the other batch's model). The pinned
    block is torch's cached one, reused once the copy is done."""
    if torch.device(device).type != "cuda":
        return tensor.to(device)
    pinned = torch.empty(tensor.shape, dtype=tensor.dtype, pin_memory=True)
    return pinned.copy_(tensor).to(device, non_blocking=True)


def to_tensor(image, device="cpu") -> torch.Tensor:
    """HxWx3 uint8 (a numpy array or a tensor) -> [1,3,H,W] float in [0, 255], the `transforms` input. The bytes
    go to the device as they are (`to_device`), a quarter of float32's, and become floats there."""
    pixels = torch.from_numpy(image) if isinstance(image, np.ndarray) else image
    return to_device(pixels, device).permute(2, 0, 1)[None].float().contiguous()


def transformed(transforms, images: list, device="cpu") -> torch.Tensor:
    """`[N, 3, S, S]`: `transforms` (the package's) of each HxWx3 uint8 tensor of `images`, in their order, with
    one copy to the device and one call per size: a batch of tiles of one size is one call, not one per tile.
    Each image's result is the one it gets alone (the transforms work image by image)."""
    by_size: dict[tuple, list[int]] = {}
    for index, image in enumerate(images):
        by_size.setdefault(tuple(image.shape), []).append(index)
    results: list = [None] * len(images)
    for size, indices in by_size.items():
        if torch.device(device).type == "cuda":  # one pinned block, one copy (`to_device`)
            stacked = torch.empty((len(indices), *size), dtype=torch.uint8, pin_memory=True)
            for row, index in enumerate(indices):
                stacked[row].copy_(images[index])
            on_device = stacked.to(device, non_blocking=True)
        else:
            on_device = torch.stack([images[index] for index in indices]).to(device)
        out = transforms(on_device.permute(0, 3, 1, 2).float().contiguous())
        for row, index in enumerate(indices):
            results[index] = out[row:row + 1]
    return torch.cat(results)


def scores(outputs) -> torch.Tensor:
    """[N, Q] detection scores: sigmoid(logit) * sigmoid(presence)."""
    logits, _, _, presence = outputs
    return logits[..., 0].sigmoid() * presence.sigmoid()
