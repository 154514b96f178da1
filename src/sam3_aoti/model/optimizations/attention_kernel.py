"""`attention_kernel`: the DETR encoder's self-attentions over the image tokens (head dim 32, no mask) on the
project's Triton flash attention, the op `sam3_aoti::attention` (runtime/attention.py), registered as a
transformers attention interface. Measured in benchmarks/README.md."""

from __future__ import annotations

from torch import nn
from transformers import AttentionInterface

from .. import ops
from .registry import register

KERNEL_ATTENTION = "sam3_aoti_attention"


def kernel_attention(module, query, key, value, attention_mask=None, dropout=0.0, scaling=None, **kwargs):
    """transformers' attention interface on the op `sam3_aoti::attention` (unmasked), which returns SDPA's
    `[B, L, H, D]` layout."""
    if attention_mask is not None:
        raise ValueError("the attention kernel takes no mask")
    scale = module.scaling if scaling is None else scaling
    return ops.attention(query, key, value, scale), None


@register("attention_kernel")
def apply(model: nn.Module) -> None:
    AttentionInterface.register(KERNEL_ATTENTION, kernel_attention)
    for layer in model.detr_encoder.layers:  # their configs are their own (`export_fixes.set_masked_attention`)
        layer.self_attn.config._attn_implementation = KERNEL_ATTENTION
