"""precision=fp8: the ViT's linear layers as scaled fp8 GEMMs (Hopper's `torch._scaled_mm` and `F.scaled_mm`).

Each weight is quantized once when the model is built for export, each activation at run time, in the graph,
where Inductor fuses the max and the cast into the kernel that produces the activation (a LayerNorm, GELU or
attention output). The product runs in e4m3 with fp32 scales and returns bf16; the bias is added after it, in
the consumer's kernel. Most linears are row-wise: one scale per token, one per output channel. The MLP's fc2
reads GELU's 4736-wide output, whose row max Inductor computes in a looped reduction slower than the GEMM it
saves; there the activation has one scale per 1 x 128 group (a max within one tile) and the weight one per
128 x 128 block (`Fp8GroupLinear`; on the H200 one MLP at 16 images went 3.06 ms in bf16, 3.64 with rows, 2.52
with groups: benchmarks/h200-2026-12-05-vit-mlp-fp8/). Only the ViT (most of the GEMM time,
`experiments/speed_levers.py`) is rewritten; the rest of the model stays a bf16 build.

Written here rather than taken from torchao: its float8 path is not tested with torch.export + AOTInductor,
and this is a handful of aten ops the exported program keeps as they are.
"""

from __future__ import annotations

import torch
from torch import nn

from . import ops
from ..runtime.gelu_groups import E4M3, E4M3_MAX, GROUP, MIN_SCALE_AMAX, quantize_groups

