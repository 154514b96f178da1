"""Model outputs -> instances on the original image: scores, pixel boxes, full-size masks."""

from __future__ import annotations

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
    mask: np.ndarray | None  # bool HxW, or None where `runs` stand for it
    area: int  # the mask's pixels
    runs: np.ndarray | None = None  # COCO's run lengths of the mask (column-major, from a run of 0s)

    def as_json(self) -> dict:
        return {"prompt": self.prompt, "query": self.query, "score": round(self.score, 4),
                "box_xyxy": [round(v, 1) for v in self.box_xyxy], "mask_pixels": self.area}


MASK_BYTES = 1 << 28  # the most float32 memory full-size masks are resized in at once (64 of 1024 x 1024)


def instances(outputs, prompts: list[str], image_hw: tuple[int, int], image_index: int = 0,
              threshold: float = 0.5, top_k: int | None = None, as_runs: bool = False) -> list[Instance]:
    """Instances of one image across its prompts: score >= threshold, or the top_k best when given. The kept
    queries are picked, resized and brought to the host together (a wait for the device per image, not per
    instance); boxes are scaled in Python floats, as ever. `as_runs`: each mask as its run lengths, counted
    where the masks are (`column_runs`), instead of the whole mask."""
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
    step = max(1, MASK_BYTES // (4 * h * w))
    full_masks, runs, areas = [], [], []
    for i in range(0, len(query), step):
        chunk = F.interpolate(kept_masks[i:i + step, None].float(), size=(h, w), mode="bilinear")[:, 0] > 0
        if as_runs:
            chunk_runs, chunk_areas = column_runs(chunk)
            runs += chunk_runs
            areas += chunk_areas
        else:
            full_masks += list(chunk.cpu().numpy())
            areas += [int(m.sum()) for m in full_masks[-len(chunk):]]
    found = []
    for j, (p, q, score, (cx, cy, bw, bh)) in enumerate(zip(prompt_of.tolist(), query.tolist(),
                                                            s[prompt_of, query].tolist(),
                                                            boxes[picked_pairs, query].tolist())):
        box = ((cx - bw / 2) * w, (cy - bh / 2) * h, (cx + bw / 2) * w, (cy + bh / 2) * h)
        found.append(Instance(prompts[p], q, score, box, None if as_runs else full_masks[j], areas[j],
                              runs[j] if as_runs else None))
    return sorted(found, key=lambda i: -i.score)


def column_runs(masks) -> tuple[list, list]:
    """Boolean [K, H, W] masks (on any device) -> each mask's COCO run lengths (column-major, from a run of 0s,
    which may be empty) and its area, computed where the masks are: only the runs' ends cross to the host."""
    k = masks.shape[0]
    flat = masks.transpose(1, 2).reshape(k, -1)
    change_row, change_at = (flat[:, 1:] != flat[:, :-1]).nonzero().unbind(1)
    per_mask = torch.bincount(change_row, minlength=k).tolist()
    ends, first, areas = (change_at + 1).cpu().numpy(), flat[:, 0].tolist(), flat.sum(1).tolist()
    runs, start, size = [], 0, flat.shape[1]
    for i in range(k):
        edges = np.concatenate([[0], ends[start:start + per_mask[i]], [size]])
        start += per_mask[i]
        counts = np.diff(edges)
        runs.append(np.concatenate([[0], counts]) if first[i] else counts)
    return runs, [int(a) for a in areas]


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


def to_tensor(image: np.ndarray, device="cpu") -> torch.Tensor:
    """HxWx3 uint8 -> [1,3,H,W] float in [0, 255], the `transforms` input. The bytes go to the device as they
    are, a quarter of float32's, and become floats there."""
    return torch.from_numpy(image).to(device).permute(2, 0, 1)[None].float().contiguous()


def scores(outputs) -> torch.Tensor:
    """[N, Q] detection scores: sigmoid(logit) * sigmoid(presence)."""
    logits, _, _, presence = outputs
    return logits[..., 0].sigmoid() * presence.sigmoid()
