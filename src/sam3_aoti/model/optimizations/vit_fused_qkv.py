"""`vit_fused_qkv`: each ViT attention's query, key and value projections as one GEMM (`qkv_proj`, 1024 -> 3072):
one read of the LayerNorm's output and one launch where there were three, and in a precision=fp8 build one
quantization of it. A small gain: on an H100 the three already ran near cuBLAS's rate; the stack saves 64 launches
a call and about 1 % of the ViT's kernel time at 16 images (benchmarks/h100-2026-12-06-vit-fused-qkv/)."""

from __future__ import annotations

from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.sam3.modeling_sam3 import (Sam3ViTRoPEAttention, apply_rotary_pos_emb_2d,
                                                    eager_attention_forward)

from .layers import stack_linears
from .registry import register


class FusedQKVViTAttention(Sam3ViTRoPEAttention):
    """transformers' `Sam3ViTRoPEAttention.forward` with the three projections as one stacked GEMM."""

    def forward(self, hidden_states, position_embeddings, **kwargs):
        batch_size, height, width, _ = hidden_states.shape
        heads = (batch_size, height * width, self.num_attention_heads, self.head_dim)
        query, key, value = (t.view(heads).transpose(1, 2) for t in self.qkv_proj(hidden_states).chunk(3, -1))
        query, key = apply_rotary_pos_emb_2d(query, key, *position_embeddings)
        interface = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager_attention_forward)
        out, weights = interface(self, query, key, value, attention_mask=None, dropout=0.0, scaling=self.scaling,
                                 is_causal=self.is_causal, **kwargs)
        return self.o_proj(out.reshape(batch_size, height, width, -1).contiguous()), weights


@register("vit_fused_qkv")
def apply(model: nn.Module) -> None:
    for module in model.vision_encoder.modules():
        if isinstance(module, Sam3ViTRoPEAttention):
            module.qkv_proj = stack_linears([module.q_proj, module.k_proj, module.v_proj])
            del module.q_proj, module.k_proj, module.v_proj
            module.__class__ = FusedQKVViTAttention
