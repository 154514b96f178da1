"""`relu_epilogue`: the DETR encoder's ReLU MLPs with their first layer, bias and ReLU as one cuBLASLt GEMM
with a ReLU epilogue (`torch._addmm_activation`, an op AOTInductor calls through its C shim); Inductor
otherwise stores the GEMM's output and runs the ReLU over it. Measured in benchmarks/README.md."""

from __future__ import annotations

import torch
from torch import nn
from transformers.models.sam3.modeling_sam3 import Sam3MLP

from .registry import register


class ReluEpilogueMLP(Sam3MLP):
    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        flat = hidden_states.reshape(-1, hidden_states.shape[-1])
        hidden = torch._addmm_activation(self.fc1.bias, flat, self.fc1.weight.t())
        return self.fc2(hidden.view(*hidden_states.shape[:-1], hidden.shape[-1]))


@register("relu_epilogue")
def apply(model: nn.Module) -> None:
    for module in model.detr_encoder.modules():
        if type(module) is Sam3MLP and isinstance(module.activation_fn, nn.ReLU):
            module.__class__ = ReluEpilogueMLP
