"""Drift metrics between two runs of the model (candidate vs eager reference), per output."""

from __future__ import annotations

import torch

from .model import OUTPUT_NAMES


def scores(outputs) -> torch.Tensor:
    """[N, Q] detection scores: sigmoid(logit) * sigmoid(presence)."""
    logits, _, _, presence = outputs
    return logits[..., 0].sigmoid() * presence.sigmoid()


def pearson(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().flatten(), b.double().flatten()
    a, b = a - a.mean(), b - b.mean()
    denom = a.norm() * b.norm()
    if denom == 0:  # constant outputs: agree only if identical
        return 1.0 if torch.equal(a, b) else 0.0
    return float((a @ b) / denom)


def top_k_overlap(a: torch.Tensor, b: torch.Tensor, k: int = 5) -> float:
    """Mean over pairs of |top-k(a) ∩ top-k(b)| / k, on [N, Q] scores."""
    k = min(k, a.shape[-1])
    ia, ib = a.topk(k, dim=-1).indices, b.topk(k, dim=-1).indices
    same = [len(set(x.tolist()) & set(y.tolist())) / k for x, y in zip(ia, ib)]
    return sum(same) / len(same)


def compare(candidate, reference) -> dict:
    """Per output max |diff| and pearson r, plus score-level agreement."""
    result = {
        name: {"max_abs": float((c.float() - r.float()).abs().max()), "pearson": pearson(c, r)}
        for name, c, r in zip(OUTPUT_NAMES, candidate, reference)
    }
    sc, sr = scores(candidate), scores(reference)
    result["top1_score_abs"] = float((sc.max(-1).values - sr.max(-1).values).abs().max())
    result["top5_overlap"] = top_k_overlap(sc, sr, 5)
    return result
