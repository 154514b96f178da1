"""`box_bias_kernel`: the DETR decoder's box-bias MLPs (2 -> hidden -> heads, per query and grid row or column)
as one Triton kernel, the op `sam3_aoti::box_bias_mlp` (runtime/box_bias.py), instead of two GEMMs with a
`[N, Q, side, hidden]` activation between them. Measured in benchmarks/README.md."""

from __future__ import annotations

import torch
from torch import nn

from .. import ops
from .layers import AxisBiasDecoder, extend
from .registry import register


def box_bias_mlp(deltas: torch.Tensor, mlp: nn.Module) -> torch.Tensor:
    """A box-bias MLP (`Sam3DecoderMLP`) as the op `runtime.box_bias` defines."""
    return ops.box_bias_mlp(deltas, mlp.layer1.weight, mlp.layer1.bias, mlp.layer2.weight, mlp.layer2.bias)


class FusedBoxBiasDecoder(AxisBiasDecoder):
    def box_bias_mlp(self, deltas: torch.Tensor, mlp: nn.Module) -> torch.Tensor:
        return box_bias_mlp(deltas, mlp)


@register("box_bias_kernel")
def apply(model: nn.Module) -> None:
    extend(model.detr_decoder, FusedBoxBiasDecoder)
