"""Meta's own SAM3 (the `sam3` package), built from our weights: the reference of `parity` and a column of
`bench`. Meta's code needs CUDA, triton and torchvision, so it runs where those are (the H200)."""

from __future__ import annotations

import contextlib

from ..errors import ConfigError, DriftError
from ..pipeline.paths import ProfilePaths
from ..pipeline.settings import Settings

# Meta keys its builder computes itself or that transformers' Sam3Model has no use for.
NOT_IN_OUR_CHECKPOINT = ("freqs_cis", "geometry_encoder.points_")


def write_meta_checkpoint(settings: Settings):
    """The profile's weights as Meta's sam3.pt, and proof that our converter reads it back unchanged."""
    import torch
    from safetensors.torch import load_file

    from .meta_keys import meta_state_dict, to_meta, to_transformers

    paths = ProfilePaths.of(settings)
    ours = load_file(paths.checkpoint / "model.safetensors")
    paths.meta_checkpoint.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"model": to_meta(ours)}, paths.meta_checkpoint)
    back, unknown = to_transformers(meta_state_dict(torch.load(paths.meta_checkpoint, weights_only=True, mmap=True)))
    same = not unknown and back.keys() == ours.keys() and all(torch.equal(back[k], ours[k]) for k in ours)
    if not same:
        raise DriftError(f"Meta-format round trip of {paths.checkpoint} changed tensors: fix model/meta_keys.py KEY_MAP")
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
    from ..runtime.tokenizer import bundled_vocab_path

    paths = ProfilePaths.of(settings)
    model = build_sam3_image_model(bpe_path=str(bundled_vocab_path()), device=settings.device, eval_mode=True,
                                   checkpoint_path=str(paths.meta_checkpoint), load_from_HF=False)
    if settings.spec.parity == "plain":  # sam3 enables TF32 at import: compare in full fp32
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


def meta_precision(recipe: str):
    """How Meta runs its model (`Precision.parity`): "plain" (fp32), "autocast" (bf16 CUDA autocast, its
    predictors' way)."""
    import torch

    if recipe == "autocast":
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def meta_outputs(model, pixels, prompts: list[str], device: str, recipe: str = "plain", boxes=None):
    """Meta's raw outputs for one image and each prompt, stacked like the package's (pair = prompt), as
    fp32 tensors; with `boxes` (`[1, K, 4]` normalized cx, cy, w, h and `[1, K]` labels, 1 positive), each box
    appended to the geometric prompt as Meta's `Sam3Processor.add_geometric_prompt` appends it."""
    with meta_precision(recipe):
        return tuple(t.float() for t in _meta_outputs(model, pixels, prompts, device, boxes))


def meta_find_stage(img_ids, text_ids):
    """Meta's grounding query for text prompts only: pair j = (image img_ids[j], prompt text_ids[j])."""
    from sam3.model.data_misc import FindStage

    return FindStage(img_ids=img_ids, text_ids=text_ids, input_boxes=None, input_boxes_mask=None,
                     input_boxes_label=None, input_points=None, input_points_mask=None)


def _meta_outputs(model, pixels, prompts, device, boxes=None):
    import torch

    find = meta_find_stage(torch.tensor([0], device=device), torch.tensor([0], device=device))
    image_out = model.backbone.forward_image(pixels)
    rows = []
    for prompt in prompts:
        backbone_out = {**image_out, **model.backbone.forward_text([prompt], device=device)}
        geometric = model._get_dummy_prompt()
        for box, label in zip(*(t[0] for t in boxes)) if boxes is not None else ():
            label = torch.tensor([bool(label)], device=device).view(1, 1)
            geometric.append_boxes(box.float().view(1, 1, 4).to(device), label)
        out = model.forward_grounding(backbone_out=backbone_out, find_input=find, geometric_prompt=geometric,
                                      find_target=None)
        rows.append((out["pred_logits"], out["pred_boxes"], out["pred_masks"], out["presence_logit_dec"]))
    return tuple(torch.cat(parts) for parts in zip(*rows))


def meta_pixels(model, image, size: int, device: str):
    """Meta's Sam3Processor transform of an HxWx3 uint8 image (resized as uint8, then normalized)."""
    import torch
    from sam3.model.sam3_image_processor import Sam3Processor

    processor = Sam3Processor(model, resolution=size, device=device)
    return processor.transform(torch.from_numpy(image).permute(2, 0, 1).to(device)).unsqueeze(0)


def meta_grounding(settings: Settings):
    """Meta's own SAM3 as its users run it (`sam3`, eager, bf16 autocast), on our weights, as a call of pixels and
    phrases (bench's column); None where it cannot run (not importable, not the full model, not a GPU)."""
    import importlib.util

    if settings.device != "cuda" or settings.architecture != "full" or importlib.util.find_spec("sam3") is None:
        return None
    import torch

    write_meta_checkpoint(settings)
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    model = meta_model(settings)
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32  # the other columns' settings

    def run(pixels, prompts: list[str]):
        """All B x P pairs in one grounding call, the pair order of the package (image-major), with TF32 on
        as Meta's import sets it."""
        n, p = pixels.shape[0] * len(prompts), len(prompts)
        ids = torch.arange(n, device="cuda")
        find = meta_find_stage(ids // p, ids % p)
        saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
        try:
            with torch.inference_mode(), torch.autocast("cuda", dtype=torch.bfloat16):
                backbone_out = {**model.backbone.forward_image(pixels),
                                **model.backbone.forward_text(prompts, device="cuda")}
                return model.forward_grounding(backbone_out=backbone_out, find_input=find,
                                               geometric_prompt=model._get_dummy_prompt(n), find_target=None)
        finally:
            torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved

    return run