# GROUP: the side of a scale's group (activations: 1 x GROUP, `quantize_groups`) and block (weights: GROUP x GROUP)
GROUPED = ("fc2",)  # the linears whose input is quantized in groups: the MLP's, after GELU
FP8_CAPABILITY = (8, 9)  # Ada and Hopper have fp8 tensor cores; _scaled_mm refuses older GPUs


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`x [M, K]` -> (e4m3 values, fp32 scales `[M, 1]`), with `x ~= values * scales` row by row."""
    amax = x.abs().amax(dim=-1, keepdim=True).float().clamp(min=MIN_SCALE_AMAX)
    scale = amax / E4M3_MAX
    return (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3), scale


def quantize_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight `[N, K]` -> (e4m3 values, fp32 scales `[N / 128, K / 128]`, one per 128 x 128 block)."""
    n, k = w.shape
    blocks = w.float().reshape(n // GROUP, GROUP, k // GROUP, GROUP)
    scale = blocks.abs().amax((1, 3), keepdim=True).clamp(min=MIN_SCALE_AMAX) / E4M3_MAX
    values = (blocks / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3).reshape(n, k)
    return values, scale.reshape(n // GROUP, k // GROUP)


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


class Fp8GroupLinear(nn.Module):
    """An `nn.Linear` whose product is blockwise-scaled fp8: the weight in e4m3 with one fp32 scale per 128 x 128
    block, the input quantized in 1 x 128 groups in the forward (`quantize_groups`). Both sizes are multiples
    of 128."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        weight, scale = quantize_blocks(linear.weight.detach())
        self.register_buffer("weight", weight)
        # [N/128, K/128 padded to a multiple of 4]: its .t() is the K-major layout torch's kernel takes
        self.register_buffer("weight_scale", nn.functional.pad(scale, (0, -scale.shape[1] % 4), value=1.0))
        bias = linear.bias.detach().to(torch.bfloat16) if linear.bias is not None else None
        self.register_buffer("bias", bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.on_groups(*quantize_groups(x.reshape(-1, self.in_features))).reshape(*x.shape[:-1],
                                                                                        self.out_features)

    def on_groups(self, groups: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
        """The product with the bias added, of an input already quantized: `groups [M, K]` e4m3, `scales [K / 128,
        M]` (`quantize_groups`)."""
        scale, blocks = scales.t(), self.in_features // GROUP  # [M, K/128], M-major as the kernel reads it
        if groups.is_cuda:
            out = nn.functional.scaled_mm(groups, self.weight.t(), scale, nn.functional.ScalingType.BlockWise1x128,
                                          self.weight_scale.t(), nn.functional.ScalingType.BlockWise128x128,
                                          output_dtype=torch.bfloat16)
        else:  # the same arithmetic where no blockwise kernel runs (CPU: the tests)
            rows = (groups.float().reshape(-1, blocks, GROUP) * scale[..., None]).reshape(groups.shape)
            weight = self.weight.float().reshape(-1, GROUP, blocks, GROUP) \
                * self.weight_scale[:, None, :blocks, None]
            out = (rows @ weight.reshape(self.out_features, self.in_features).t()).to(torch.bfloat16)
        return out + self.bias if self.bias is not None else out

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, e4m3 1x128 groups"


class Fp8Mlp(nn.Module):
    """A GELU MLP (transformers' `Sam3MLP`: fc1, GELU, fc2) whose fc2 takes groups: fc1's product row-wise fp8
    without its bias, then the bias, the GELU and the 1 x 128 group quantization of the result in one kernel
    (the op `sam3_aoti::gelu_quantize_groups`, `runtime.gelu_groups`), then fc2's blockwise product on those groups.
    The same arithmetic as `Fp8Linear`, GELU and `Fp8GroupLinear` one after the other, without the GELU's output
    written in bf16 and read back to be quantized."""

    def __init__(self, mlp: nn.Module):
        super().__init__()
        self.fc1, self.fc2 = Fp8Linear(mlp.fc1), Fp8GroupLinear(mlp.fc2)
        bias = self.fc1.bias if self.fc1.bias is not None else torch.zeros(mlp.fc1.out_features, dtype=torch.bfloat16)
        self.register_buffer("fc1_bias", bias)  # added in the kernel, not after fc1's product
        self.fc1.bias = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        hidden = self.fc1(x).reshape(-1, self.fc1.out_features)
        groups, scales = ops.gelu_quantize_groups(hidden, self.fc1_bias)
        return self.fc2.on_groups(groups, scales).reshape(*x.shape[:-1], self.fc2.out_features)


def fuses_into_fp8_mlp(module: nn.Module) -> bool:
    """A GELU MLP (erf GELU, as the ViT's) whose fc2 takes 1 x 128 groups: what `Fp8Mlp` replaces."""
    fc1, fc2, act = (getattr(module, n, None) for n in ("fc1", "fc2", "activation_fn"))
    gelu = type(act).__name__ == "GELUActivation" and getattr(act, "act", None) is nn.functional.gelu
    return (gelu and isinstance(fc1, nn.Linear) and isinstance(fc2, nn.Linear) and "fc2" in GROUPED
            and fc1.out_features == fc2.in_features and fc2.in_features % GROUP == 0
            and fc2.out_features % GROUP == 0 and fc1.in_features % 16 == 0 and fc1.out_features % 16 == 0)


def quantize_linears(part: nn.Module) -> int:
    """Swap every `nn.Linear` inside `part` for an `Fp8Linear`, or an `Fp8GroupLinear` where it is one of
    `GROUPED` and both its sizes are multiples of 128, and a GELU MLP whose fc2 so takes groups for an `Fp8Mlp` (in
    place); returns how many linears. Layers whose sizes are not multiples of 16 (the fp8 GEMM's alignment) stay as
    they are."""
    swapped = 0
    for name, child in list(part.named_children()):
        if fuses_into_fp8_mlp(child):
            setattr(part, name, Fp8Mlp(child))
            swapped += 2
        elif isinstance(child, nn.Linear):
            if name in GROUPED and child.in_features % GROUP == 0 and child.out_features % GROUP == 0:
                setattr(part, name, Fp8GroupLinear(child))
                swapped += 1
            elif child.in_features % 16 == 0 and child.out_features % 16 == 0:
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
