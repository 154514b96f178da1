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
    mask: np.ndarray  # bool HxW

    def as_json(self) -> dict:
        return {"prompt": self.prompt, "query": self.query, "score": round(self.score, 4),
                "box_xyxy": [round(v, 1) for v in self.box_xyxy], "mask_pixels": int(self.mask.sum())}


def instances(outputs, prompts: list[str], image_hw: tuple[int, int], image_index: int = 0,
              threshold: float = 0.5, top_k: int | None = None) -> list[Instance]:
    """Instances of one image across its prompts: score >= threshold, or the top_k best when given."""
    h, w = image_hw
    all_scores = scores(outputs)
    _, boxes, masks, _ = outputs
    found = []
    for p, prompt in enumerate(prompts):
        pair = image_index * len(prompts) + p
        s = all_scores[pair]
        picked = s.topk(min(top_k, s.numel())).indices if top_k else (s >= threshold).nonzero()[:, 0]
        for q in picked.tolist():
            cx, cy, bw, bh = boxes[pair, q].tolist()
            box = ((cx - bw / 2) * w, (cy - bh / 2) * h, (cx + bw / 2) * w, (cy + bh / 2) * h)
            mask = F.interpolate(masks[pair, q][None, None].float(), size=(h, w), mode="bilinear")[0, 0] > 0
            found.append(Instance(prompt, q, float(s[q]), box, mask.cpu().numpy()))
    return sorted(found, key=lambda i: -i.score)


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
    """HxWx3 uint8 -> [1,3,H,W] float in [0, 255], the `transforms` input."""
    return torch.from_numpy(image).permute(2, 0, 1)[None].float().contiguous().to(device)


def scores(outputs) -> torch.Tensor:
    """[N, Q] detection scores: sigmoid(logit) * sigmoid(presence)."""
    logits, _, _, presence = outputs
    return logits[..., 0].sigmoid() * presence.sigmoid()
