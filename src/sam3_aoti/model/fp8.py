"""precision=fp8: the ViT's linear layers as rowwise-scaled fp8 GEMMs (Hopper's `torch._scaled_mm`).

Each weight is quantized once, per output channel, when the model is built for export; each activation per
row (token) at run time, in the graph, where Inductor fuses the row max and the cast into the kernel that
produces the activation (a LayerNorm, GELU or attention output). The product runs in e4m3 with fp32 scales
and returns bf16; the bias is added after it, in the consumer's kernel. Only the ViT (most of the GEMM time,
`experiments/speed_levers.py`) is rewritten; the rest of the model stays a bf16 build.

Written here rather than taken from torchao: its float8 path is not tested with torch.export + AOTInductor,
and this is a handful of aten ops the exported program keeps as they are.
"""

from __future__ import annotations

import torch
from torch import nn

E4M3 = torch.float8_e4m3fn
E4M3_MAX = float(torch.finfo(E4M3).max)  # 448
MIN_SCALE_AMAX = 1e-12  # an all-zero row gets a finite scale (its values quantize to 0 all the same)
FP8_CAPABILITY = (8, 9)  # Ada and Hopper have fp8 tensor cores; _scaled_mm refuses older GPUs


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

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        rows, scale = quantize_rows(x.reshape(-1, self.in_features))
        if rows.is_cuda:
            out = torch._scaled_mm(rows, self.weight.t(), scale_a=scale, scale_b=self.weight_scale,
                                   out_dtype=torch.bfloat16)
        else:  # the same arithmetic where _scaled_mm has no rowwise kernel (CPU: the tests)
            out = ((rows.float() @ self.weight.float().t()) * scale * self.weight_scale).to(torch.bfloat16)
        if self.bias is not None:
            out = out + self.bias
        return out.reshape(*x.shape[:-1], self.out_features)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, e4m3 rowwise"


def quantize_linears(part: nn.Module) -> int:
    """Swap every `nn.Linear` inside `part` for an `Fp8Linear` (in place); returns how many. Layers whose
    sizes are not multiples of 16 (the fp8 GEMM's alignment) stay as they are."""
    swapped = 0
    for name, child in list(part.named_children()):
        if isinstance(child, nn.Linear):
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
                "fp8 tensor cores: fp8 needs 8.9 or newer (Ada, Hopper)")
    return None
