"""`vit_qkv_rope`: in a precision=fp8 build, each ViT attention's q, k and v projection and the rotary embedding of
q and k as one Triton GEMM (`sam3_aoti::fp8_linear_rope`, runtime/fp8_linear.py): q and k are rotated in the
GEMM's epilogue before they are written, where the unfused graph wrote them in bf16 and read them back for a
kernel that rotated them. On an H100 at 16 images a windowed layer's projection and rotation went from 0.83 to
0.71 ms and a global one's from 1.16 to 0.78 (`experiments/fp8_qkv_rope.py`); the fp8 package with it and
`vit_window_order` took 197.75 ms at 16 x 1 and 15.58 at 1 x 1, where it took 206.28 and 16.41 with neither on
another H100 (benchmarks/h100-2026-12-06-fp8-qkv-rope/). The tables hold one angle per pair of a head's channels
(transformers' `repeat_interleave(2)` halved), in the tokens' order (`vit_window_order`'s, when on).

In a bf16 or fp32 build there is no GEMM of the project's to fuse into (cuBLAS computes the projection): the layers
compute what `vit_fused_qkv` computes, with the rotation written over the halved tables, so pipeline.toml adds it at
precision=fp8 only. It implies `vit_fused_qkv`'s stacked projection."""

from __future__ import annotations

import torch
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.sam3.modeling_sam3 import Sam3ViTLayer, Sam3ViTRoPEAttention, eager_attention_forward

from ...runtime.fp8_linear import rotate_pairs
from .. import ops
from ..fp8 import Fp8Linear, quantize_rows
from .layers import stack_linears
from .registry import register


class PairTables(nn.Module):
    """A layer's rotary tables with one angle per pair of channels (`[L, head_dim / 2]`): a stand-in for its
    `rotary_emb` whose `forward` takes the same arguments."""

    def __init__(self, rotary: nn.Module, position_ids: torch.Tensor):
        super().__init__()
        with torch.no_grad():
            # `[1, L, head_dim]`, each angle twice (transformers rotates pairs of channels)
            cos, sin = (t.reshape(-1, t.shape[-1]) for t in rotary(position_ids, position_ids))
        if not (torch.equal(cos[:, ::2], cos[:, 1::2]) and torch.equal(sin[:, ::2], sin[:, 1::2])):
            raise ValueError("vit_qkv_rope: the rotary tables do not repeat each angle for a pair of channels")
        self.cos = nn.Buffer(cos[:, ::2].float().contiguous(), persistent=False)
        self.sin = nn.Buffer(sin[:, ::2].float().contiguous(), persistent=False)

    def forward(self, hidden_states: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos, self.sin


def rotated_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """transformers' `apply_rotary_pos_emb_2d` on `x [B, L, heads, D]` (in fp32, back to its dtype) with the halved
    tables `[L, D / 2]`."""
    return rotate_pairs(x.float(), cos[:, None], sin[:, None]).type_as(x)


class RopeQKVViTAttention(Sam3ViTRoPEAttention):
    """transformers' `Sam3ViTRoPEAttention.forward` with q, k, v as one projection whose q and k come rotated: in
    fp8 (`Fp8Linear`) through the op `sam3_aoti::fp8_linear_rope`, else the projection then `rotated_pairs`."""

    def forward(self, hidden_states, position_embeddings, **kwargs):
        batch_size, height, width, channels = hidden_states.shape
        heads = (batch_size, height * width, self.num_attention_heads, self.head_dim)
        cos, sin = position_embeddings
        if isinstance(self.qkv_proj, Fp8Linear):
            rows, scales = quantize_rows(hidden_states.reshape(-1, channels))
            qkv = ops.fp8_linear_rope(rows, scales, self.qkv_proj.weight, self.qkv_proj.weight_scale, self.qkv_bias,
                                      cos, sin, 2 * channels)
            query, key, value = (t.view(heads) for t in qkv.view(*heads[:2], -1).chunk(3, -1))
        else:
            query, key, value = (t.view(heads) for t in self.qkv_proj(hidden_states).chunk(3, -1))
            query, key = rotated_pairs(query, cos, sin), rotated_pairs(key, cos, sin)
        query, key, value = (t.transpose(1, 2) for t in (query, key, value))
        interface = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager_attention_forward)
        out, weights = interface(self, query, key, value, attention_mask=None, dropout=0.0, scaling=self.scaling,
                                 is_causal=self.is_causal, **kwargs)
        return self.o_proj(out.reshape(batch_size, height, width, -1).contiguous()), weights


@register("vit_qkv_rope", after=("vit_rope_tables", "vit_fused_qkv", "vit_window_order"))
def apply(model: nn.Module) -> None:
    tables = {}  # window size -> the tables every layer of that size shares (in the order its tokens come)
    for layer in model.vision_encoder.modules():
        if not isinstance(layer, Sam3ViTLayer):
            continue
        if layer.window_size not in tables:
            tables[layer.window_size] = PairTables(layer.rotary_emb, layer.position_ids)
        layer.rotary_emb = tables[layer.window_size]
        attention = layer.attention
        if not hasattr(attention, "qkv_proj"):  # without vit_fused_qkv: stacked here
            attention.qkv_proj = stack_linears([attention.q_proj, attention.k_proj, attention.v_proj])
            del attention.q_proj, attention.k_proj, attention.v_proj
        projection = attention.qkv_proj
        if isinstance(projection, Fp8Linear):  # the op adds the bias in its epilogue
            bias = projection.bias if projection.bias is not None else projection.weight_scale.new_zeros(
                projection.out_features, dtype=torch.bfloat16)
            attention.register_buffer("qkv_bias", bias)
            projection.bias = None
        attention.__class__ = RopeQKVViTAttention
