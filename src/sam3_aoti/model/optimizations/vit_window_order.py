"""`vit_window_order`: the ViT's tokens kept in its windows' order from the first layer to the last. transformers
partitions the tokens into windows before each windowed layer's attention and puts them back after it (28 of SAM3's
32 layers). LayerNorm, the MLP and the residual adds work token by token, and a global layer's attention attends
every token to every other, so the tokens' order matters only to the rotary embedding: the global layers read their
positions in the same order. One partition after the ViT's first LayerNorm and one unpartition after its last layer;
none in between. In a precision=fp8 build the partition split each windowed layer's first LayerNorm from its rows'
quantization: two kernels, 0.36 ms at 16 images on an H100 where the unpartitioned ones take 0.21
(benchmarks/h100-2026-12-06-vit-norm/). On one H100 the fp8 ViT section took 12.02 ms at one image with it and 12.29
without, 173.8 and 181.7 at 16; in bf16 1.2 % less at 16 but 2 ms more in a compile for one image alone, so
pipeline.toml adds it at precision=fp8 only until a bf16 package is timed at one image
(benchmarks/h100-2026-12-06-window-order-both/). A grid the windows do not tile (transformers pads it, and the
padding's tokens join each windowed attention) keeps transformers' order."""

from __future__ import annotations

import torch
from torch import nn
from transformers.modeling_outputs import BaseModelOutput
from transformers.models.sam3.modeling_sam3 import (Sam3ViTLayer, Sam3ViTModel, window_partition,
                                                    window_unpartition)

from .registry import register


class WindowedLayer(Sam3ViTLayer):
    """A windowed layer whose input is already its windows, `[B * windows, w, w, C]`: transformers' forward without
    the partition and unpartition around its attention."""

    def forward(self, hidden_states: torch.Tensor, **kwargs) -> torch.Tensor:
        residual = hidden_states
        hidden_states = self.layer_norm1(hidden_states)
        position_embeddings = self.rotary_emb(hidden_states, self.position_ids)
        hidden_states, _ = self.attention(hidden_states, position_embeddings, **kwargs)
        hidden_states = residual + hidden_states
        residual = hidden_states
        return residual + self.dropout(self.mlp(self.layer_norm2(hidden_states)))


class WindowOrderViT(Sam3ViTModel):
    """transformers' `Sam3ViTModel.forward` with the tokens in window order between its first LayerNorm and the
    end: a global layer sees them as a `[B, H, W, C]` grid in that order."""

    def forward(self, pixel_values: torch.Tensor, **kwargs) -> BaseModelOutput:
        patch, window = self.config.patch_size, self.config.window_size
        height, width = pixel_values.shape[-2] // patch, pixel_values.shape[-1] // patch
        if height % window or width % window:
            raise ValueError(f"vit_window_order: a {height} x {width} grid of patches is not tiled by {window} x "
                             f"{window} windows (the model was built for {self.config.image_size} px images)")
        hidden_states = self.embeddings(pixel_values)
        batch = hidden_states.shape[0]
        hidden_states = self.layer_norm(hidden_states.view(batch, height, width, -1))
        windows, _ = window_partition(hidden_states, window)
        for layer in self.layers:
            if layer.window_size:
                windows = layer(windows, **kwargs)
            else:
                windows = layer(windows.view(batch, height, width, -1), **kwargs).view(windows.shape)
        hidden_states = window_unpartition(windows, window, (height, width), (height, width))
        return BaseModelOutput(last_hidden_state=hidden_states.view(batch, height * width, -1))


def in_window_order(rows: torch.Tensor, height: int, width: int, window: int) -> torch.Tensor:
    """`rows [H * W, ...]`, one per token in row-major order, put in the order `window_partition` puts the tokens."""
    return window_partition(rows.reshape(1, height, width, -1), window)[0].reshape(rows.shape)


@register("vit_window_order", after=("vit_rope_tables",))
def apply(model: nn.Module) -> None:
    for vit in model.vision_encoder.modules():
        if not isinstance(vit, Sam3ViTModel):
            continue
        config = vit.config
        size = config.image_size if isinstance(config.image_size, (list, tuple)) else (config.image_size,) * 2
        height, width, window = size[0] // config.patch_size, size[1] // config.patch_size, config.window_size
        if not window or height % window or width % window:
            continue  # padded windows (or none): transformers' order
        moved: set[int] = set()  # the rotary tables `vit_rope_tables` shares between the global layers
        for layer in vit.layers:
            if layer.window_size:
                layer.__class__ = WindowedLayer
                continue
            layer.position_ids = in_window_order(layer.position_ids, height, width, window)
            tables = layer.rotary_emb
            if hasattr(tables, "cos") and id(tables) not in moved:
                moved.add(id(tables))
                tables.cos, tables.sin = (in_window_order(t, height, width, window) for t in (tables.cos, tables.sin))
        vit.__class__ = WindowOrderViT
