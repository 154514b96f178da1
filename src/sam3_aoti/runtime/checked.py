"""A package's callables with one-line errors for inputs they cannot take, raised before native code runs: the
dtypes, devices and sizes its metadata names, one batch and one prompt count across a call's inputs."""

from __future__ import annotations

from typing import Callable

from ..errors import InputError
from .archive import PART_NAMES, SPLIT_CALLS
from .cuda_graphs import CudaGraphRunner


def _describe(t) -> str:
    import torch

    if not isinstance(t, torch.Tensor):
        return type(t).__name__
    return f"{str(t.dtype).removeprefix('torch.')} {list(t.shape)} on {t.device.type}"


def check_images(images, device: str, side: int | None = None) -> None:
    """float32 [B, 3, H, W] (H = W = side for the model) on the package's device, B >= 1."""
    import torch

    want = f"float32 [batch, 3, {side or 'height'}, {side or 'width'}] on {device}"
    ok = (isinstance(images, torch.Tensor) and images.dtype == torch.float32 and images.dim() == 4
          and images.shape[1] == 3 and images.device.type == device
          and (images.shape[2:] == (side, side) if side else min(images.shape[2:]) >= 2))
    if not ok:
        hint = "the output of transforms" if side else "RGB pixels in [0, 255], channels first"
        raise InputError(f"images must be {want}, got {_describe(images)}: pass {hint}")
    if images.shape[0] == 0:
        raise InputError("images holds no image (batch 0): pass at least one")


def check_token_ids(token_ids, device: str, context: int, vocab: int) -> None:
    """int64 [P, context] on the package's device, P >= 1, every id a token of the vocabulary."""
    import torch

    if not (isinstance(token_ids, torch.Tensor) and token_ids.dtype == torch.int64 and token_ids.dim() == 2
            and token_ids.shape[1] == context and token_ids.device.type == device):
        raise InputError(f"token_ids must be int64 [num_prompts, {context}] on {device}, got {_describe(token_ids)}: "
                         "use encode_prompts")
    if token_ids.shape[0] == 0:
        raise InputError("token_ids holds no prompt (num_prompts 0): pass at least one")
    if bool(((token_ids < 0) | (token_ids >= vocab)).any()):
        raise InputError(f"token_ids holds ids outside [0, {vocab}): use encode_prompts or a CLIP BPE tokenizer")


class CheckedModel:
    """`model(images, token_ids)` with one-line errors for inputs it cannot take, before native code runs."""

    def __init__(self, runner: Callable, metadata: dict):
        model = metadata.get("models", {}).get("model", {})
        tokenizer = metadata.get("tokenizer", {})
        self.runner, self.device = runner, metadata.get("device", "cpu")
        self.graph_runner = runner if isinstance(runner, CudaGraphRunner) else None
        self.side = model.get("inputs", {}).get("images", {}).get("shape", [0, 0, 0])[2]
        self.context, self.vocab = tokenizer.get("context_length", 32), tokenizer.get("end", 49407) + 1

    def __call__(self, images, token_ids):
        check_images(images, self.device, self.side)
        check_token_ids(token_ids, self.device, self.context, self.vocab)
        return self.runner(images, token_ids)


class CheckedSplitCall(CheckedModel):
    """A `split_call.SplitCall`: `(images, token_ids)`, or with `boxes` and `labels` (`exemplars.check_boxes`)."""

    def __call__(self, images, token_ids, boxes=None, labels=None):
        if boxes is None:
            return super().__call__(images, token_ids)
        from .exemplars import check_boxes

        check_images(images, self.device, self.side)
        check_token_ids(token_ids, self.device, self.context, self.vocab)
        check_boxes(boxes, labels, images.shape[0], self.device)
        return self.runner(images, token_ids, boxes, labels)


class CheckedPart:
    """A split model with one-line errors for inputs it cannot take, checked against the metadata's inputs:
    their count, dtypes, device and sizes, and one batch and one prompt count across them."""

    def __init__(self, runner: Callable, metadata: dict, name: str):
        self.runner, self.name, self.device = runner, name, metadata.get("device", "cpu")
        self.graph_runner = runner if isinstance(runner, CudaGraphRunner) else None
        described = metadata["models"][name]
        self.inputs = [described["inputs"][n] for n in described["input_order"]]
        tokenizer = metadata.get("tokenizer", {})
        self.context, self.vocab = tokenizer.get("context_length", 32), tokenizer.get("end", 49407) + 1

    def __call__(self, *groups):
        import torch

        if self.name == "encode_image":
            check_images(groups[0], self.device, self.inputs[0]["shape"][2])
        if self.name == "encode_text":
            check_token_ids(groups[0], self.device, self.context, self.vocab)
        args = [t for group in groups for t in (group if isinstance(group, (tuple, list)) else (group,))]
        hint = {"decode": "pass decode(encode_image(images), encode_text(token_ids)) of this package",
                "encode_boxes": "pass encode_boxes(encode_image(images), boxes, labels) of this package"}.get(
            self.name, "")
        if len(args) != len(self.inputs):
            raise InputError(f"{self.name} takes {len(self.inputs)} tensors, got {len(args)}: {hint}")
        sizes: dict[str, int] = {}
        for i, (a, want) in enumerate(zip(args, self.inputs)):
            dims = want["shape"]
            ok = (isinstance(a, torch.Tensor) and str(a.dtype).removeprefix("torch.") == want["dtype"]
                  and a.device.type == self.device and a.dim() == len(dims) and a.shape[0] >= 1
                  and all(d == n for d, n in zip(dims, a.shape) if isinstance(d, int)))
            if ok and sizes.setdefault(dims[0], a.shape[0]) != a.shape[0]:
                raise InputError(f"{self.name}: input {i} has {dims[0]} {a.shape[0]}, an earlier one "
                                 f"{sizes[dims[0]]}: {hint or 'pass inputs of one call'}")
            if not ok:
                raise InputError(f"{self.name} input {i} must be {want['dtype']} {dims} on {self.device}, got "
                                 f"{_describe(a)}: {hint or 'see the package metadata'}")
        return self.runner(*args)


class CheckedTransforms:
    """`transforms(images)` with one-line errors for inputs it cannot take."""

    def __init__(self, runner: Callable, metadata: dict):
        self.runner, self.device = runner, metadata.get("device", "cpu")

    def __call__(self, images):
        check_images(images, self.device)
        return self.runner(images)


def checked(runners: dict, metadata: dict) -> dict:
    return {"model": CheckedModel(runners["model"], metadata), "transforms": CheckedTransforms(runners["transforms"], metadata),
            **{name: CheckedPart(runners[name], metadata, name) for name in PART_NAMES if name in runners},
            **{name: CheckedSplitCall(runners[name], metadata) for name in SPLIT_CALLS if name in runners}}
