"""The precision recipe of a low-precision build: which parts of SAM3 keep fp32 and how the rest computes in
bf16, as Meta's bf16 autocast runs it, made of modules that export can trace (autocast is not)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers import Sam3Model
from transformers.models.sam3.modeling_sam3 import Sam3Attention

from ..runtime.contract import FP32_IN_BF16

# The DETR decoder's linears a bf16 build keeps fp32 with `box_path_linears = "bf16"`: the heads that turn the
# queries into box offsets and the presence logit (a few hundred FLOPs per query, read straight into outputs).
BOX_PATH_FP32_LINEARS = ("box_head", "presence_head")


class LowPrecisionLinear(nn.Linear):
    """A linear layer whose weights are stored in a low precision and whose GEMM runs in it, taking and giving
    its caller's dtype: what autocast makes of `nn.Linear`, as a module export can trace."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.to(self.weight.dtype), self.weight, self.bias).to(x.dtype)


def linears_in(part: nn.Module, dtype: torch.dtype, keep: tuple[str, ...] = ()) -> None:
    """Run the linear layers of `part` (a module kept in fp32 in a bf16 build) as `dtype` GEMMs with fp32
    inputs and outputs, all but those under the submodules named in `keep`. Everything between them (the
    residual stream, the layer norms, the box refinement) stays fp32, as under Meta's bf16 autocast."""
    for name, module in part.named_modules():
        if isinstance(module, nn.Linear) and not any(name == k or name.startswith(k + ".") for k in keep):
            module.to(dtype)
            module.__class__ = LowPrecisionLinear


def attention_in(part: nn.Module, dtype: torch.dtype) -> None:
    """Run the attentions of `part` (a module kept in fp32 in a bf16 build) in `dtype`, the rest of it
    staying fp32: an fp32 box-biased attention takes the memory-efficient kernel, several times slower than
    cuDNN in bf16 (benchmarks/README.md, experiments/speed_levers.py)."""
    for module in part.modules():
        if isinstance(module, Sam3Attention):
            module.attention_dtype = dtype


def _cast(value, dtype: torch.dtype):
    if torch.is_tensor(value) and value.is_floating_point():
        return value.to(dtype)
    if isinstance(value, (list, tuple)):
        return type(value)(_cast(v, dtype) for v in value)
    return value


def _inputs_to(dtype: torch.dtype):
    """A forward pre-hook that hands a module its floating inputs in its own dtype."""
    return lambda module, args, kwargs: (_cast(args, dtype), {k: _cast(v, dtype) for k, v in kwargs.items()})


def keep_box_path_fp32(model: Sam3Model, dtype: torch.dtype, fp32_parts: tuple = FP32_IN_BF16) -> None:
    """Mixed precision for a low-precision model: `contract.FP32_IN_BF16` in fp32, the rest (ViT, text, DETR
    encoder, mask decoder: nearly all the work) in `dtype`; each part gets its inputs in its own dtype. The
    DETR decoder refines each box over its layers (inverse sigmoid, add, sigmoid), and bf16 keeps a box
    coordinate to 1/256 (4 px at 1008) at every step."""
    for name in fp32_parts:
        getattr(model, name).float().register_forward_pre_hook(_inputs_to(torch.float32), with_kwargs=True)
    model.mask_decoder.register_forward_pre_hook(_inputs_to(dtype), with_kwargs=True)


def apply_precision(model: Sam3Model, dtype: torch.dtype, fp32_parts: tuple, masked_attention: str,
                    box_path_attention: str, box_path_linears: str, fp8_parts: tuple) -> None:
    """The whole recipe: `model` in `dtype`, `fp32_parts` in fp32 and, as `[export]` chooses, the DETR
    decoder's attentions and linears in `dtype` inside it; with precision=fp8 the `fp8_parts`' linears as
    rowwise-scaled fp8 GEMMs (fp8.py)."""
    model.to(dtype)
    if dtype != torch.float32:
        keep_box_path_fp32(model, dtype, fp32_parts)
        if box_path_attention == "bf16" and masked_attention == "sdpa":
            attention_in(model.detr_decoder, dtype)
        if box_path_linears == "bf16" and "detr_decoder" in fp32_parts:
            linears_in(model.detr_decoder, dtype, keep=BOX_PATH_FP32_LINEARS)
    if fp8_parts:
        from .fp8 import quantize_linears

        for name in fp8_parts:
            quantize_linears(model.get_submodule(name))
