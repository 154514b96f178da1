"""precision=fp8: the ViT's linear layers as scaled fp8 GEMMs (Hopper's `torch._scaled_mm`, and a Triton GEMM for the
MLP's fc1).

Each weight is quantized once when the model is built for export, each activation at run time, in the graph, where
Inductor fuses the row max and the cast into the kernel that produces the activation (a LayerNorm, or the attention
output). The product runs in e4m3 with fp32 scales, one per token and one per output channel, adds the bias in its
epilogue and returns bf16. The MLP's fc1 is one Triton GEMM with its bias and GELU in the epilogue (`Fp8Mlp`,
`runtime.fp8_linear`), and with the optimization `vit_qkv_rope` so is each attention's q, k, v projection, with q's
and k's rotary embedding in its epilogue; the MLP's fc2 stays bf16: GELU's 4736-wide output needs a row max that
costs more than the fp8 GEMM saves, its 1 x 128 group form (`F.scaled_mm`, blockwise) fails under AOTInductor in
torch 2.11, and the project's Triton form was slower than cuBLAS's bf16 GEMM (benchmarks/h100-2026-12-06-fp8-fc1/).
Only the ViT (most of the GEMM time, `experiments/speed_levers.py`) is rewritten; the rest of the model stays a bf16
build.

Written here rather than taken from torchao: its float8 path is not tested with torch.export + AOTInductor,
and this is a handful of aten ops the exported program keeps as they are.
"""

from __future__ import annotations

import torch
from torch import nn

from . import ops
from ..runtime.contract import FP8_CAPABILITY, FP8_NEEDS

E4M3 = torch.float8_e4m3fn
E4M3_MAX = float(torch.finfo(E4M3).max)  # 448
MIN_SCALE_AMAX = 1e-12  # an all-zero row gets a finite scale (its values quantize to 0 all the same)


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`x [M, K]` -> (e4m3 values, fp32 scales `[M, 1]`), with `x ~= values * scales` row by row."""
    amax = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=MIN_SCALE_AMAX)
    scale = amax / E4M3_MAX
    return (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3), scale


class Fp8Linear(nn.Module):
    """An `nn.Linear` whose product is rowwise-scaled fp8: the weight stored in e4m3 with one fp32 scale per
    output channel (half the bytes of bf16), the input quantized per row in the forward."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight, scale = quantize_rows(linear.weight.detach())
        self.register_buffer("weight", weight)  # [N, K] row-major: its .t() is the column-major operand
        self.register_buffer("weight_scale", scale.t().contiguous())  # [1, N]
        bias = linear.bias.detach().to(torch.bfloat16) if linear.bias is not None else None
        self.register_buffer("bias", bias)

    @classmethod
    def stacked(cls, linears: list["Fp8Linear"]) -> "Fp8Linear":
        """One layer whose output is `linears`' side by side, for layers that read one input: their weights,
        scales and biases concatenated (exact: each output channel keeps its own scale)."""
        stack = cls.__new__(cls)
        nn.Module.__init__(stack)
        stack.in_features, stack.out_features = linears[0].in_features, sum(ln.out_features for ln in linears)
        stack.register_buffer("weight", torch.cat([ln.weight for ln in linears]))
        stack.register_buffer("weight_scale", torch.cat([ln.weight_scale for ln in linears], dim=1))
        biases = [ln.bias if ln.bias is not None else ln.weight_scale.new_zeros(ln.out_features, dtype=torch.bfloat16)
                  for ln in linears]
        stack.register_buffer("bias", None if all(ln.bias is None for ln in linears) else torch.cat(biases))
        return stack

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows, scale = quantize_rows(x.reshape(-1, self.in_features))
        if rows.is_cuda:  # the bias in the GEMM's epilogue, added in fp32 before the one rounding to bf16
            out = torch._scaled_mm(rows, self.weight.t(), scale_a=scale, scale_b=self.weight_scale, bias=self.bias,
                                   out_dtype=torch.bfloat16)
        else:  # the same arithmetic where _scaled_mm has no rowwise kernel (CPU: the tests)
            out = (rows.float() @ self.weight.float().t()) * scale * self.weight_scale
            out = (out if self.bias is None else out + self.bias.float()).to(torch.bfloat16)
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, e4m3 rowwise"


class Fp8Mlp(nn.Module):
    """A GELU MLP (transformers' `Sam3MLP`: fc1, GELU, fc2) with fc1 as one fp8 GEMM whose epilogue adds the bias
    and applies the GELU (the op `sam3_aoti::fp8_linear_gelu`, `runtime.fp8_linear`), its input quantized per row
    in the kernel of the LayerNorm before it, and fc2 a bf16 GEMM. fc1's product is never written. Its GELU is the
    tanh form, as cuBLASLt's epilogue computes it in a bf16 build (`vit_gelu_epilogue`)."""

    def __init__(self, mlp: nn.Module):
        super().__init__()
        self.fc1, self.fc2 = Fp8Linear(mlp.fc1), mlp.fc2
        bias = self.fc1.bias if self.fc1.bias is not None else torch.zeros(mlp.fc1.out_features, dtype=torch.bfloat16)
        self.register_buffer("fc1_bias", bias)  # added in the kernel, not after fc1's product
        self.fc1.bias = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows, row_scales = quantize_rows(x.reshape(-1, self.fc1.in_features))
        hidden = ops.fp8_linear_gelu(rows, row_scales, self.fc1.weight, self.fc1.weight_scale, self.fc1_bias)
        return self.fc2(hidden.view(*x.shape[:-1], self.fc1.out_features))


def fuses_into_fp8_mlp(module: nn.Module) -> bool:
    """A GELU MLP (erf GELU, as the ViT's) whose fc1 the fp8 GEMM takes: what `Fp8Mlp` replaces."""
    fc1, fc2, act = (getattr(module, n, None) for n in ("fc1", "fc2", "activation_fn"))
    gelu = type(act).__name__ == "GELUActivation" and getattr(act, "act", None) is nn.functional.gelu
    return (gelu and isinstance(fc1, nn.Linear) and isinstance(fc2, nn.Linear)
            and fc1.in_features % 16 == 0 and fc1.out_features % 16 == 0)


def quantize_linears(part: nn.Module) -> int:
    """Swap every `nn.Linear` inside `part` for an `Fp8Linear`, and each GELU MLP for an `Fp8Mlp` (fc1 in fp8, fc2
    left in bf16), in place; returns how many linears went to fp8. Layers whose sizes are not multiples of 16 (the
    fp8 GEMM's alignment) stay as they are."""
    swapped = 0
    for name, child in list(part.named_children()):
        if fuses_into_fp8_mlp(child):
            setattr(part, name, Fp8Mlp(child))
            swapped += 1
        elif isinstance(child, nn.Linear):
            if child.in_features % 16 == 0 and child.out_features % 16 == 0:
                setattr(part, name, Fp8Linear(child))
                swapped += 1
        else:
            swapped += quantize_linears(child)
    return swapped


def check_fp8_device(device: torch.device) -> str | None:
    """Why fp8 GEMMs cannot run on `device` (None when they can)."""
    if device.type != "cuda":
        return "fp8 GEMMs need a CUDA GPU"
    capability = torch.cuda.get_device_capability(device)
    if capability < FP8_CAPABILITY:
        return (f"{torch.cuda.get_device_name(device)} (compute capability {capability[0]}.{capability[1]}) has no "
                f"fp8 tensor cores: fp8 needs {FP8_NEEDS}")
    return None
