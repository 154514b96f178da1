"""Stage `parity` (on request): our package against Meta's own SAM3 implementation (the `sam3` package).

The profile's weights are written in Meta's format (`sam3.pt`, through `meta_checkpoint.to_meta`) and
loaded by Meta's own builder; our converter must read that file back to the very same tensors. Then, on
the cases' photographs and prompts, the package and Meta's model see the same pixels: their outputs are
compared query by query. An fp32 build meets Meta's model in full fp32 (Meta's import turns TF32 on, this
stage turns it off again); a bf16 build meets it as Meta runs it, under bf16 autocast with TF32 on. The
package's transforms are compared with Meta's Sam3Processor transform of the same photographs.
Meta's code needs CUDA, triton and torchvision, so this runs where those are (the H200).
"""

from __future__ import annotations

import contextlib
import logging
import time

from .artifacts import record
from .config import Settings, package_version
from .errors import ConfigError, DriftError
from .paths import ProfilePaths
from .report import Check, Gate, Report, Table, apply_gates, summarize, write_report

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
    """Meta's image model, built and loaded by Meta's own code from our sam3.pt, every tensor checked. In fp32
    TF32 is turned off again (Meta's import turns it on); for bf16 Meta's own settings stay."""
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
    if settings.precision == "fp32":  # sam3 enables TF32 at import: compare in full fp32
        torch.backends.cuda.matmul.allow_tf32 = False
        torch.backends.cudnn.allow_tf32 = False
    loaded = torch.load(paths.meta_checkpoint, weights_only=True, mmap=True)["model"]
    state = model.state_dict()
    not_loaded = [k for k in state if f"detector.{k}" not in loaded and not any(s in k for s in NOT_IN_OUR_CHECKPOINT)]
    differ = [k for k, v in loaded.items() if not torch.equal(state[k.removeprefix("detector.")].cpu(), v)]
    if not_loaded or differ:
        raise DriftError(f"Meta's model did not take our sam3.pt whole: {len(not_loaded)} tensors missing "
                         f"({not_loaded[:3]}), {len(differ)} different ({differ[:3]})")
    return model


def meta_precision(precision: str):
    """How Meta runs its model at a precision: fp32 plainly, bf16 under CUDA autocast (its predictors' way)."""
    import torch

    if precision == "bf16":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def meta_outputs(model, pixels, prompts: list[str], device: str, precision: str = "fp32"):
    """Meta's raw outputs for one image and each prompt, stacked like the package's (pair = prompt), as
    fp32 tensors."""
    with meta_precision(precision):
        return tuple(t.float() for t in _meta_outputs(model, pixels, prompts, device))


def meta_find_stage(img_ids, text_ids):
    """Meta's grounding query for text prompts only: pair j = (image img_ids[j], prompt text_ids[j])."""
    from sam3.model.data_misc import FindStage

    return FindStage(img_ids=img_ids, text_ids=text_ids, input_boxes=None, input_boxes_mask=None,
                     input_boxes_label=None, input_points=None, input_points_mask=None)


def _meta_outputs(model, pixels, prompts, device):
    import torch

    find = meta_find_stage(torch.tensor([0], device=device), torch.tensor([0], device=device))
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

    if settings.device != "cuda" or settings.architecture != "full" or settings.precision == "fp8":
        raise ConfigError("parity compares the full model on a GPU with Meta's, which runs in fp32 or bf16: use "
                          "profile=sam3 device=cuda precision=fp32 or bf16 (verify gates an fp8 build against bf16)")
    paths, tolerances = ProfilePaths.of(settings), settings.stage("parity")["tolerances"][settings.precision]
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
            theirs = meta_outputs(model, pixels, case.prompts, settings.device, settings.precision)
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


def case_row(case, ours, theirs, mask_band: float = 0.0) -> dict:
    """One case's comparison with Meta's outputs (verify's metrics plus every query's score and the share of
    pairs whose top-1 query is the same)."""
    from .metrics import compare, scores

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


def parity_report(settings: Settings, rows: list[dict], checks: list[Check], tolerances: dict, versions: dict,
                  seconds: float) -> Report:
    weights = "random init" if settings.weights == "random" else settings.weights
    how = "fp32, TF32 off on both sides" if settings.precision == "fp32" else "our bf16 build vs Meta's model under bf16 autocast"
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
    from .stage import main

    main("parity", run, __doc__.splitlines()[0])
