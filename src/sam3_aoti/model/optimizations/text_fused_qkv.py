"""`text_fused_qkv`: each CLIP text attention's query, key and value projections as one GEMM (`qkv_proj`): at a
prompt's 32 tokens each projection is a latency-bound launch. Measured in benchmarks/README.md."""

from __future__ import annotations

from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.clip.modeling_clip import CLIPAttention
from transformers.models.sam3.modeling_sam3 import eager_attention_forward

from .layers import stack_linears
from .registry import register


class FusedQKVTextAttention(CLIPAttention):
    """transformers' `CLIPAttention.forward` with the three projections as one stacked GEMM."""

    def forward(self, hidden_states, attention_mask=None, **kwargs):
        heads = (*hidden_states.shape[:-1], -1, self.head_dim)
        queries, keys, values = (t.view(heads).transpose(1, 2) for t in self.qkv_proj(hidden_states).chunk(3, -1))
        interface = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager_attention_forward)
        out, weights = interface(self, queries, keys, values, attention_mask, scaling=self.scale, dropout=0.0,
                                 **kwargs)
        return self.out_proj(out.reshape(*hidden_states.shape[:-1], -1).contiguous()), weights


def fuse_text_projections(text_encoder: nn.Module) -> None:
    """Each CLIP attention's three projections as one stacked GEMM; theirs go."""
    for module in text_encoder.modules():
        if isinstance(module, CLIPAttention):
            module.qkv_proj = stack_linears([module.q_proj, module.k_proj, module.v_proj])
            del module.q_proj, module.k_proj, module.v_proj
            module.__class__ = FusedQKVTextAttention


@register("text_fused_qkv")
def apply(model: nn.Module) -> None:
    fuse_text_projections(model.text_encoder)
