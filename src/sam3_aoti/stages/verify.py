"""Stage `verify`: may this package ship? AOTI (and its exported-program fallback) against eager.

Runs the dynamic-shape sweep on random inputs and every case on real photographs; each check is one
✓/✗ row in report.md / report.json, and any ✗ fails the task and leaves the package unverified.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor

from ..errors import DriftError
from ..model.reference import ReferenceCache, compared_inputs, eager_outputs, sweep_shapes
from ..pipeline.artifacts import mark, record
from ..pipeline.paths import ProfilePaths
from ..pipeline.report import Check, Gate, Report, apply_gates, margin, summarize, write_report
from ..pipeline.settings import Settings

log = logging.getLogger(__spec__.name)  # not __name__: run by `python -m`, a stage is "__main__"


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


def expected_shapes(config, n: int) -> list[tuple]:
    queries = config.detr_decoder_config.num_queries
    side = 4 * config.vision_config.backbone_config.image_size // config.vision_config.backbone_config.patch_size
    return [(n, queries, 1), (n, queries, 4), (n, queries, side, side), (n, 1)]


def run_checks(settings: Settings, package, fallback, eager, transforms, cases, cache) -> list[Check]:
    """Every row: the package and its fallback, each way they run, against eager (`eager()`: the model, loaded
    only for an input the `reference` stage did not compute)."""
    import torch

    from ..model.checkpoints import checkpoint_config
    from ..pipeline.metrics import compare

    opts = settings.stage("verify")
    tol = opts["tolerances"][settings.spec.tolerances]
    band = tol.get("mask_band", 0.0)
    config = checkpoint_config(settings)
    backends = {"aoti": package, "exported": fallback}
    ways = {backend: ways_to_run(pkg) for backend, pkg in backends.items()}
    runs = {f"{backend}{how}": run for backend, by_way in ways.items() for how, run in by_way.items()}
    rows: list[Check] = []
    with torch.no_grad():
        for item in compared_inputs(settings, config, cases, package.encode_prompts, transforms,
                                    torch.device(settings.device)):
            reference = eager_outputs(cache, item, eager)
            if item.image is None:  # a sweep shape: every way of every backend, shapes first
                want = expected_shapes(config, item.inputs[0].shape[0] * item.inputs[1].shape[0])
                for backend, run in runs.items():
                    out = run(*item.inputs)
                    got = [tuple(o.shape) for o in out]
                    rows.append(Check(backend, item.label, "output shapes", "match" if got == want else str(got),
                                      "as expected", got == want))
                    if got == want:
                        rows += gate(compare(out, reference, mask_band=band), tol, backend, item.label)
                continue
            ref_images, token_ids, *boxes = item.inputs
            for backend, pkg in backends.items():
                images = pkg.transforms(item.image)
                diff = float((images - ref_images).abs().max())
                rows.append(Check(backend, item.label, "transforms max|diff|", diff, "<= 1e-4", diff <= 1e-4))
                case_runs = ({" boxes": lambda i, t, p=pkg: p.model_with_boxes(i, t, *boxes)} if item.with_boxes
                        else ways[backend])  # exemplars: through the parts (encode_image, encode_boxes, decode)
                for how, run in case_runs.items():
                    rows += gate(compare(run(images, token_ids), reference, mask_band=band), tol, backend + how,
                                 item.label)
    return rows


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


def pictures(cases) -> list[tuple[str, str]]:
    """The PNGs `render` makes, by name, with captions."""
    figures = [("../render/scores.png", "AOTI vs eager score of every query of every case")]
    for case in cases:
        figures += [(f"../render/{case.name}.png", f"{case.name}: {', '.join(case.prompts)} (left eager, right AOTI)"),
                  (f"../render/{case.name}_mask_diff.png", f"{case.name}: top mask, |AOTI - eager| after sigmoid")]
    return figures


def verify_report(settings: Settings, paths: ProfilePaths, rows: list[Check], backends: dict, cases) -> Report:
    note = (f"Package `{paths.package.name}`, weights `{settings.weights}`"
            + (" (random init: outputs mean nothing, drift still does)" if settings.weights == "random" else "")
            + ". In the pictures, left of each case: eager transformers; right: the AOTI package."
            + (f" Reference: the {settings.spec.reference} model, so every row is the accuracy cost of "
               f"{settings.spec.summary}." if settings.spec.reference != settings.precision else ""))
    tolerances = settings.stage("verify")["tolerances"][settings.spec.tolerances]  # so a later change can re-gate it
    return Report(f"Verify: {settings.profile} ({settings.device}, {settings.precision})", [note], rows,
                  figures=pictures(cases), data={"backends": backends, "tolerances": tolerances})


def timed(what: str, load, *args):
    """`load(*args)`, its seconds logged: verify's wait before its first check is these loads."""
    import time

    t0 = time.perf_counter()
    value = load(*args)
    log.info("loaded %s in %.1f s", what, time.perf_counter() - t0)
    return value


def run(settings: Settings) -> None:
    import functools

    from ..model.checkpoints import eager_reference, reference_transforms
    from ..pipeline.cases import load_cases
    from ..runtime.loader import load_exported, load_package

    paths = ProfilePaths.of(settings)
    mark(paths.manifest, "verify", verified=False)  # until this run says otherwise, whatever stops it
    cases = load_cases()  # a broken case image fails here, not after the models loaded
    if settings.spec.strict_fp32:  # PyTorch runs cuDNN convolutions in TF32 by default: compare real fp32
        import torch

        torch.backends.cudnn.allow_tf32 = False
    with ThreadPoolExecutor(1) as loader:  # the fallback loads while the package loads
        exported = loader.submit(timed, "the exported fallback", load_exported, paths.package)
        package = timed("the package", load_package, paths.package)
        if package.fallback_reason:
            raise DriftError(f"the package's AOTI models do not load here ({package.fallback_reason}): "
                             f"rebuild with `uv run doit compile device={settings.device}`")
        fallback = package.exported_only(exported.result())
    log.info("%d sweep shapes, %d cases, backends %s", len(sweep_shapes(settings.stage("verify"))), len(cases),
             package.backends)
    cache = ReferenceCache.of(settings)
    eager = functools.cache(lambda: timed("the eager model", eager_reference, settings)[0])  # on a miss only
    rows = run_checks(settings, package, fallback, eager, reference_transforms(settings), cases, cache)
    log.info("eager reference: %d of %d from the reference cache", cache.hits, len(cache.used))
    cache.prune()
    for r in rows:
        log.debug("%s", r.line())
    for line in summarize(rows):
        (log.error if line.startswith("✗") else log.info)("%s", line)
    failed = [r for r in rows if not r.ok]
    write_report(verify_report(settings, paths, rows, package.backends, cases), paths.verify_report_json,
                 paths.verify_report_md, paths.verify_report_html)
    record(paths.manifest, "verify", [paths.verify_report_json, paths.verify_report_md, paths.verify_report_html], {
        "verified": not failed, "package_sha256": package.metadata.get("inputs_sha256"),
        **settings.fingerprint("verify"),
    })
    log.info("report: %s (with the pictures: %s)", paths.verify_report_md, paths.verify_report_html)
    if failed:
        worst = min(failed, key=margin)
        raise DriftError(f"{len(failed)}/{len(rows)} checks failed, worst: {worst.backend} {worst.case} "
                         f"{worst.metric} = {worst.value} (limit {worst.limit}); see {paths.verify_report_md}")


if __name__ == "__main__":
    from ..pipeline.runner import main

    main("verify", run, __doc__.splitlines()[0])
