"""verify's gates: `measure.drift`'s numbers as ✓/✗ rows under the tolerances of the day (pipeline.toml's
`[verify.tolerances.<precision>]`)."""

from __future__ import annotations

from .report import Check, Gate, apply_gates

# Pearson r only where it means something: the dense outputs. Boxes of a random model sit in a narrow range
# and presence is one scalar per (image, prompt), so their r is noise over near-equal values (H200, bf16:
# presence r = -0.5 over 3 prompts, |diff| <= 2.4e-4); max |diff| gates them.
PEARSON_OUTPUTS = ("pred_logits", "pred_masks")

# score-level checks: (gate on a metric of metrics.compare, its tolerance key)
SCORE_GATES = [
    (Gate("top-1 score |diff|", "top1_score_abs", "<="), "top1_score_abs"),
    (Gate("top-5 index overlap (worst pair)", "top5_overlap", ">="), "top5_overlap_min"),
    (Gate("top-5 matched box max|diff|", "matched_box_abs", "<="), "box_abs"),
    (Gate("top-5 mask IoU (min)", "topk_mask_iou_min", ">="), "mask_iou_min"),  # pixels with |ref logit| >= mask_band
]
TRANSFORMS_LIMIT = 1e-4  # the package's transforms against eager's, on a case's photograph


def output_limit(tol: dict, reference_max: float, name: str | None = None) -> float:
    """max |diff| allowed for one output: an absolute floor plus a share of the output's own magnitude, so a
    limit means the same for presence logits of 2e-4 (the tiny model) and mask logits of 20. An output's own
    table (`per_output.<name>`) overrides both: boxes, in pixels, want an absolute limit."""
    own = {**tol, **tol.get("per_output", {}).get(name, {})}
    return float(f"{own['max_abs'] + own.get('max_rel', 0.0) * reference_max:.3g}")


def gate(metrics: dict, tol: dict, backend: str, case: str) -> list[Check]:
    """One row per output (max |diff|), per dense output (pearson r) and per score-level metric."""
    from ..runtime.contract import OUTPUT_NAMES

    rows = [Gate(f"{name} max|diff|", "max_abs", "<=").check(
        metrics[name]["max_abs"], output_limit(tol, metrics[name].get("ref_max_abs", 0.0), name), backend, case)
        for name in OUTPUT_NAMES]
    rows += [Gate(f"{name} pearson r", "pearson", ">=").check(metrics[name]["pearson"], tol["pearson_min"], backend, case)
             for name in PEARSON_OUTPUTS]
    return rows + apply_gates(metrics, [(g, tol[key]) for g, key in SCORE_GATES], backend, case)


def gated(records: list[dict], tol: dict) -> list[Check]:
    """The ✓/✗ rows of `measure_drift`'s records under the tolerances `tol`."""
    rows: list[Check] = []
    for r in records:
        if "shapes" in r:
            ok = r["shapes"] == r["want"]
            rows.append(Check(r["backend"], r["case"], "output shapes",
                              "match" if ok else str([tuple(s) for s in r["shapes"]]), "as expected", ok))
        elif "transforms_max_abs" in r:
            diff = r["transforms_max_abs"]
            rows.append(Check(r["backend"], r["case"], "transforms max|diff|", diff, "<= 1e-4",
                              diff <= TRANSFORMS_LIMIT))
        else:
            rows += gate(r["metrics"], tol, r["backend"], r["case"])
    return rows
