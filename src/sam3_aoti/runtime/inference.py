"""The one way prompts run against images, shared by `predict` and `segment`: `model(images, token_ids)`, or, for
exemplar boxes or long prompt lists, the parts (the images encoded once, the prompts decoded a chunk at a time)."""

from __future__ import annotations

from ..errors import PackageError

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


def package_device(metadata: dict) -> str:
    import torch

    device = metadata.get("device", "cpu")
    if device == "cuda" and not torch.cuda.is_available():
        raise PackageError("this package was compiled for cuda but no GPU is usable here: "
                           "run on a GPU machine or build with device=cpu")
    return device
