"""Attention over SAM3's 72 x 72 image tokens at head dim 32 as one Triton flash-attention kernel: the op
`sam3_aoti::attention`, for the DETR encoder's self-attention and the DETR decoder's box-biased cross-attention.

At head dim 32 a score costs 128 FLOPs on the tensor cores and one exp2 on the SFU; SDPA's kernels, built for
larger head dims, stay well above this kernel (experiments/attention_kernel.py). What binds it is the issue of
the other instructions per score, not the SFU: exps moved to the FMA units, packed bf16x2 exps, unmasked keys and
a lazy rescale each made it slower (benchmarks/README.md, "The attention kernel's scores").

The decoder's bias is a sum of two per-axis tables (`bias_y[.., i, y] + bias_x[.., i, x]` for key
`j = y * side + x`, transformers' `_get_rpb_matrix`), which SDPA needs assembled as `[N, heads, Q, side * side]`
(a large write per layer and pair); the kernel reads the two tables instead. Tables with
fewer rows than there are queries bias the last rows only (the decoder's presence token, row 0, attends to every
image token alike, so its row is never padded onto the tables). Queries,
keys and values are read in the layout the projections leave them (`[B, L, H, D]` viewed as `[B, H, L, D]`),
and the output is written as `[B, Lq, H, D]`, the layout the output projection reads.

Like `runtime.box_bias` it is a `torch.library.triton_op` (AOTInductor compiles the kernel into the package)
that whatever deserializes an exported program imports first. Off CUDA, in fp32, or where a shape does not fit
the kernel, it is SDPA with the bias assembled.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import register_flop_formula, sdpa_flop_count

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU-only torch: the op runs SDPA
    triton = None

# (BLOCK_M, BLOCK_N, num_warps, num_stages), as experiments/attention_kernel.py measured them on the H200 (the DETR's
# head dim 32) and experiments/vit_attention.py on an H100 (the ViT's head dim 64: its windows of 576 tokens, and
# its global blocks of 5,184, "long"); a biased key block is GRID_CELL x GRID_CELL grid cells (BLOCK_N = 64)
CONFIG = {"plain": (64, 64, 4, 4), "biased": (64, 64, 4, 3), "wide": (64, 64, 4, 3), "long": (128, 64, 8, 3)}
LONG = 2048  # keys from which a head dim of 64 takes the "long" tiles
GRID_CELL = 8
MASK_ROW_ALIGN = 8  # elements: the memory-efficient kernel's bias alignment (aten attention.cpp preprocess_mask)


def grid_bias(bias_y: torch.Tensor, bias_x: torch.Tensor) -> torch.Tensor:
    """`[B, H, Q, rows]` and `[B, H, Q, side]` per-axis tables -> the `[B, H, Q, rows * side]` bias they mean."""
    return (bias_y[..., :, None] + bias_x[..., None, :]).flatten(-2)


def aligned_rows(mask: torch.Tensor) -> torch.Tensor:
    """An additive mask with its rows padded to a multiple of MASK_ROW_ALIGN elements and sliced back (only the
    strides change), as the memory-efficient kernel wants its bias (model.export_fixes' `dense_mask` uses it too)."""
    keys = mask.shape[-1]
    width = keys + -keys % MASK_ROW_ALIGN if isinstance(keys, int) else _aligned_bound(keys)
    return F.pad(mask, (0, width - keys))[..., :keys]


def _aligned_bound(keys) -> int:
    """A dynamic key count (the exemplar boxes' geometry tokens) as export sees it: its largest value rounded up
    to MASK_ROW_ALIGN, a static row stride. Padding to the count's own multiple of 8 makes export guard on it."""
    upper = keys.node.shape_env.bound_sympy(keys.node.expr).upper
    if not upper.is_finite:
        return keys + -keys % MASK_ROW_ALIGN
    return int(upper) + -int(upper) % MASK_ROW_ALIGN


def reference(query, key, value, scale: float, bias_y=None, bias_x=None) -> torch.Tensor:
    """What the op computes, as SDPA: `[B, H, L, D]` in, `[B, Lq, H, D]` out, in the query's dtype."""
    mask = None
    if bias_y is not None:  # zero rows for the queries the tables leave out, at the top
        unbiased = query.shape[2] - bias_y.shape[2]
        mask = aligned_rows(F.pad(grid_bias(bias_y, bias_x), (0, 0, unbiased, 0)).to(query.dtype))
    out = F.scaled_dot_product_attention(query, key, value, attn_mask=mask, scale=scale)
    return out.transpose(1, 2).contiguous()


@torch.library.triton_op("sam3_aoti::attention", mutates_args=())
def attention(query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, scale: float,
              bias_y: torch.Tensor | None = None, bias_x: torch.Tensor | None = None) -> torch.Tensor:
    if (triton is None or not query.is_cuda or query.dtype not in (torch.bfloat16, torch.float16)
            or query.shape[-1] not in (16, 32, 64, 128)  # fp32 keeps SDPA's fp32 kernels
            or (bias_x is not None and bias_x.shape[-1] % GRID_CELL)):
        return reference(query, key, value, scale, bias_y, bias_x)
    return launch_attention(query, key, value, scale, bias_y, bias_x, wrap=torch.library.wrap_triton)


@register_flop_formula(torch.ops.sam3_aoti.attention)
def attention_flops(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    """SDPA's count (bench's FLOPs per part): the FlopCounterMode sees the op, not the kernel inside it."""
    return sdpa_flop_count(query_shape, key_shape, value_shape)


if triton is not None:

    @triton.jit
    def _attention_kernel(q_ptr, k_ptr, v_ptr, by_ptr, bx_ptr, out_ptr,
                          q_b, q_h, q_m, k_b, k_h, k_n, v_b, v_h, v_n, y_row, x_row, heads, q_len, table_len,
                          K_LEN: tl.constexpr, SIDE: tl.constexpr, QK_SCALE: tl.constexpr, BIAS_SCALE: tl.constexpr,
                          HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                          BIASED: tl.constexpr, CELL: tl.constexpr):
        pair_head = tl.program_id(1)
        b, h = (pair_head // heads).to(tl.int64), pair_head % heads
        rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
        row_live = rows < q_len
        d = tl.arange(0, HEAD_DIM)
        q = tl.load(q_ptr + b * q_b + h * q_h + rows[:, None] * q_m + d[None, :], mask=row_live[:, None], other=0.0)
        k_base, v_base = k_ptr + b * k_b + h * k_h, v_ptr + b * v_b + h * v_h
        grid_rows: tl.constexpr = K_LEN // SIDE
        if BIASED:  # key blocks of CELL x CELL grid cells; their bias is [by | bx] (BLOCK_M x 2 CELL) @ onehot
            c = tl.arange(0, 2 * CELL)
            u = tl.arange(0, BLOCK_N)  # a block's key u is cell (u // CELL, u % CELL)
            onehot = tl.where(c[:, None] < CELL, (u // CELL)[None, :] == c[:, None],
                              (u % CELL)[None, :] == (c - CELL)[:, None]).to(tl.float32)
            unbiased = q_len - table_len  # the first rows, which the tables leave out
            table = pair_head.to(tl.int64) * table_len + rows - unbiased
            table_row_live = row_live & (rows >= unbiased)
            table_ptrs = tl.where(c[None, :] < CELL, by_ptr + (table * y_row)[:, None] + c[None, :],
                                  bx_ptr + (table * x_row)[:, None] + (c - CELL)[None, :])
            blocks: tl.constexpr = tl.cdiv(grid_rows, CELL) * (SIDE // CELL)
        else:
            blocks: tl.constexpr = tl.cdiv(K_LEN, BLOCK_N)
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
        for block in range(0, blocks):  # a static count: the interpreter ranges over no runtime int
            if BIASED:
                y0, x0 = (block // (SIDE // CELL)) * CELL, (block % (SIDE // CELL)) * CELL
                ys = y0 + u // CELL
                cols = ys * SIDE + x0 + u % CELL
                col_live = ys < grid_rows
            else:
                cols = block * BLOCK_N + tl.arange(0, BLOCK_N)
                col_live = cols < K_LEN
            k = tl.load(k_base + cols[None, :] * k_n + d[:, None], mask=col_live[None, :], other=0.0)
            v = tl.load(v_base + cols[:, None] * v_n + d[None, :], mask=col_live[:, None], other=0.0)
            s = tl.dot(q, k)
            if BIASED:  # the bias in units of the raw dot, which QK_SCALE takes to log2 units with it
                table_live = table_row_live[:, None] & ((c >= CELL) | (y0 + c < grid_rows))[None, :]
                offsets = tl.where(c < CELL, y0, x0)
                tables = tl.load(table_ptrs + offsets[None, :], mask=table_live, other=0.0) * BIAS_SCALE
                s = tl.dot(tables, onehot, s, input_precision="tf32")
            s = tl.where(col_live[None, :], s, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s, 1) * QK_SCALE)  # log2 units: softmax(x) = exp2(x log2 e) / sum
            p = tl.math.exp2(s * QK_SCALE - m_new[:, None])
            alpha = tl.math.exp2(m_i - m_new)
            l_i = l_i * alpha + tl.sum(p, 1)
            acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
            m_i = m_new
        out = (acc / l_i[:, None]).to(out_ptr.dtype.element_ty)
        out_rows = (b * q_len + rows) * (heads * HEAD_DIM) + h * HEAD_DIM  # [B, Lq, H, D]
        tl.store(out_ptr + out_rows[:, None] + d[None, :], out, mask=row_live[:, None])

    def tables_in_rows(table: torch.Tensor) -> torch.Tensor:
        """A `[B, H, Q, n]` table whose rows are evenly strided (the kernel's `y_row`, `x_row`), as is or copied."""
        b, h, q, _ = table.shape
        row = table.stride(2)
        evenly = table.stride(3) == 1 and table.stride(1) == q * row and table.stride(0) == h * q * row
        return table if evenly and table.dtype == torch.float32 else table.float().contiguous()

    def launch_attention(query, key, value, scale, bias_y=None, bias_x=None, config=None,
                         wrap=lambda kernel: kernel) -> torch.Tensor:
        """Run the kernel on `[B, H, L, D]` views (last stride 1) and fp32 per-axis tables (`[B, H, T, rows]`,
        `[B, H, T, side]` for the last T <= Lq queries, their last stride 1, e.g. the two halves of one table),
        or none; `config` overrides `CONFIG`'s (BLOCK_M, BLOCK_N, warps, stages). `wrap` is `wrap_triton` inside
        the op."""
        batch, heads, q_len, head_dim = query.shape
        k_len = key.shape[2]
        query, key, value = (t if t.stride(-1) == 1 else t.contiguous() for t in (query, key, value))
        biased = bias_y is not None
        kind = "biased" if biased else "plain" if head_dim < 64 else "long" if k_len >= LONG else "wide"
        block_m, block_n, warps, stages = config or CONFIG[kind]
        if biased:
            bias_y, bias_x = tables_in_rows(bias_y), tables_in_rows(bias_x)
            side = bias_x.shape[-1]
            table_len = bias_y.shape[2]
            if bias_y.shape[-1] * side != k_len or side % GRID_CELL or not 0 < table_len <= q_len:
                raise ValueError(f"grid bias {tuple(bias_y.shape)} + {tuple(bias_x.shape)}: want rows x side = "
                                 f"{k_len} keys, the side a multiple of {GRID_CELL} and 1 to {q_len} query rows")
            block_n, table_rows = GRID_CELL * GRID_CELL, (bias_y.stride(2), bias_x.stride(2))
        else:
            bias_y = bias_x = query  # not read
            side, table_rows, table_len = 1, (0, 0), q_len
        out = query.new_empty(batch, q_len, heads, head_dim)
        wrap(_attention_kernel)[(triton.cdiv(q_len, block_m), batch * heads)](
            query, key, value, bias_y, bias_x, out,
            query.stride(0), query.stride(1), query.stride(2), key.stride(0), key.stride(1), key.stride(2),
            value.stride(0), value.stride(1), value.stride(2), *table_rows, heads, q_len, table_len,
            K_LEN=k_len, SIDE=side, QK_SCALE=scale * math.log2(math.e), BIAS_SCALE=1.0 / scale,
            HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n, BIASED=biased, CELL=GRID_CELL,
            num_warps=warps, num_stages=stages)
        return out
