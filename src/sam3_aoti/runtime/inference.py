"""The one way prompts run against images, shared by `predict` and `segment`: `model(images, token_ids)`, or, for
exemplar boxes or long prompt lists, the parts (the images encoded once, the prompts decoded a chunk at a time)."""

from __future__ import annotations

from ..errors import InputError, PackageError

PROMPT_CHUNK = 16  # prompts decoded at once by a split package: bounds the per-pair memory of long class lists


def run_prompts(package, pixels, token_ids, exemplars=None, features=None):
    """The outputs of `model(pixels, token_ids)`, pair i = (image i // P, prompt i % P). `exemplars`:
    `package.encode_boxes(...)`, of these images or of one image that searches them all; `features`:
    `package.encode_image(pixels)` where the caller has it already."""
    if exemplars is None and features is None and not (package.parts and token_ids.shape[0] > PROMPT_CHUNK):
        return package.model(pixels, token_ids)
    features = features if features is not None else package.encode_image(pixels)
    texts = [package.encode_text(token_ids[i:i + PROMPT_CHUNK]) for i in range(0, token_ids.shape[0], PROMPT_CHUNK)]
    return package.decode_chunked(features, texts, exemplars)


def check_request(prompts: list[str], boxes: list, threshold: float, boxes_on=None) -> None:
    """What predict and segment are asked, in one line before anything loads: a prompt or a box, the threshold,
    every prompt tokenizable (by the tokenizer alone: segment's driver never imports torch, a second of its
    start-up)."""
    from .tokenizer import ClipTokenizer

    if not 0.0 <= threshold <= 1.0:
        raise InputError(f"threshold {threshold} is not between 0 and 1 (--threshold)")
    if not prompts and not boxes:
        raise InputError("nothing to look for: give a prompt, an exemplar box or both (--prompt, --box)")
    if boxes_on and not boxes:
        raise InputError(f"{boxes_on} is the image exemplar boxes are drawn on, and no box was given: add --box")
    if prompts:
        ClipTokenizer.bundled()(list(prompts))


def encode_exemplars(package, normalized: tuple, drawn_on, device: str, features=None):
    """Exemplar boxes (`exemplars.normalized_boxes` of their pixel corners) on the RGB image `drawn_on`, encoded
    for `decode`: with `features` of that image where the caller has them, else encoded here."""
    from .postprocess import to_tensor

    if features is None:
        features = package.encode_image(package.transforms(to_tensor(drawn_on, device)))
    return package.encode_boxes(features, *(t.to(device) for t in normalized))


def package_device(metadata: dict) -> str:
    import torch

    device = metadata.get("device", "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise PackageError("this package was compiled for cuda but no GPU is usable here: "
                           "run on a GPU machine or build with device=cpu")
    return device
