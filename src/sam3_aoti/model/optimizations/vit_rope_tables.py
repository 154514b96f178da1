"""`vit_rope_tables`: the ViT's rotary embedding as two constant tables (cos and sin of each position's angles, one
pair for the windowed layers and one for the global), computed once when the model is built. transformers computes
them from the positions on every call, and Inductor fuses that into the kernel that rotates q and k, which then
evaluates a sine and a cosine for every element of every head of every image rather than once per position:
0.65 ms a layer at 16 images on an H100, 0.34 with the tables (benchmarks/h100-2026-12-06-vit-block-tables/)."""

from __future__ import annotations

import torch
from torch import nn
from transformers.models.sam3.modeling_sam3 import Sam3ViTLayer

from .registry import register


class RopeTables(nn.Module):
    """What `Sam3ViTRotaryEmbedding` returns for one grid of positions, as buffers: a stand-in for it whose
    `forward` takes the same arguments."""

    def __init__(self, rotary: nn.Module, position_ids: torch.Tensor):
        super().__init__()
        with torch.no_grad():
            cos, sin = rotary(position_ids, position_ids)
        self.cos = nn.Buffer(cos, persistent=False)
        self.sin = nn.Buffer(sin, persistent=False)

    def forward(self, hidden_states: torch.Tensor, position_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        return self.cos, self.sin


@register("vit_rope_tables")
def apply(model: nn.Module) -> None:
    tables = {}  # window size -> one module every layer of that size shares: each table once in the package
    for module in model.vision_encoder.modules():
        if isinstance(module, Sam3ViTLayer):
            if module.window_size not in tables:  # from the layer's own buffers, as its forward computes them
                tables[module.window_size] = RopeTables(module.rotary_emb, module.position_ids)
            module.rotary_emb = tables[module.window_size]
