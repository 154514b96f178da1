"""The ViT MLP's fc1 in a precision=fp8 build: one Triton fp8 GEMM whose epilogue applies the row and column scales,
the bias and the GELU, and writes bf16 for fc2 (the op `sam3_aoti::fp8_linear_gelu`, `model.fp8.Fp8Mlp`).

cuBLAS's fp8 GEMM (`torch._scaled_mm`) has no GELU epilogue, so fc1's 4736-wide product went out in bf16 and came
back for a GELU kernel: fp8 fc1 then cost what it saved. Here the product stays in registers. The epilogue must be
cheap in instructions, or it costs more than the GEMM (experiments/fp8_fc1_fused.py,
benchmarks/h100-2026-12-06-fp8-fc1/, 16 images' tokens on an H100: 1.9-2.1 ms with every step of the unfused
graph's arithmetic, erf and IEEE division; 0.97 ms with this one, the time of its product alone, which runs at
83-95 % of cuBLAS's fp8 rate): no bf16 rounding between the steps, and GELU's tanh form on the SFU's
`tanh.approx.f32` (the form cuBLASLt's GELU epilogue computes in a bf16 build, `vit_gelu_epilogue`). `reference`
is the same arithmetic in torch ops.

fc2 stays a bf16 GEMM: its fp8 form on 1 x 128 groups (`F.scaled_mm`, blockwise) runs through AOTInductor's proxy
executor, which fails in torch 2.11, and the project's Triton form of it was slower than cuBLAS's bf16 GEMM
(benchmarks/h100-2026-12-06-fp8-fc1/vit-mlp-fp8.md: one MLP at 16 images 2.43 ms this way, 2.65 in bf16).

The ViT attention's q, k, v projection (`sam3_aoti::fp8_linear_rope`, the optimization `vit_qkv_rope`) is the same
GEMM with the rotary embedding of q and k in its epilogue: each token's angle for each pair of channels read from a
table, where the unfused graph wrote q and k in bf16 and read them again to rotate them. At 16 images on an H100 it
takes 0.68-0.71 ms for a layer, where cuBLAS's fp8 product alone takes 0.56 and the product and the rotation 0.83
(global layers 1.16); of the launch shapes tried, today's is the fastest (benchmarks/h100-2026-12-06-fp8-qkv-rope/).

Like `runtime.attention` each is a `torch.library.triton_op` (AOTInductor compiles the kernel into the package) that
whatever deserializes an exported program imports first. Off CUDA, or for a shape its kernel does not take, each is
its torch form (`reference`, `rope_reference`).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import register_flop_formula

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU-only torch: the op runs its torch ops
    triton = None

E4M3 = torch.float8_e4m3fn
# 128 x 256 tiles, 128 deep, 8 warps, 3 stages: the fastest of 14 pointer and TMA launch shapes on an H100
# (benchmarks/h100-2026-12-06-fp8-fc1/), within 2 % of Triton's persistent TMA form
LAUNCH = {"block_m": 128, "block_n": 256, "block_k": 128, "num_warps": 8, "num_stages": 3}


def reference(rows: torch.Tensor, row_scales: torch.Tensor, weight: torch.Tensor, weight_scales: torch.Tensor,
              bias: torch.Tensor) -> torch.Tensor:
    """`rows [M, K]` e4m3 with `row_scales [M, 1]`, `weight [N, K]` e4m3 with `weight_scales [1, N]`, `bias [N]` ->
    bf16 `gelu_tanh(rows @ weight.T * scales + bias)`, in fp32 until the end (the kernel's arithmetic, up to the
    order of its sums and the SFU's tanh)."""
    return F.gelu(scaled_product(rows, row_scales, weight, weight_scales, bias), approximate="tanh").to(torch.bfloat16)


def scaled_product(rows: torch.Tensor, row_scales: torch.Tensor, weight: torch.Tensor, weight_scales: torch.Tensor,
                   bias: torch.Tensor) -> torch.Tensor:
    """`rows @ weight.T` with its row and column scales and bias, in fp32: both kernels' product."""
    return (rows.float() @ weight.float().t()) * row_scales * weight_scales + bias.float()


def rotate_pairs(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """`x [..., D]` with each pair of channels (2i, 2i + 1) rotated by its angle (`cos`, `sin` broadcast against
    `[..., D / 2]`): transformers' `apply_rotary_pos_emb_2d` with each angle once, not repeated for the pair."""
    even, odd = x.unflatten(-1, (-1, 2)).unbind(-1)
    return torch.stack((even * cos - odd * sin, odd * cos + even * sin), -1).flatten(-2)


def rope_reference(rows: torch.Tensor, row_scales: torch.Tensor, weight: torch.Tensor, weight_scales: torch.Tensor,
                   bias: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotated: int) -> torch.Tensor:
    """`rows @ weight.T * scales + bias` (`reference`'s operands, bf16 out) with its first `rotated` columns (q's and
    k's heads) rotated pairwise as transformers' `apply_rotary_pos_emb_2d` rotates them: `cos`, `sin` `[L, D / 2]`
    hold each of L positions' angle per pair of a D-wide head, and row r is position r % L (the tokens of each
    window, or image, in the tables' order). In fp32 until the end, as the kernel."""
    product = scaled_product(rows, row_scales, weight, weight_scales, bias)
    positions, half = cos.shape
    at = torch.arange(rows.shape[0], device=rows.device) % positions
    cos, sin = cos.float()[at][:, None], sin.float()[at][:, None]  # [M, 1, D / 2]: one angle per pair, every head
    turned = rotate_pairs(product[:, :rotated].unflatten(-1, (-1, 2 * half)), cos, sin).flatten(1)
    return torch.cat((turned, product[:, rotated:]), 1).to(torch.bfloat16)


if triton is not None:
    @triton.jit
    def _tanh(x, APPROX: tl.constexpr):
        if APPROX:  # one SFU instruction, about 2^-11 off
            return tl.inline_asm_elementwise("tanh.approx.f32 $0, $1;", "=r,r", [x], dtype=tl.float32,
                                             is_pure=True, pack=1)
        return 2.0 / (1.0 + tl.exp(-2.0 * x)) - 1.0  # Triton's interpreter runs no PTX

    @triton.jit
    def gelu_tanh(h, APPROX: tl.constexpr):
        """GELU's tanh form of an fp32 tile, in about 20 instructions an element with APPROX (the SFU's tanh)."""
        return 0.5 * h * (1.0 + _tanh(0.7978845608028654 * (h + 0.044715 * h * h * h), APPROX))

    @triton.jit
    def tile_of(pid, m, n, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, GROUP_M: tl.constexpr):
        """Program `pid`'s tile of an `[m, n]` output, as (row block, column block): programs take GROUP_M row
        blocks column by column, so a band's weights stay in L2."""
        blocks_m, blocks_n = tl.cdiv(m, BLOCK_M), tl.cdiv(n, BLOCK_N)
        per_band = GROUP_M * blocks_n
        first_m = (pid // per_band) * GROUP_M
        band_m = tl.minimum(blocks_m - first_m, GROUP_M)
        return first_m + (pid % per_band) % band_m, (pid % per_band) // band_m

    @triton.jit
    def scaled_tile(a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, bias_ptr, m, n: tl.constexpr, k: tl.constexpr,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr):
        """This program's tile of `rows @ weight.T * scales + bias` in fp32, with its row and column indices."""
        block_m, block_n = tile_of(tl.program_id(0), m, n, BLOCK_M, BLOCK_N, GROUP_M)
        rows = (block_m * BLOCK_M + tl.arange(0, BLOCK_M)).to(tl.int64)  # M * N passes 2^31 at 64 images
        cols = block_n * BLOCK_N + tl.arange(0, BLOCK_N)
        depth = tl.arange(0, BLOCK_K)
        a_at = a_ptr + rows[:, None] * k + depth[None, :]  # [BLOCK_M, BLOCK_K] of the row-major activations
        w_at = w_ptr + cols[None, :].to(tl.int64) * k + depth[:, None]  # [BLOCK_K, BLOCK_N] of the K-major weight
        acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
        for _ in range(0, k // BLOCK_K):  # k a constexpr: the interpreter ranges over no runtime int
            acc = tl.dot(tl.load(a_at, mask=rows[:, None] < m, other=0.0),
                         tl.load(w_at, mask=cols[None, :] < n, other=0.0), acc)
            a_at += BLOCK_K
            w_at += BLOCK_K
        a_scale = tl.load(a_scale_ptr + rows, mask=rows < m, other=0.0)
        w_scale = tl.load(w_scale_ptr + cols, mask=cols < n, other=0.0)
        bias = tl.load(bias_ptr + cols, mask=cols < n, other=0.0).to(tl.float32)
        return acc * a_scale[:, None] * w_scale[None, :] + bias[None, :], rows, cols, block_n

    @triton.jit
    def _linear_gelu_kernel(a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, bias_ptr, out_ptr, m, n: tl.constexpr,
                            k: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                            GROUP_M: tl.constexpr, APPROX_TANH: tl.constexpr):
        h, rows, cols, _ = scaled_tile(a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, bias_ptr, m, n, k, BLOCK_M, BLOCK_N,
                                       BLOCK_K, GROUP_M)
        g = gelu_tanh(h, APPROX_TANH)
        tl.store(out_ptr + rows[:, None] * n + cols[None, :], g.to(out_ptr.dtype.element_ty),
                 mask=(rows[:, None] < m) & (cols[None, :] < n))

    @triton.jit
    def _linear_rope_kernel(a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, bias_ptr, cos_ptr, sin_ptr, out_ptr, m,
                            positions, rotated, n: tl.constexpr, k: tl.constexpr, HALF: tl.constexpr,
                            BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                            GROUP_M: tl.constexpr):
        h, rows, cols, block_n = scaled_tile(a_ptr, a_scale_ptr, w_ptr, w_scale_ptr, bias_ptr, m, n, k, BLOCK_M,
                                             BLOCK_N, BLOCK_K, GROUP_M)
        if block_n * BLOCK_N < rotated:  # q's and k's columns (the tile lies wholly on one side: launch_linear_rope)
            even, odd = tl.split(tl.reshape(h, (BLOCK_M, BLOCK_N // 2, 2)))  # each head's (2i, 2i + 1) pairs
            pair = (block_n * BLOCK_N // 2 + tl.arange(0, BLOCK_N // 2)) % HALF  # the pair's place in its head
            at = (rows % positions)[:, None] * HALF + pair[None, :]  # the token's position, the pair's angle
            cos = tl.load(cos_ptr + at, mask=rows[:, None] < m, other=0.0)
            sin = tl.load(sin_ptr + at, mask=rows[:, None] < m, other=0.0)
            h = tl.reshape(tl.join(even * cos - odd * sin, odd * cos + even * sin), (BLOCK_M, BLOCK_N))
        tl.store(out_ptr + rows[:, None] * n + cols[None, :], h.to(out_ptr.dtype.element_ty),
                 mask=(rows[:, None] < m) & (cols[None, :] < n))


def takes(rows: torch.Tensor, weight: torch.Tensor) -> bool:
    """Whether the kernel runs this product: on CUDA, contiguous e4m3 operands, K a multiple of 16 (a tile's
    least depth)."""
    return (triton is not None and rows.is_cuda and rows.dtype == weight.dtype == E4M3 and rows.is_contiguous()
            and weight.is_contiguous() and rows.shape[1] % 16 == 0)


def launched(kernel, operands: tuple, wrap, launch: dict, extra: tuple = (), **constants) -> torch.Tensor:
    """`kernel` over the product of `operands`' rows (the first) and weight (the third): called with the operands,
    its bf16 output, m, `extra`, n, k, the launch's tiles and `constants`; `launch` overrides `LAUNCH`."""
    launch = {**LAUNCH, **launch}
    rows, weight = operands[0], operands[2]
    m, k = rows.shape
    n = weight.shape[0]
    block_k = next(depth for depth in (launch["block_k"], 64, 32, 16) if k % depth == 0)
    out = torch.empty((m, n), dtype=torch.bfloat16, device=rows.device)
    grid = (triton.cdiv(m, launch["block_m"]) * triton.cdiv(n, launch["block_n"]),)
    wrap(kernel)[grid](*operands, out, m, *extra, n, k, BLOCK_M=launch["block_m"], BLOCK_N=launch["block_n"],
                       BLOCK_K=block_k, GROUP_M=8, num_warps=launch["num_warps"], num_stages=launch["num_stages"],
                       **constants)
    return out


def launch_linear_gelu(rows, row_scales, weight, weight_scales, bias, wrap=lambda kernel: kernel,
                       approx_tanh: bool = True, **launch) -> torch.Tensor:
    """The kernel on `reference`'s arguments; `wrap`: `torch.library.wrap_triton` inside the op (so export and
    AOTInductor trace it), identity when called directly (Triton's interpreter in the tests, with
    `approx_tanh=False`); `launch` overrides `LAUNCH`."""
    return launched(_linear_gelu_kernel, (rows, row_scales, weight, weight_scales, bias), wrap, launch,
                    APPROX_TANH=approx_tanh)


def takes_rope(rows: torch.Tensor, weight: torch.Tensor, cos: torch.Tensor, rotated: int) -> bool:
    """Whether the rope kernel runs this product: what `takes` asks, and tiles that lie wholly among the rotated
    columns or wholly past them."""
    return takes(rows, weight) and rotated % LAUNCH["block_n"] == 0 and cos.is_contiguous()


def launch_linear_rope(rows, row_scales, weight, weight_scales, bias, cos, sin, rotated: int,
                       wrap=lambda kernel: kernel, **launch) -> torch.Tensor:
    """The rope kernel on `rope_reference`'s arguments (`wrap` as `launch_linear_gelu`'s)."""
    return launched(_linear_rope_kernel, (rows, row_scales, weight, weight_scales, bias, cos, sin), wrap, launch,
                    (cos.shape[0], rotated), HALF=cos.shape[1])


@torch.library.triton_op("sam3_aoti::fp8_linear_gelu", mutates_args=())
def fp8_linear_gelu(rows: torch.Tensor, row_scales: torch.Tensor, weight: torch.Tensor, weight_scales: torch.Tensor,
                    bias: torch.Tensor) -> torch.Tensor:
    if not takes(rows, weight):
        return reference(rows, row_scales, weight, weight_scales, bias)
    return launch_linear_gelu(rows, row_scales.contiguous(), weight, weight_scales.contiguous(), bias,
                              wrap=torch.library.wrap_triton)


@register_flop_formula(torch.ops.sam3_aoti.fp8_linear_gelu)
def linear_gelu_flops(rows_shape, row_scales_shape, weight_shape, *args, out_shape=None, **kwargs) -> int:
    """The product's count (bench's FLOPs per part): the FlopCounterMode sees the op, not the kernel inside it."""
    return 2 * rows_shape[0] * rows_shape[1] * weight_shape[0]


@torch.library.triton_op("sam3_aoti::fp8_linear_rope", mutates_args=())
def fp8_linear_rope(rows: torch.Tensor, row_scales: torch.Tensor, weight: torch.Tensor, weight_scales: torch.Tensor,
                    bias: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, rotated: int) -> torch.Tensor:
    if not takes_rope(rows, weight, cos, rotated):
        return rope_reference(rows, row_scales, weight, weight_scales, bias, cos, sin, rotated)
    return launch_linear_rope(rows, row_scales.contiguous(), weight, weight_scales.contiguous(), bias, cos.float(),
                              sin.float(), rotated, wrap=torch.library.wrap_triton)


@register_flop_formula(torch.ops.sam3_aoti.fp8_linear_rope)
def linear_rope_flops(rows_shape, row_scales_shape, weight_shape, *args, out_shape=None, **kwargs) -> int:
    return 2 * rows_shape[0] * rows_shape[1] * weight_shape[0]
