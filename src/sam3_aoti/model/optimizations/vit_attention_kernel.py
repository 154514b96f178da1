"""`vit_attention_kernel`: the ViT's attentions (28 windowed blocks of 576 tokens, 4 global of 5,184; head dim 64, no
mask) on the project's Triton flash attention, the op `sam3_aoti::attention`, as `attention_kernel` does the DETR
encoder's. Its output is already the `[B, L, H, D]` the output projection reads, where SDPA's is transposed and
copied. Measured against SDPA's kernels by experiments/vit_attention.py."""

from __future__ import annotations

import copy

from torch import nn
from transformers import AttentionInterface
from transformers.models.sam3.modeling_sam3 import Sam3ViTRoPEAttention

from .attention_kernel import KERNEL_ATTENTION, kernel_attention
from .registry import register


@register("vit_attention_kernel")
def apply(model: nn.Module) -> None:
    AttentionInterface.register(KERNEL_ATTENTION, kernel_attention)
    config = None
    for module in model.vision_encoder.modules():
        if isinstance(module, Sam3ViTRoPEAttention):  # one config of their own, not the backbone's they share
            config = config or copy.copy(module.config)
            config._attn_implementation = KERNEL_ATTENTION
            module.config = config
