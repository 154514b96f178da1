"""Stage `parity` (on request): our package against Meta's own SAM3 implementation (the `sam3` package).

The profile's weights are written in Meta's format (`sam3.pt`, through `model.meta_keys.to_meta`) and
loaded by Meta's own builder; our converter must read that file back to the very same tensors. Then, on
the cases' photographs and prompts, the package and Meta's model see the same pixels: their outputs are
compared query by query. An fp32 build meets Meta's model in full fp32 (Meta's import turns TF32 on, this
stage turns it off again); a bf16 build meets it as Meta runs it, under bf16 autocast with TF32 on. The
package's transforms are compared with Meta's Sam3Processor transform of the same photographs.
Meta's code needs CUDA, triton and torchvision, so this runs where those are (the H200).
"""

from __future__ import annotations

import logging
import time

from ..errors import ConfigError, DriftError
from ..model.meta import meta_model, meta_outputs, meta_pixels, write_meta_checkpoint
from ..pipeline.artifacts import record
from ..pipeline.paths import ProfilePaths
from ..pipeline.parity_checks import case_row, check, pixel_difference
from ..pipeline.report import Check, Report, Table, summarize, write_report
from ..pipeline.settings import Settings, package_version

log = logging.getLogger(__spec__.name)  # not __name__: run by `python -m`, a stage is "__main__"


def run(settings: Settings) -> None:
    import torch

    from ..pipeline.cases import load_cases
    from ..runtime.loader import load_package
    from ..runtime.postprocess import to_tensor

    if settings.device != "cuda" or settings.architecture != "full":
        raise ConfigError("parity compares the full model on a GPU with Meta's: use profile=sam3 device=cuda")
    paths, tolerances = ProfilePaths.of(settings), settings.stage("parity")["tolerances"][settings.spec.tolerances]
    t0 = time.perf_counter()
    write_meta_checkpoint(settings)
    model = meta_model(settings)
    package = load_package(paths.package)
    log.info("Meta's model and the package loaded in %.1f s", time.perf_counter() - t0)
    rows = []
    with torch.inference_mode():
        for case in load_cases():
            image = case.load_image()
            pixels = package.transforms(to_tensor(image, settings.device))
            ids = package.encode_prompts(case.prompts).to(settings.device)
            boxes = tuple(t.to(settings.device) for t in case.exemplars(image.shape[1], image.shape[0])) \
                if case.boxes else None
            ours = package.model_with_boxes(pixels, ids, *boxes) if boxes else package.model(pixels, ids)
            theirs = meta_outputs(model, pixels, case.prompts, settings.device, settings.spec.parity, boxes)
            row = case_row(case, ours, theirs, tolerances.get("mask_band", 0.0))
            rows.append({**row, **pixel_difference(pixels, meta_pixels(model, image, pixels.shape[-1], settings.device))})
    checks = check(rows, tolerances)
    for line in summarize(checks):
        (log.error if line.startswith("✗") else log.info)("%s", line)
    report = parity_report(settings, rows, checks, tolerances, package.metadata["versions"],
                           round(time.perf_counter() - t0, 1))
    write_report(report, paths.parity_json, paths.parity_md)
    record(paths.manifest, "parity", [paths.parity_json, paths.parity_md],
           {"passed": not report.failed, **settings.fingerprint("parity")})
    log.info("parity report %s", paths.parity_md)
    if report.failed:
        first = report.failed[0]
        raise DriftError(f"package differs from Meta's SAM3: {first.case} {first.metric} = {first.value} "
                         f"(limit {first.limit}), and {len(report.failed) - 1} more; see {paths.parity_md}")


def parity_report(settings: Settings, rows: list[dict], checks: list[Check], tolerances: dict, versions: dict,
                  seconds: float) -> Report:
    weights = "random init" if settings.weights == "random" else settings.weights
    how = {"plain": "fp32, TF32 off on both sides",
           "autocast": f"our {settings.precision} build vs Meta's model under bf16 autocast"}[settings.spec.parity]
    table = Table("Measured per case", ["case", "prompts", "top-1 same", "top-5 overlap", "score abs", "box abs",
                                        "mask IoU min", "logits max abs", "pixels: max levels, share differing"],
                  [[r["case"], ", ".join(r["prompts"]), f"{r['top1_same']:.0%}", f"{r['top5_overlap']:.2f}",
                    f"{r['score_abs']:.2e}", f"{r['matched_box_abs']:.2e}", f"{r['topk_mask_iou_min']:.4f}",
                    f"{r['pred_logits']['max_abs']:.2e}",
                    f"{r['pixels_max_levels']:.0f}, {r['pixels_differ']:.2%}" if "pixels_differ" in r else "-"]
                   for r in rows])
    date = time.strftime("%Y-%m-%d")
    return Report(f"Parity with Meta's SAM3 (sam3 {package_version('sam3')}; {settings.precision}; weights: {weights})",
                  [f"{date}: {how}. " + ", ".join(f"{k} {v}" for k, v in versions.items())], checks, [table],
                  data={"precision": settings.precision, "tolerances": tolerances, "cases": rows,
                        "weights": settings.weights, "random_weights": settings.weights == "random",
                        "meta_sam3": package_version("sam3"), "versions": versions, "date": date, "seconds": seconds})


if __name__ == "__main__":
    from ..pipeline.runner import main

    main("parity", run, __doc__.splitlines()[0])
