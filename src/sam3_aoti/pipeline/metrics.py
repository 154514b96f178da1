"""Drift metrics between two runs of the model (candidate vs eager reference), per output."""

from __future__ import annotations

import torch

from ..runtime.contract import OUTPUT_NAMES
from ..runtime.postprocess import scores


def pearson(a: torch.Tensor, b: torch.Tensor) -> float:
    a, b = a.double().flatten(), b.double().flatten()
    a, b = a - a.mean(), b - b.mean()
    denom = a.norm() * b.norm()
    if denom == 0:  # constant outputs: agree only if identical
        return 1.0 if torch.equal(a, b) else 0.0
    return float((a @ b) / denom)


def top_k_overlap(a: torch.Tensor, b: torch.Tensor, k: int = 5) -> float:
    """The worst pair's |top-k(a) ∩ top-k(b)| / k, on [N, Q] scores: a mean would let a few pairs with
    entirely different top-k sets hide among many good ones."""
    k = min(k, a.shape[-1])
    ia, ib = a.topk(k, dim=-1).indices, b.topk(k, dim=-1).indices
    return min(len(set(x.tolist()) & set(y.tolist())) / k for x, y in zip(ia, ib))


def mask_iou(a: torch.Tensor, b: torch.Tensor, band: float = 0.0) -> torch.Tensor:
    """IoU of masks thresholded at logit 0 over the last two dims; two empty masks agree (IoU 1).
    Pixels whose reference logit `b` lies within ±band of 0 are left out: the reference itself has not
    decided them, and float noise far below the max |diff| gate flips them (random tiny weights give
    logits of 1e-4, so a 100-pixel mask loses 1 % of IoU to one such pixel)."""
    decided = b.abs() >= band  # band 0: every pixel
    a, b = (a > 0) & decided, (b > 0) & decided
    inter, union = (a & b).sum((-2, -1)).float(), (a | b).sum((-2, -1)).float()
    return torch.where(union > 0, inter / union.clamp(min=1), torch.ones_like(union))


def compare(candidate, reference, k: int = 5, mask_band: float = 0.0) -> dict:
    """Per output max |diff|, pearson r and the reference's own max |value| (for relative limits), plus
    agreement on the reference's top-k queries of each pair: top-1 score, top-k index overlap, matched-query
    box max |diff| and worst mask IoU (see `mask_iou`)."""
    result = {
        name: {"max_abs": float((c.float() - r.float()).abs().max()), "pearson": pearson(c, r),
               "ref_max_abs": float(r.float().abs().max())}
        for name, c, r in zip(OUTPUT_NAMES, candidate, reference)
    }
    sc, sr = scores(candidate), scores(reference)
    result["top1_score_abs"] = float((sc.max(-1).values - sr.max(-1).values).abs().max())
    result["top5_overlap"] = top_k_overlap(sc, sr, k)
    top = sr.topk(min(k, sr.shape[-1]), dim=-1).indices  # [N, k], the reference's best queries
    pick = lambda t: torch.gather(t, 1, top.view(*top.shape, *[1] * (t.dim() - 2)).expand(-1, -1, *t.shape[2:]))
    result["matched_box_abs"] = float((pick(candidate[1]) - pick(reference[1])).abs().max())
    result["topk_mask_iou_min"] = float(mask_iou(pick(candidate[2]), pick(reference[2]), mask_band).min())
    return result
