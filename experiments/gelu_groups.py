"""The fp8 MLP's recipes on 1 x 128 groups, which precision=fp8 no longer builds (its fc2 stays bf16,
`sam3_aoti.runtime.fp8_linear`): kept for the experiments that measured them (vit_mlp_fp8.py, fp8_fc1_fused.py,
gelu_groups_tune.py, gelu_groups_arithmetic.py). `F.scaled_mm`'s blockwise product fails under AOTInductor in
torch 2.11 (its proxy executor: benchmarks/h100-2026-12-06-fp8-fc1/), and the project's Triton form of it
(`launch_group_linear`) was slower than cuBLAS's bf16 GEMM.

- `quantize_groups`, `quantize_blocks`, `Fp8GroupLinear`: activations in 1 x 128 groups against 128 x 128 weight
  blocks.
- The op `sam3_experiment::gelu_quantize_groups`: the bias, GELU and group quantization in one pass over the bf16
  product of cuBLAS's fp8 GEMM. Each program holds a block of rows times one group; the arithmetic is the unfused
  graph's step for step (bf16 add, GELU in fp32 rounded to bf16, `max(amax, 1e-12) / 448`, IEEE division).
- `launch_group_linear`: fc2's blockwise product in Triton.
- fc1 as one Triton fp8 GEMM whose epilogue quantizes in groups: `fp8_fc1_fused.py`'s kernel (vit_mlp_fp8.py wraps it
  as an op).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

try:
    import triton
    import triton.language as tl

    from sam3_aoti.runtime.fp8_linear import tile_of  # the product's tile order
except ImportError:  # a CPU-only torch: the op runs its torch ops
    triton = None

E4M3 = torch.float8_e4m3fn
E4M3_MAX = float(torch.finfo(E4M3).max)  # 448
MIN_SCALE_AMAX = 1e-12  # an all-zero group gets a finite scale (its values quantize to 0 all the same)
GROUP = 128  # a scale's group: 1 x GROUP activations
ROWS = 32  # rows a program quantizes (one group of each)
NUM_WARPS = 4
GROUPS_FIRST = False  # the grid's fastest axis: the groups of the same rows (True) or the next rows' block (False)


def quantize_groups(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`x [M, K]` -> (e4m3 values, fp32 scales `[K / 128, M]`, one per 1 x 128 group: their `.t()` is the M-major
    `[M, K / 128]` the blockwise GEMM reads), with `x ~= values * scales` group by group."""
    m, k = x.shape
    groups = x.float().reshape(m, k // GROUP, GROUP)
    scale = groups.abs().amax(-1, keepdim=True).clamp(min=MIN_SCALE_AMAX) / E4M3_MAX
    values = (groups / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3).reshape(m, k)
    return values, scale.reshape(m, k // GROUP).t().contiguous()


def quantize_blocks(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """A weight `[N, K]` -> (e4m3 values, fp32 scales `[N / 128, K / 128]`, one per 128 x 128 block)."""
    n, k = w.shape
    blocks = w.float().reshape(n // GROUP, GROUP, k // GROUP, GROUP)
    scale = blocks.abs().amax((1, 3), keepdim=True).clamp(min=MIN_SCALE_AMAX) / E4M3_MAX
    values = (blocks / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3).reshape(n, k)
    return values, scale.reshape(n // GROUP, k // GROUP)



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


def reference(x: torch.Tensor, bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`x [M, K]` (fc1's product without its bias), `bias [K]` -> `quantize_groups(gelu(x + bias))`, in x's dtype
    up to the quantization."""
    return quantize_groups(F.gelu(x + bias.to(x.dtype)))


if triton is not None:
    @triton.jit
    def _gelu_quantize_groups_kernel(x_ptr, bias_ptr, values_ptr, scales_ptr, m, k, stride_x,
                                     ROWS: tl.constexpr, GROUP: tl.constexpr, E4M3_MAX: tl.constexpr,
                                     MIN_AMAX: tl.constexpr, GROUPS_FIRST: tl.constexpr):
        row_block, group = (tl.program_id(1), tl.program_id(0)) if GROUPS_FIRST else (tl.program_id(0),
                                                                                     tl.program_id(1))
        rows = (row_block * ROWS + tl.arange(0, ROWS)).to(tl.int64)  # M * K passes 2^31 at 64 images
        cols = group * GROUP + tl.arange(0, GROUP)
        inside = rows[:, None] < m
        x = tl.load(x_ptr + rows[:, None] * stride_x + cols[None, :], mask=inside, other=0.0)
        bias = tl.load(bias_ptr + cols)
        h = (x.to(tl.float32) + bias.to(tl.float32)).to(x.dtype).to(tl.float32)  # the add in x's dtype
        y = (h * 0.5 * (1.0 + tl.math.erf(h * 0.7071067811865476))).to(x.dtype).to(tl.float32)  # torch's GELU
        scale = tl.maximum(tl.max(tl.abs(y), axis=1), MIN_AMAX) / E4M3_MAX
        values = tl.clamp(tl.math.div_rn(y, scale[:, None]), -E4M3_MAX, E4M3_MAX)
        tl.store(values_ptr + rows[:, None] * k + cols[None, :], values.to(tl.float8e4nv), mask=inside)
        tl.store(scales_ptr + group * m + rows, scale, mask=rows < m)


if triton is not None:
    @triton.jit
    def _group_linear_kernel(a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, bias_ptr, out_ptr, m, n: tl.constexpr,
                             k: tl.constexpr, scale_stride: tl.constexpr, BLOCK_M: tl.constexpr, GROUP: tl.constexpr,
                             GROUP_M: tl.constexpr):
        """`out = (a * a_scales) @ (w * w_scales).T + bias` over 1 x GROUP activation groups and GROUP x GROUP weight
        blocks: each step of the K loop is one group, its product scaled into the fp32 sum (a tile is one block
        wide, so one weight scale a step)."""
        block_m, block_n = tile_of(tl.program_id(0), m, n, BLOCK_M, GROUP, GROUP_M)
        rows = (block_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)
        cols = block_n * GROUP + tl.arange(0, GROUP)
        depth = tl.arange(0, GROUP)
        a_at = a_ptr + rows[:, None] * k + depth[None, :]
        w_at = w_ptr + cols[None, :].to(tl.int64) * k + depth[:, None]
        acc = tl.zeros((BLOCK_M, GROUP), dtype=tl.float32)
        for step in range(0, k // GROUP):
            part = tl.dot(tl.load(a_at, mask=rows[:, None] < m, other=0.0),
                          tl.load(w_at, mask=cols[None, :] < n, other=0.0))
            a_scale = tl.load(a_scale_ptr + step * m + rows, mask=rows < m, other=0.0)
            acc += part * (a_scale * tl.load(w_scale_ptr + block_n * scale_stride + step))[:, None]
            a_at += GROUP
            w_at += GROUP
        out = acc + tl.load(bias_ptr + cols, mask=cols < n, other=0.0).to(tl.float32)[None, :]
        tl.store(out_ptr + rows[:, None] * n + cols[None, :], out.to(out_ptr.dtype.element_ty),
                 mask=(rows[:, None] < m) & (cols[None, :] < n))


GROUP_LINEAR_LAUNCH = {"block_m": 128, "num_warps": 8, "num_stages": 3}


def launch_group_linear(groups, scales, weight, weight_scales, bias, wrap=lambda kernel: kernel, **launch):
    """`groups [M, K]` e4m3 with `scales [K / 128, M]` (what the fused fc1 writes), `weight [N, K]` e4m3 with
    `weight_scales [N / 128, >= K / 128]` (`model.fp8.quantize_blocks`, padded), `bias [N]` -> bf16 `[M, N]`."""
    launch = {**GROUP_LINEAR_LAUNCH, **launch}
    m, k = groups.shape
    n = weight.shape[0]
    out = torch.empty((m, n), dtype=torch.bfloat16, device=groups.device)
    grid = (triton.cdiv(m, launch["block_m"]) * triton.cdiv(n, GROUP),)
    wrap(_group_linear_kernel)[grid](groups, scales, weight, weight_scales, bias, out, m, n, k,
                                     weight_scales.stride(0), BLOCK_M=launch["block_m"], GROUP=GROUP, GROUP_M=8,
                                     num_warps=launch["num_warps"], num_stages=launch["num_stages"])
    return out


def launch_gelu_groups(x: torch.Tensor, bias: torch.Tensor, wrap=lambda kernel: kernel, rows: int = ROWS,
                       num_warps: int = NUM_WARPS, groups_first: bool = GROUPS_FIRST):
    """The kernel on `x [M, K]` (K a multiple of 128, rows contiguous) and `bias [K]`; `wrap`:
    `torch.library.wrap_triton` inside the op (so export and AOTInductor trace it), identity when called directly
    (Triton's interpreter in the tests). `rows`, `num_warps` and `groups_first` are the launch's shape
    (`experiments/gelu_groups_tune.py` times them); every choice computes the same values."""
    m, k = x.shape
    values = torch.empty((m, k), dtype=E4M3, device=x.device)
    scales = torch.empty((k // GROUP, m), dtype=torch.float32, device=x.device)
    grid = (k // GROUP, triton.cdiv(m, rows)) if groups_first else (triton.cdiv(m, rows), k // GROUP)
    wrap(_gelu_quantize_groups_kernel)[grid](x, bias, values, scales, m, k, x.stride(0), ROWS=rows, GROUP=GROUP,
                                             E4M3_MAX=E4M3_MAX, MIN_AMAX=MIN_SCALE_AMAX,
                                             GROUPS_FIRST=groups_first, num_warps=num_warps)
    return values, scales


@torch.library.triton_op("sam3_experiment::gelu_quantize_groups", mutates_args=())
def gelu_quantize_groups(x: torch.Tensor, bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if (triton is None or not x.is_cuda or x.dtype not in (torch.bfloat16, torch.float16) or x.dim() != 2
            or x.shape[1] % GROUP or x.stride(1) != 1):
        return reference(x, bias)
    return launch_gelu_groups(x, bias.to(x.dtype), wrap=torch.library.wrap_triton)
