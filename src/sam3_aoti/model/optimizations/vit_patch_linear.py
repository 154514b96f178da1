"""`vit_patch_linear`: the ViT's patch embedding (a 14 x 14 convolution of stride 14, 3 -> 1024 channels) as one GEMM
over the image's patches. The two compute the same sums; cuDNN runs this convolution as an implicit-GEMM kernel at
about a tenth of the card's GEMM rate (5.5 ms for 16 images on an H100, 0.31 ms for one:
benchmarks/h100-2026-12-06-pinned-vitattn/optimizations-on/), where the GEMM is 0.1 TFLOP for 16 images."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from transformers.models.sam3.modeling_sam3 import Sam3ViTPatchEmbeddings

from .registry import register


class PatchLinear(Sam3ViTPatchEmbeddings):
    def forward(self, pixel_values: torch.Tensor) -> torch.Tensor:
        weight = self.projection.weight  # [hidden, channels, p, q]
        (p, q), (height, width) = weight.shape[2:], pixel_values.shape[2:]
        rows, cols = height // p, width // q  # a convolution of stride = kernel leaves the remainder out
        x = pixel_values[:, :, :rows * p, :cols * q].to(weight.dtype)
        patches = x.reshape(x.shape[0], x.shape[1], rows, p, cols, q).permute(0, 2, 4, 1, 3, 5)
        return F.linear(patches.reshape(x.shape[0], rows * cols, -1), weight.reshape(weight.shape[0], -1))


@register("vit_patch_linear")
def apply(model: nn.Module) -> None:
    for module in model.vision_encoder.modules():
        conv = getattr(module, "projection", None)
        if type(module) is Sam3ViTPatchEmbeddings and conv.bias is None and conv.groups == 1 \
                and conv.stride == conv.kernel_size and conv.padding == (0, 0) and conv.dilation == (1, 1):
            module.__class__ = PatchLinear
