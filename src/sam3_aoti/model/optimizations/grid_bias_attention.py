"""`grid_bias_attention`: the DETR decoder's box-biased vision cross-attentions on the op `sam3_aoti::attention`
with the bias as its two per-axis tables (`[N, heads, Q', 2 * side]`: the y table, then the x table), so the
`[N, heads, 1 + Q, side * side]` sum is never stored; the kernel reads it through a one-hot dot over key cells.
Measured in benchmarks/README.md."""

from __future__ import annotations

import torch
from torch import nn

from .. import ops
from .layers import AxisBiasDecoder, ProjectedAttention, extend
from .registry import register


class BiasTablesDecoder(AxisBiasDecoder):
    """The decoder hands its attentions the tables side by side; transformers' decoder pads the presence row
    onto them as onto the sum (`decoder_shared_projections` does not: the op leaves queries above its tables
    unbiased)."""

    def assemble_bias(self, bias_y: torch.Tensor, bias_x: torch.Tensor) -> torch.Tensor:
        return torch.cat([bias_y, bias_x], -1)


class GridBiasAttention(ProjectedAttention):
    """The vision cross-attention on the op, the mask being the decoder's tables for the last Q' queries."""

    def attend(self, query, key, value, attention_mask, dtype, **kwargs):
        dtype_in = getattr(self, "attention_dtype", dtype)  # set by `mixed_precision.attention_in`
        bias_y, bias_x = attention_mask.float().chunk(2, dim=-1)
        out = ops.attention(self.heads(query, dtype_in), self.heads(key, dtype_in), self.heads(value, dtype_in),
                            self.scaling, bias_y, bias_x)
        return self.o_proj(out.to(dtype).reshape(*query.shape[:2], -1)), None


@register("grid_bias_attention")
def apply(model: nn.Module) -> None:
    extend(model.detr_decoder, BiasTablesDecoder)
    for layer in model.detr_decoder.layers:
        layer.vision_cross_attn.__class__ = GridBiasAttention
