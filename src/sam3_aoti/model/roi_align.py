"""ROI align in plain torch ops, for the geometry encoder's exemplar boxes: what `torchvision.ops.roi_align` computes
with `spatial_scale=1, sampling_ratio=-1, aligned=False` (transformers' call), as ops that export and AOT-compile,
so neither the package nor the runtime needs torchvision.

torchvision averages, per output bin, `ceil(roi / output_size)` bilinear samples in each direction: a count that
depends on the box. Here every box gets the most any box inside the map can need (`ceil(side / output_size)`),
and the samples past its own count weigh nothing. Bilinear sampling on a grid is separable, so each box's bins
are two small interpolation matrices (rows: bins, columns: the map's rows or columns) applied to the map:
`pooled = Ay @ map @ Ax^T`, the average folded into them. tests/test_roi_align.py holds it to torchvision's in an
environment that has torchvision (meta_sam3/).
"""

from __future__ import annotations

import torch


def roi_align(features: torch.Tensor, boxes: torch.Tensor, output_size: int) -> torch.Tensor:
    """`features [B, C, H, W]`, `boxes [B, K, 4]` (x0, y0, x1, y1 in the map's pixels, inside it) ->
    `[B, K, C, output_size, output_size]`, computed in fp32 and returned in the features' dtype."""
    height, width = features.shape[-2:]
    x0, y0, x1, y1 = boxes.float().unbind(-1)
    rows = _interpolation(y0, y1, height, output_size)  # [B, K, out, H]
    columns = _interpolation(x0, x1, width, output_size)  # [B, K, out, W]
    pooled = torch.einsum("bkph,bchw->bkcpw", rows, features.float())
    return torch.einsum("bkcpw,bkqw->bkcpq", pooled, columns).to(features.dtype)


def _interpolation(low: torch.Tensor, high: torch.Tensor, size: int, bins: int) -> torch.Tensor:
    """`[B, K, bins, size]`: row i is the average of bin i's bilinear sampling weights over the map's `size`
    rows (or columns), as torchvision's `bilinear_interpolate` weighs them."""
    samples = -(-size // bins)  # the most a box inside the map can need: ceil(size / bins)
    extent = (high - low).clamp(min=1.0)
    step = extent / bins
    count = torch.ceil(extent / bins)  # torchvision's adaptive sampling ratio
    bin_index = torch.arange(bins, device=low.device, dtype=torch.float32)
    sample_index = torch.arange(samples, device=low.device, dtype=torch.float32)
    # [B, K, bins, samples]: torchvision's y = y0 + p * bin + (s + 0.5) * bin / count
    position = (low[..., None, None] + bin_index[:, None] * step[..., None, None]
                + (sample_index + 0.5) * (step / count)[..., None, None])
    used = (sample_index < count[..., None, None]) & (position >= -1.0) & (position <= size)
    position = position.clamp(min=0.0)
    lower = position.floor()
    at_edge = lower >= size - 1
    lower = torch.where(at_edge, torch.full_like(lower, size - 1), lower)
    upper = torch.where(at_edge, lower, lower + 1)
    fraction = torch.where(at_edge, torch.zeros_like(position), position - lower)
    cells = torch.arange(size, device=low.device, dtype=torch.float32)
    weights = ((cells == lower[..., None]) * (1 - fraction)[..., None]
               + (cells == upper[..., None]) * fraction[..., None]) * used[..., None]
    return weights.sum(-2) / count[..., None, None]
