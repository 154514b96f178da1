"""The ViT MLP's GELU and the fp8 quantization of its output in 1 x 128 groups, in one pass: the op
`sam3_aoti::gelu_quantize_groups`, what a precision=fp8 build's MLP runs between its two fp8 GEMMs
(`model.fp8.Fp8Mlp`).

fc1's product comes out of `torch._scaled_mm` (an extern kernel Inductor cannot fuse into), 4736 wide. The bias,
the GELU, each group's absolute max, the scale and the e4m3 values then need one read of the product and one write
of the values; Inductor's kernel for them took 0.82 ms for 16 images' tokens on the H200 against a bandwidth floor
of about 0.29 ms (benchmarks/h200-2026-12-05-vit-mlp-fp8/). Each program here holds a block of rows times one
group in registers and writes the group's values and scale. The arithmetic is the unfused graph's, step for step:
the bias added in bf16, GELU computed in fp32 and rounded to bf16 (as torch's bf16 GELU), the scale
`max(amax, 1e-12) / 448`, each value divided by it (IEEE division) and cast to e4m3 after clamping.

Like `runtime.attention` it is a `torch.library.triton_op` (AOTInductor compiles the kernel into the package) that
whatever deserializes an exported program imports first. Off CUDA, or for a shape the kernel does not take, it
is the same arithmetic in torch ops (`reference`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

try:
    import triton
    import triton.language as tl
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


@torch.library.triton_op("sam3_aoti::gelu_quantize_groups", mutates_args=())
def gelu_quantize_groups(x: torch.Tensor, bias: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    if (triton is None or not x.is_cuda or x.dtype not in (torch.bfloat16, torch.float16) or x.dim() != 2
            or x.shape[1] % GROUP or x.stride(1) != 1):
        return reference(x, bias)
    return launch_gelu_groups(x, bias.to(x.dtype), wrap=torch.library.wrap_triton)
