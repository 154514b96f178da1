"""`vit_attention_kernel`: the ViT's attentions (28 windowed blocks of 576 tokens, 4 global of 5,184; head dim 64, no
mask) on the project's Triton flash attention, the op `sam3_aoti::attention`, as `attention_kernel` does the DETR
encoder's. The kernel reads queries, keys and values in the `[B, L, H, D]` layout their projections write and
writes its output in the one the output projection reads, so the rotary embedding is applied in that layout too:
transformers applies it to `[B, H, L, D]` views, which Inductor compiles to a transposing copy (about 0.68 ms a
windowed layer at 16 images on an H100, a third of the card's bandwidth). The same arithmetic either way.
Measured by experiments/vit_attention.py and, in the ViT, scripts/checks/section_times.py."""

from __future__ import annotations

from torch import nn
from transformers.models.sam3.modeling_sam3 import Sam3ViTRoPEAttention, apply_rotary_pos_emb_2d

from .. import ops
from .registry import register


class KernelViTAttention(Sam3ViTRoPEAttention):
    """transformers' `Sam3ViTRoPEAttention.forward`, its rotary embedding applied and its attention run in the
    projections' `[B, L, H, D]` layout."""

    def forward(self, hidden_states, position_embeddings, **kwargs):
        batch, height, width, _ = hidden_states.shape
        heads = (batch, height * width, self.num_attention_heads, self.head_dim)
        query, key, value = (p(hidden_states).view(heads) for p in (self.q_proj, self.k_proj, self.v_proj))
        cos, sin = (t.reshape(height * width, 1, self.head_dim) for t in position_embeddings)  # per token, any head
        query, key = apply_rotary_pos_emb_2d(query, key, cos=cos, sin=sin)
        out = ops.attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), self.scaling)
        return self.o_proj(out.reshape(batch, height, width, -1)), None


@register("vit_attention_kernel")
def apply(model: nn.Module) -> None:
    for module in model.vision_encoder.modules():
        if type(module) is Sam3ViTRoPEAttention:
            module.__class__ = KernelViTAttention
