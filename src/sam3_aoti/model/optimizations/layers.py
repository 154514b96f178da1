"""Building blocks more than one optimization uses: class composition on an instance, stacked linears, an
attention split at its projections, and the DETR decoder's box bias as two per-axis tables."""

from __future__ import annotations

import functools
import math

import torch
import torch.nn.functional as F
from torch import nn
from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
from transformers.models.sam3.modeling_sam3 import Sam3Attention, box_cxcywh_to_xyxy, eager_attention_forward

from ...runtime import attention
from ..fp8 import Fp8Linear


@functools.cache
def _composed(mixin: type, base: type) -> type:
    return type(f"{mixin.__name__}{base.__name__}", (mixin, base), {"__module__": mixin.__module__})


def extend(module: nn.Module, mixin: type) -> None:
    """Give `module` the methods of `mixin` over those of its class, keeping whatever earlier optimizations
    swapped in (two optimizations may each override a different method of one module)."""
    if not isinstance(module, mixin):
        module.__class__ = _composed(mixin, type(module))


class StackedLinear(nn.Linear):
    """Linear layers that read one input, as one GEMM whose output is theirs side by side. The output stays in
    the weights' dtype (bf16 in a bf16 decoder): each slice is cast where it is read, once."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x.to(self.weight.dtype), self.weight, self.bias)


def stack_linears(linears: list[nn.Linear]) -> nn.Module:
    """One `StackedLinear` holding the layers' weights and biases (copies: the layers lose theirs after); fp8
    layers (precision=fp8 quantizes before the optimizations) as one `Fp8Linear`."""
    if all(isinstance(linear, Fp8Linear) for linear in linears):
        return Fp8Linear.stacked(linears)
    first = linears[0]
    stack = StackedLinear(first.in_features, first.out_features * len(linears), device="meta")
    stack.weight = nn.Parameter(torch.cat([linear.weight.detach() for linear in linears]))
    stack.bias = nn.Parameter(torch.cat([linear.bias.detach() for linear in linears]))
    return stack


class ProjectedAttention(Sam3Attention):
    """transformers' `Sam3Attention.forward` in two steps: the projections, then `attend` on projected queries,
    keys and values (`[B, L, heads * head_dim]` each, any dtype), which a caller that projected the keys and
    values already (`decoder_shared_projections`) calls alone. The class is swapped in on the instance."""

    def forward(self, query, key, value, attention_mask=None, **kwargs):
        return self.attend(self.q_proj(query), self.k_proj(key), self.v_proj(value), attention_mask, query.dtype,
                           **kwargs)

    def heads(self, states: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """`[B, L, heads * head_dim]` -> a `[B, heads, L, head_dim]` view in `dtype`."""
        return states.view(*states.shape[:2], self.num_attention_heads, self.head_dim).transpose(1, 2).to(dtype)

    def attend(self, query, key, value, attention_mask, dtype, **kwargs):
        """The attention and its output projection, computing in `dtype` (the residual stream's)."""
        interface = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, eager_attention_forward)
        out, _ = interface(self, self.heads(query, dtype), self.heads(key, dtype), self.heads(value, dtype),
                           attention_mask=attention_mask, dropout=0.0, scaling=self.scaling, is_causal=False, **kwargs)
        return self.o_proj(out.reshape(*query.shape[:2], -1).contiguous()), None


def box_bias_linears(deltas: torch.Tensor, mlp: nn.Module) -> torch.Tensor:
    """A box-bias MLP as transformers runs it, in the op `sam3_aoti::box_bias_mlp`'s `[N, heads, Q, side]`
    layout."""
    return mlp(deltas).permute(0, 3, 1, 2)


class AxisBiasDecoder:
    """A DETR decoder mixin: the box bias built from its y and x tables (`axis_biases`), which `box_bias_kernel`
    computes in one kernel (`box_bias_mlp`) and `grid_bias_attention` hands the attention as they are
    (`assemble_bias`). Alone it is transformers' `_get_rpb_matrix` up to its last sum, then the sum."""

    def _get_rpb_matrix(self, reference_boxes, spatial_shape):
        return self.assemble_bias(*self.axis_biases(reference_boxes))

    def assemble_bias(self, bias_y: torch.Tensor, bias_x: torch.Tensor) -> torch.Tensor:
        return attention.grid_bias(bias_y, bias_x)

    def box_bias_mlp(self, deltas: torch.Tensor, mlp: nn.Module) -> torch.Tensor:
        return box_bias_linears(deltas, mlp)

    def axis_biases(self, reference_boxes: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """The y and x tables (`[N, heads, Q, side]` each), whose broadcast sum is the bias."""
        side = self.static_side
        coords = torch.arange(side, device=reference_boxes.device, dtype=reference_boxes.dtype) / side
        edges = box_cxcywh_to_xyxy(reference_boxes)

        def log_scaled(box_edges):  # [N, Q, 2] (low, high) -> [N, Q, side, 2], as transformers encodes them
            deltas = (coords[:, None] - box_edges[:, :, None, :]) * 8
            return torch.sign(deltas) * torch.log2(deltas.abs() + 1.0) / math.log2(8)

        return (self.box_bias_mlp(log_scaled(edges[..., 1::2]), self.box_rpb_embed_y),
                self.box_bias_mlp(log_scaled(edges[..., 0::2]), self.box_rpb_embed_x))
