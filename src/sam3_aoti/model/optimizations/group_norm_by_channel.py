"""`group_norm_by_channel`: the pixel decoder's group norms with their statistics reduced per channel first,
then per group from its channels' means and variances (equal counts: the group's variance is the mean of
theirs plus the variance of their means, Chan's parallel formula, so nothing cancels as `E[x^2] - E[x]^2`
would). A reduction per (pair, group) of a 288 x 288 map is few, long programs; per channel there are 32 times
as many, and Inductor fuses `pixel_decoder_per_image`'s phase slices into them. Measured in
benchmarks/README.md."""

from __future__ import annotations

import torch
from torch import nn

from .registry import register


class ChannelStatsGroupNorm(nn.GroupNorm):
    """Any layout `[N, C, ...]`, the phase layout too; fp32 statistics, as the native kernel keeps them (fp64 in
    fp64)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        dtype = torch.promote_types(x.dtype, torch.float32)
        values = x.to(dtype).reshape(x.shape[0], self.num_groups, self.num_channels // self.num_groups, -1)
        channel_var, channel_mean = torch.var_mean(values, dim=-1, keepdim=True, correction=0)
        mean = channel_mean.mean(2, keepdim=True)
        var = (channel_var + (channel_mean - mean).square()).mean(2, keepdim=True)
        scale = torch.rsqrt(var + self.eps) * self.weight.to(dtype).reshape(1, self.num_groups, -1, 1)
        out = (values - mean) * scale + self.bias.to(dtype).reshape(1, self.num_groups, -1, 1)
        return out.reshape(x.shape).to(x.dtype)


@register("group_norm_by_channel")
def apply(model: nn.Module) -> None:
    for norm in model.mask_decoder.pixel_decoder.norms:
        norm.__class__ = ChannelStatsGroupNorm
