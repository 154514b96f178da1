"""Exemplar boxes, SAM3's visual prompts: boxes drawn on an image, positive (find things like this) or negative
(not like this), beside a phrase or alone. People give them as pixel corners of the file; the package takes them
normalized (cx, cy, w, h) with labels, padded per image as transformers' `input_boxes_labels` (contract)."""

from __future__ import annotations

import math

from ..errors import InputError
from .contract import MAX_BOXES, NEGATIVE, PADDING, POSITIVE


def parse_box(text: str) -> tuple[float, float, float, float]:
    """`"X0,Y0,X1,Y1"` (pixels of the file) -> four numbers, or one line naming the box and the form."""
    parts = text.replace(" ", "").split(",")
    try:
        values = tuple(float(p) for p in parts)
    except ValueError:
        values = ()
    if len(values) != 4 or not all(map(math.isfinite, values)):
        raise InputError(f"box {text!r} is not X0,Y0,X1,Y1: give four finite numbers, pixels of the image, "
                         "comma-separated")
    return values


def check_corners(corners: list, width: int, height: int) -> None:
    """Pixel corners `[(x0, y0, x1, y1), ...]` of one image fit it, with one line naming a box that does not and
    the fix (torch-free: doit checks cases.toml with it at load)."""
    if not corners:
        raise InputError("no exemplar box given: pass at least one, or a phrase alone")
    if len(corners) > MAX_BOXES:
        raise InputError(f"{len(corners)} exemplar boxes: the package takes at most {MAX_BOXES} per image; "
                         "keep the most telling ones")
    for x0, y0, x1, y1 in corners:
        name = f"box {x0:g},{y0:g},{x1:g},{y1:g}"
        if not all(map(math.isfinite, (x0, y0, x1, y1))):  # NaN passes every comparison below
            raise InputError(f"{name} holds a coordinate that is not a finite number: give pixels of the image")
        if x1 < x0 or y1 < y0:
            raise InputError(f"{name} has its corners reversed: give X0,Y0 (top left) before X1,Y1 (bottom right)")
        if x1 == x0 or y1 == y0:
            raise InputError(f"{name} has no area: give a box at least a pixel wide and high")
        if x0 < 0 or y0 < 0 or x1 > width or y1 > height:
            raise InputError(f"{name} is outside the {width} x {height} image: give corners within 0..{width} "
                             f"and 0..{height}")


def normalized_boxes(corners: list, labels: list[int], width: int, height: int):
    """Pixel corners `[(x0, y0, x1, y1), ...]` of one image with their labels -> `boxes [1, K, 4]` (normalized cx,
    cy, w, h) and `labels [1, K]`, after checking each box fits the image (`check_corners`)."""
    import torch

    check_corners(corners, width, height)
    box = torch.tensor(corners, dtype=torch.float64)
    size = torch.tensor([width, height, width, height], dtype=torch.float64)
    x0, y0, x1, y1 = (box / size).unbind(-1)
    normalized = torch.stack([(x0 + x1) / 2, (y0 + y1) / 2, x1 - x0, y1 - y0], -1).float()
    return normalized[None], torch.tensor([labels], dtype=torch.long)


def check_boxes(boxes, labels, batch: int, device: str) -> None:
    """What `encode_boxes` takes, one line for anything else: float32 `[batch, K, 4]` normalized (cx, cy, w, h)
    inside the image, int64 labels `[batch, K]` of 1, 0 or -10, K from 1 to MAX_BOXES, on the package's device."""
    import torch

    if not (isinstance(boxes, torch.Tensor) and boxes.dtype == torch.float32 and boxes.dim() == 3
            and boxes.shape[-1] == 4 and boxes.device.type == device):
        raise InputError(f"boxes must be float32 [batch, boxes, 4] (normalized cx, cy, w, h) on {device}: "
                         "use exemplars.normalized_boxes for pixel corners")
    if not (isinstance(labels, torch.Tensor) and labels.dtype == torch.int64 and tuple(labels.shape) == boxes.shape[:2]
            and labels.device.type == device):
        raise InputError(f"box labels must be int64 [batch, boxes] ({tuple(boxes.shape[:2])}) on {device}")
    if boxes.shape[0] != batch:
        raise InputError(f"boxes are for {boxes.shape[0]} images, the features for {batch}: one row of boxes per image")
    if not 1 <= boxes.shape[1] <= MAX_BOXES:
        raise InputError(f"{boxes.shape[1]} boxes per image: the package takes 1 to {MAX_BOXES}")
    if not bool(torch.isin(labels, torch.tensor([POSITIVE, NEGATIVE, PADDING], device=labels.device)).all()):
        raise InputError(f"box labels must be {POSITIVE} (positive), {NEGATIVE} (negative) or {PADDING} (padding)")
    real = (labels != PADDING)[..., None].expand_as(boxes)
    cx, cy, w, h = boxes.unbind(-1)
    inside = (w > 0) & (h > 0) & (cx - w / 2 >= -1e-6) & (cy - h / 2 >= -1e-6) & (cx + w / 2 <= 1 + 1e-6) \
        & (cy + h / 2 <= 1 + 1e-6)
    if not bool(torch.isfinite(boxes).all()) or not bool(inside[real[..., 0]].all()):
        raise InputError("boxes must be normalized (cx, cy, w, h) inside the image, with w and h above 0 "
                         "(padding rows excepted)")
