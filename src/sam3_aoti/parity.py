"""Stage `parity` (on request): our package against Meta's own SAM3 implementation (the `sam3` package).

The profile's weights are written in Meta's format (`sam3.pt`, through `meta_checkpoint.to_meta`) and
loaded by Meta's own builder; our converter must read that file back to the very same tensors. Then, on
the cases' photographs and prompts, the package and Meta's model see the same pixels: their outputs are
compared query by query (full fp32: Meta's import turns TF32 on, this stage turns it off again). The
package's transforms are compared with Meta's Sam3Processor transform of the same photographs.
Meta's code needs CUDA, triton and torchvision, so this runs where those are (the H200).
"""

from __future__ import annotations

import json
import logging
import time

from .artifacts import record, write_text_atomic
from .config import Settings, package_version
from .errors import ConfigError, DriftError
from .paths import ProfilePaths

log = logging.getLogger("sam3_aoti")
# Meta keys its builder computes itself or that transformers' Sam3Model has no use for.
NOT_IN_OUR_CHECKPOINT = ("freqs_cis", "geometry_encoder.points_")


def write_meta_checkpoint(settings: Settings):
    """The profile's weights as Meta's sam3.pt, and proof that our converter reads it back unchanged."""
    import torch
    from safetensors.torch import load_file

    from .meta_checkpoint import meta_state_dict, to_meta, to_transformers

    paths = ProfilePaths.of(settings)
    ours = load_file(paths.checkpoint / "model.safetensors")
    paths.meta_checkpoint.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"model": to_meta(ours)}, paths.meta_checkpoint)
    back, unknown = to_transformers(meta_state_dict(torch.load(paths.meta_checkpoint, weights_only=True, mmap=True)))
    same = not unknown and back.keys() == ours.keys() and all(torch.equal(back[k], ours[k]) for k in ours)
    if not same:
        raise DriftError(f"Meta-format round trip of {paths.checkpoint} changed tensors: fix meta_checkpoint.KEY_MAP")
    return ours


def meta_model(settings: Settings):
    """Meta's image model, built and loaded by Meta's own code from our sam3.pt, every tensor checked."""
    import torch

    try:
        from sam3.model_builder import build_sam3_image_model
    except ImportError as e:
        raise ConfigError(f"Meta's sam3 package is not importable ({e}): install sam3 (needs CUDA, triton, "
                          "torchvision) to run parity") from None
    from .tokenizer import bundled_vocab_path

    paths = ProfilePaths.of(settings)
    model = build_sam3_image_model(bpe_path=str(bundled_vocab_path()), device=settings.device, eval_mode=True,
                                   checkpoint_path=str(paths.meta_checkpoint), load_from_HF=False)
    torch.backends.cuda.matmul.allow_tf32 = False  # sam3 enables TF32 at import: compare in full fp32
    torch.backends.cudnn.allow_tf32 = False
    loaded = torch.load(paths.meta_checkpoint, weights_only=True, mmap=True)["model"]
    state = model.state_dict()
    not_loaded = [k for k in state if f"detector.{k}" not in loaded and not any(s in k for s in NOT_IN_OUR_CHECKPOINT)]
    differ = [k for k, v in loaded.items() if not torch.equal(state[k.removeprefix("detector.")].cpu(), v)]
    if not_loaded or differ:
        raise DriftError(f"Meta's model did not take our sam3.pt whole: {len(not_loaded)} tensors missing "
                         f"({not_loaded[:3]}), {len(differ)} different ({differ[:3]})")
    return model


def meta_outputs(model, pixels, prompts: list[str], device: str):
    """Meta's raw outputs for one image and each prompt, stacked like the package's (pair = prompt)."""
    import torch
    from sam3.model.data_misc import FindStage

    find = FindStage(img_ids=torch.tensor([0], device=device), text_ids=torch.tensor([0], device=device),
                     input_boxes=None, input_boxes_mask=None, input_boxes_label=None, input_points=None,
                     input_points_mask=None)
    image_out = model.backbone.forward_image(pixels)
    rows = []
    for prompt in prompts:
        backbone_out = {**image_out, **model.backbone.forward_text([prompt], device=device)}
        out = model.forward_grounding(backbone_out=backbone_out, find_input=find,
                                      geometric_prompt=model._get_dummy_prompt(), find_target=None)
        rows.append((out["pred_logits"], out["pred_boxes"], out["pred_masks"], out["presence_logit_dec"]))
    return tuple(torch.cat(parts) for parts in zip(*rows))


