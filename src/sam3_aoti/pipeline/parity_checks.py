"""The comparison of a package's outputs with Meta's SAM3, case by case, and its gates: what `parity` reports
and scripts/checks/parity_eager.py applies to an eager recipe."""

from __future__ import annotations

import logging

from .report import Check, Gate, apply_gates

log = logging.getLogger(__name__)


def pixel_difference(ours, theirs) -> dict:
    """Our transforms against Meta's, in uint8 levels (one level is 2/255 after normalizing)."""
    diff = (ours.float() - theirs.float()).abs() * 127.5
    return {"pixels_max_levels": round(float(diff.max()), 3), "pixels_differ": float((diff > 1e-3).float().mean())}


def case_row(case, ours, theirs, mask_band: float = 0.0) -> dict:
    """One case's comparison with Meta's outputs (verify's metrics plus every query's score and the share of
    pairs whose top-1 query is the same)."""
    from .metrics import compare
    from ..runtime.postprocess import scores

    row = {"case": case.name, "prompts": list(case.prompts), **compare(ours, theirs, mask_band=mask_band),
           "score_abs": float((scores(ours) - scores(theirs)).abs().max()),
           "top1_same": float((scores(ours).argmax(-1) == scores(theirs).argmax(-1)).float().mean())}
    log.info("%s: top-1 same %.0f%%, score |diff| %.2e, logits |diff| %.2e, box |diff| %.2e, mask IoU %.4f", case.name,
             100 * row["top1_same"], row["score_abs"], row["pred_logits"]["max_abs"], row["matched_box_abs"],
             row["topk_mask_iou_min"])
    return row


# (gate on a metric of case_row / pixel_difference, its tolerance key)
PARITY_GATES = [
    (Gate("top-1 query same (share of pairs)", "top1_same", ">="), "top1_same_min"),
    (Gate("score |diff| (every query)", "score_abs", "<="), "score_abs"),
    (Gate("top-5 matched box max|diff|", "matched_box_abs", "<="), "box_abs"),
    (Gate("top-5 index overlap (worst pair)", "top5_overlap", ">="), "top5_overlap_min"),
    (Gate("top-5 mask IoU (min)", "topk_mask_iou_min", ">="), "mask_iou_min"),
    (Gate("transforms vs Sam3Processor (levels)", "pixels_max_levels", "<="), "pixels_max_levels"),
]


def check(rows: list[dict], tolerances: dict) -> list[Check]:
    """Every case through the parity gate table (a case without a pixel comparison skips that gate)."""
    gates = [(gate, tolerances[key]) for gate, key in PARITY_GATES]
    return [c for row in rows
            for c in apply_gates(row, [(g, t) for g, t in gates if g.key in row], "vs Meta", row["case"])]
