"""The DETR decoder's box-relative attention bias MLPs (2 -> hidden -> heads per query and grid coordinate) as
one Triton kernel whose hidden layer never leaves registers: the op `sam3_aoti::box_bias_mlp`.

transformers runs each as two linear layers: a GEMM with K = 2, a ReLU over the stored `[N, Q, side, hidden]`
hidden (about 7 M elements per pair and layer at full size), then a GEMM with N = heads (8): a large share of
the decoder's time (benchmarks/h200-2026-12-02-heads/). Here each program computes the hidden
of a block of rows in fp32 from the 2-wide input and multiplies it by the second layer's weights on the tensor
cores (in their dtype; fp32 weights take an exact fp32 product), writing `[N, heads, Q, side]`, the layout the
bias is assembled in. Off CUDA (or without Triton) the op is the two linear layers.

It is a `torch.library.triton_op`: AOTInductor traces into it and compiles the kernel into the package, so the
compiled models need only torch. An exported program keeps the op by name, so whatever deserializes one (the
compile stage, the runtime's exported-program fallback) imports this module first; it is in the runtime for that.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch.utils.flop_counter import register_flop_formula

BLOCK_ROWS = 64

try:
    import triton
    import triton.language as tl
except ImportError:  # a CPU-only torch: the op runs its linear layers
    triton = None


def linear_layers(deltas, w1, b1, w2, b2) -> torch.Tensor:
    """`[N, Q, side, 2]` log-scaled box-edge distances -> `[N, heads, Q, side]`: transformers' MLP, each layer in
    its weights' dtype as `model.mixed_precision`'s low-precision linears run it, the result in the input's dtype."""
    hidden = F.relu(F.linear(deltas.to(w1.dtype), w1, b1))
    return F.linear(hidden.to(w2.dtype), w2, b2).to(deltas.dtype).permute(0, 3, 1, 2)


@torch.library.triton_op("sam3_aoti::box_bias_mlp", mutates_args=())
def box_bias_mlp(deltas: torch.Tensor, w1: torch.Tensor, b1: torch.Tensor, w2: torch.Tensor,
                 b2: torch.Tensor) -> torch.Tensor:
    if triton is None or not deltas.is_cuda:
        return linear_layers(deltas, w1, b1, w2, b2).contiguous()
    return launch_box_bias(deltas, w1, b1, w2, b2, wrap=torch.library.wrap_triton)


@register_flop_formula(torch.ops.sam3_aoti.box_bias_mlp)
def box_bias_flops(deltas_shape, w1_shape, b1_shape, w2_shape, b2_shape, *args, out_shape=None, **kwargs) -> int:
    """The two linear layers' count (bench's FLOPs per part): the FlopCounterMode sees the op, not its kernel."""
    rows = math.prod(deltas_shape[:-1])
    return 2 * rows * (w1_shape[0] * w1_shape[1] + w2_shape[0] * w2_shape[1])


if triton is not None:

    @triton.jit
    def _box_bias_kernel(deltas, w1, b1, w2, b2, out, rows, per_pair, HIDDEN: tl.constexpr, HEADS: tl.constexpr,
                         HIDDEN_PAD: tl.constexpr, HEADS_PAD: tl.constexpr, BLOCK: tl.constexpr, EXACT: tl.constexpr):
        row = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        live = row < rows
        d0 = tl.load(deltas + 2 * row, mask=live, other=0.0)
        d1 = tl.load(deltas + 2 * row + 1, mask=live, other=0.0)
        k = tl.arange(0, HIDDEN_PAD)
        k_live = k < HIDDEN
        w10 = tl.load(w1 + 2 * k, mask=k_live, other=0.0).to(tl.float32)
        w11 = tl.load(w1 + 2 * k + 1, mask=k_live, other=0.0).to(tl.float32)
        bias1 = tl.load(b1 + k, mask=k_live, other=0.0).to(tl.float32)
        hidden = tl.maximum(d0[:, None] * w10[None, :] + d1[:, None] * w11[None, :] + bias1[None, :], 0.0)
        h = tl.arange(0, HEADS_PAD)
        h_live = h < HEADS
        w2t = tl.load(w2 + h[None, :] * HIDDEN + k[:, None], mask=k_live[:, None] & h_live[None, :], other=0.0)
        if EXACT:
            acc = tl.dot(hidden, w2t.to(tl.float32), input_precision="ieee")
        else:
            acc = tl.dot(hidden.to(w2t.dtype), w2t)
        acc += tl.load(b2 + h, mask=h_live, other=0.0).to(tl.float32)[None, :]
        pair, rest = row // per_pair, row % per_pair  # row = (pair, query, coordinate); out [pair, head, query, coord]
        target = out + pair[:, None] * (HEADS * per_pair) + h[None, :] * per_pair + rest[:, None]
        tl.store(target, acc, mask=live[:, None] & h_live[None, :])

    def launch_box_bias(deltas, w1, b1, w2, b2, wrap=lambda kernel: kernel) -> torch.Tensor:
        """Run the kernel: `[N, Q, side, 2]` fp32 and the MLP's tensors -> `[N, heads, Q, side]` fp32.
        `wrap` is `wrap_triton` inside the op (so export sees the kernel); tests call it plainly."""
        pairs, queries, side, _ = deltas.shape
        hidden, heads = w1.shape[0], w2.shape[0]
        deltas, w1, b1, w2, b2 = (t.contiguous() for t in (deltas.float(), w1, b1, w2, b2))
        out = deltas.new_empty(pairs, heads, queries, side)
        rows = pairs * queries * side
        wrap(_box_bias_kernel)[(triton.cdiv(rows, BLOCK_ROWS),)](
            deltas, w1, b1, w2, b2, out, rows, queries * side, HIDDEN=hidden, HEADS=heads,
            HIDDEN_PAD=max(16, triton.next_power_of_2(hidden)), HEADS_PAD=max(16, triton.next_power_of_2(heads)),
            BLOCK=BLOCK_ROWS, EXACT=w2.dtype == torch.float32)
        return out
