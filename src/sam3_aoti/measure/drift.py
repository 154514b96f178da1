"""A package against eager, measured and then gated: what `verify` decides on, and what the `fallback` stage
measures of the exported programs beside the compile (so verify, after it, reads them instead of loading them).

`measure_drift` runs every way each backend runs on every input verify compares (`model.reference`) and keeps
plain numbers (JSON); `gated` turns them into ✓/✗ rows under the tolerances of the day, so a tolerance changed
since the measurement still gates it.
"""

from __future__ import annotations

from ..pipeline.report import Check, Gate, apply_gates

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
TRANSFORMS_LIMIT = 1e-4


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


def expected_shapes(config, n: int) -> list[list[int]]:
    queries = config.detr_decoder_config.num_queries
    side = 4 * config.vision_config.backbone_config.image_size // config.vision_config.backbone_config.patch_size
    return [[n, queries, 1], [n, queries, 4], [n, queries, side, side], [n, 1]]


def ways_to_run(package) -> dict:
    """`model`, and for a split package its parts: whole, and with the prompts encoded and decoded in chunks
    of two (each must give model's outputs)."""
    if not package.parts:
        return {"": package.model}

    def chunked(images, token_ids):
        texts = [package.encode_text(token_ids[i:i + 2]) for i in range(0, token_ids.shape[0], 2)]
        return package.decode_chunked(package.encode_image(images), texts)

    return {"": package.model, " split": lambda images, token_ids: package.decode(
        package.encode_image(images), package.encode_text(token_ids)), " chunks": chunked}


def measure_drift(settings, backends: dict, eager, transforms, cases, cache) -> list[dict]:
    """Each backend (name -> a package, or exported programs behind its interface), each way it runs, on every
    input verify compares, against eager (`eager()`: the model, loaded only for an input the `reference` stage
    did not compute). One record per measurement: output shapes, a case's transforms, or a run's metrics."""
    import torch

    from ..model.checkpoints import checkpoint_config
    from ..model.reference import compared_inputs, eager_outputs
    from ..pipeline.metrics import compare

    band = settings.stage("verify")["tolerances"][settings.spec.tolerances].get("mask_band", 0.0)
    config = checkpoint_config(settings)
    ways = {backend: ways_to_run(pkg) for backend, pkg in backends.items()}
    records: list[dict] = []
    encode_prompts = next(iter(backends.values())).encode_prompts
    with torch.no_grad():
        for item in compared_inputs(settings, config, cases, encode_prompts, transforms, torch.device(settings.device)):
            reference = eager_outputs(cache, item, eager)
            if item.image is None:  # a sweep shape: every way of every backend, shapes first
                want = expected_shapes(config, item.inputs[0].shape[0] * item.inputs[1].shape[0])
                for backend, by_way in ways.items():
                    for how, run in by_way.items():
                        out = run(*item.inputs)
                        got = [list(o.shape) for o in out]
                        records.append({"backend": backend + how, "case": item.label, "shapes": got, "want": want})
                        if got == want:
                            records.append({"backend": backend + how, "case": item.label,
                                            "metrics": compare(out, reference, mask_band=band)})
                continue
            ref_images, token_ids, *boxes = item.inputs
            for backend, pkg in backends.items():
                images = pkg.transforms(item.image)
                records.append({"backend": backend, "case": item.label,
                                "transforms_max_abs": float((images - ref_images).abs().max())})
                runs = ({" boxes": lambda i, t, p=pkg: p.model_with_boxes(i, t, *boxes)} if item.with_boxes
                        else ways[backend])  # exemplars: through the parts (encode_image, encode_boxes, decode)
                for how, run in runs.items():
                    records.append({"backend": backend + how, "case": item.label,
                                    "metrics": compare(run(images, token_ids), reference, mask_band=band)})
    return records


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


def fallback_key(settings, fallback_sha256: str, cache) -> str:
    """What the fallback stage's numbers hold for: the fallback's bytes, verify's inputs (its shapes, the cases
    file), the mask band its IoU leaves out, and eager's identity (weights, model code, versions)."""
    import hashlib
    import json

    from ..pipeline.paths import DEFAULT_CASES
    from ..pipeline.settings import compared_shapes

    tol = settings.stage("verify")["tolerances"][settings.spec.tolerances]
    body = {"fallback": fallback_sha256, "inputs": compared_shapes(settings), "mask_band": tol.get("mask_band", 0.0),
            "cases": hashlib.sha256(DEFAULT_CASES.read_bytes()).hexdigest(), "eager": cache.identity}
    return hashlib.sha256(json.dumps(body, sort_keys=True).encode()).hexdigest()