def run(settings: Settings) -> None:
    import torch

    from .cases import load_cases
    from .package import load_package
    from .postprocess import to_tensor

    if settings.device != "cuda" or settings.precision != "fp32" or settings.architecture != "full":
        raise ConfigError("parity compares the full model in fp32 on a GPU: use profile=sam3 device=cuda precision=fp32")
    paths, tolerances = ProfilePaths.of(settings), settings.stage("parity")["tolerances"]
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
            ours = package.model(pixels, package.encode_prompts(case.prompts).to(settings.device))
            row = case_row(case, ours, meta_outputs(model, pixels, case.prompts, settings.device))
            rows.append({**row, **pixel_difference(pixels, meta_pixels(model, image, pixels.shape[-1], settings.device))})
    failures = check(rows, tolerances)
    report = {"tolerances": tolerances, "cases": rows, "failures": failures, "passed": not failures,
              "weights": settings.weights, "random_weights": settings.weights == "random",
              "meta_sam3": package_version("sam3"), "versions": package.metadata["versions"],
              "date": time.strftime("%Y-%m-%d"), "seconds": round(time.perf_counter() - t0, 1)}
    write_text_atomic(paths.parity_json, json.dumps(report, indent=2) + "\n")
    write_text_atomic(paths.parity_md, markdown(report))
    record(paths.manifest, "parity", [paths.parity_json, paths.parity_md],
           {"passed": not failures, **settings.fingerprint("parity")})
    log.info("parity report %s", paths.parity_md)
    if failures:
        raise DriftError(f"package differs from Meta's SAM3: {failures[0]} (and {len(failures) - 1} more)")


def meta_pixels(model, image, size: int, device: str):
    """Meta's Sam3Processor transform of an HxWx3 uint8 image (resized as uint8, then normalized)."""
    import torch
    from sam3.model.sam3_image_processor import Sam3Processor

    processor = Sam3Processor(model, resolution=size, device=device)
    return processor.transform(torch.from_numpy(image).permute(2, 0, 1).to(device)).unsqueeze(0)


def pixel_difference(ours, theirs) -> dict:
    """Our transforms against Meta's, in uint8 levels (one level is 2/255 after normalizing)."""
    diff = (ours.float() - theirs.float()).abs() * 127.5
    return {"pixels_max_levels": round(float(diff.max()), 3), "pixels_differ": float((diff > 1e-3).float().mean())}


def case_row(case, ours, theirs) -> dict:
    """One case's comparison with Meta's outputs (verify's metrics plus every query's score and the top-1)."""
    from .metrics import compare, scores

    row = {"case": case.name, "prompts": list(case.prompts), **compare(ours, theirs),
           "score_abs": float((scores(ours) - scores(theirs)).abs().max()),
           "top1_same": bool((scores(ours).argmax(-1) == scores(theirs).argmax(-1)).all())}
    log.info("%s: top-1 same %s, score |diff| %.2e, logits |diff| %.2e, box |diff| %.2e, mask IoU %.4f", case.name,
             row["top1_same"], row["score_abs"], row["pred_logits"]["max_abs"], row["matched_box_abs"],
             row["topk_mask_iou_min"])
    return row


def check(rows: list[dict], tolerances: dict) -> list[str]:
    failures = []
    for row in rows:
        if not row["top1_same"]:
            failures.append(f"{row['case']}: top-1 query differs")
        for metric, limit, worse in [("score_abs", tolerances["score_abs"], lambda v, t: v > t),
                                     ("matched_box_abs", tolerances["box_abs"], lambda v, t: v > t),
                                     ("top5_overlap", tolerances["top5_overlap_min"], lambda v, t: v < t),
                                     ("topk_mask_iou_min", tolerances["mask_iou_min"], lambda v, t: v < t)]:
            if worse(row[metric], limit):
                failures.append(f"{row['case']}: {metric} {row[metric]:.3g} (limit {limit})")
        if row.get("pixels_max_levels", 0.0) > tolerances["pixels_max_levels"]:
            failures.append(f"{row['case']}: transforms differ from Meta's by {row['pixels_max_levels']:.3g} levels")
    return failures


def markdown(report: dict) -> str:
    weights = "random init" if report["random_weights"] else report["weights"]
    versions = ", ".join(f"{k} {v}" for k, v in report.get("versions", {}).items())
    lines = [f"# Parity with Meta's SAM3 (sam3 {report['meta_sam3']}; weights: {weights})", "",
             f"{report.get('date', '')}: {versions}", "",
             f"Verdict: {'pass' if report['passed'] else 'FAIL'}; tolerances {report['tolerances']}", "",
             "| case | prompts | top-1 same | top-5 overlap | score abs | box abs | mask IoU min | logits max abs "
             "| pixels: max levels, share differing |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in report["cases"]:
        pixels = f"{r['pixels_max_levels']:.0f}, {r['pixels_differ']:.2%}" if "pixels_differ" in r else "-"
        lines.append(f"| {r['case']} | {', '.join(r['prompts'])} | {'✓' if r['top1_same'] else '✗'} | "
                     f"{r['top5_overlap']:.2f} | {r['score_abs']:.2e} | {r['matched_box_abs']:.2e} | "
                     f"{r['topk_mask_iou_min']:.4f} | {r['pred_logits']['max_abs']:.2e} | {pixels} |")
    return "\n".join(lines + [""] + [f"- {f}" for f in report["failures"]]) + "\n"


if __name__ == "__main__":
    from .stage import main

    main("parity", run, __doc__.splitlines()[0])
