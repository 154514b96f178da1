"""`vit_gelu_epilogue`: the ViT's 32 MLPs with fc1, its bias and GELU as one cuBLASLt GEMM with a GELU epilogue
(`torch._addmm_activation`, as `relu_epilogue` does the DETR encoder's ReLU). Inductor otherwise stores fc1's
4736-wide output, reads it back for the GELU kernel and stores it again: that kernel is 0.6 ms a layer at 16 images
on an H100, fc1's GEMM 0.15 ms slower with the epilogue (experiments/vit_block.py,
benchmarks/h100-2026-12-06-vit-block*/).

The one optimization that is not transformers' arithmetic everywhere: cuBLASLt's GELU is the tanh approximation
(within 4.7e-4 of the exact erf GELU), so a 16-bit CUDA build computes that one; verify's and parity's gates hold
its drift like any other. The CPU's `_addmm_activation` computes the exact GELU, and an fp32 CUDA build keeps
transformers' exact MLP, where the approximation would be above the precision's own rounding."""

from __future__ import annotations

import torch
from torch import nn
from transformers.activations import GELUActivation
from transformers.models.sam3.modeling_sam3 import Sam3MLP

from .registry import register


class GeluEpilogueMLP(Sam3MLP):
    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        if hidden_states.is_cuda and self.fc1.weight.dtype == torch.float32:
            return super().forward(hidden_states)
        flat = hidden_states.reshape(-1, hidden_states.shape[-1])
        hidden = torch._addmm_activation(self.fc1.bias, flat, self.fc1.weight.t(), use_gelu=True)
        return self.fc2(hidden.view(*hidden_states.shape[:-1], hidden.shape[-1]))


@register("vit_gelu_epilogue")
def apply(model: nn.Module) -> None:
    for module in model.vision_encoder.modules():
        # exactly transformers' MLP with the exact GELU: an fp8 build's MLPs are its own (`fp8.Fp8Mlp`)
        if type(module) is Sam3MLP and type(module.activation_fn) is GELUActivation \
                and type(module.fc1) is nn.Linear:
            module.__class__ = GeluEpilogueMLP
