"""The ViT's global attention (4 of its 32 blocks: 5,184 tokens, 16 heads, head dim 64, bf16, no mask) on this GPU:
SDPA's kernels (cuDNN, today's; flash; memory-efficient) against Triton flash-attention kernels, the project's own
(`runtime.attention`, the op `sam3_aoti::attention`, at several tiles) and a Hopper one here: queries, keys and values
read by TMA (host tensor descriptors over the `[B, H, L, D]` views the qkv projection leaves), with and without warp
specialization, tiles of 64 keys (5,184 = 81 x 64; 128 does not divide it). Issue #50 asks which is fastest before
any of them goes into the package: what it runs must be Triton AOTInductor embeds or torch's own ops.

Median of CUDA-event timings at 1 and 16 images; each kernel's largest difference from SDPA's math in fp32.
Usage: scripts/gpu_run.sh --python experiments/vit_global_attention.py --out DIR
       python experiments/vit_global_attention.py --interpret   (the TMA kernel in Triton's CPU interpreter)
"""

from __future__ import annotations

import argparse
import math
import os
import statistics
import sys
from pathlib import Path

if "--interpret" in sys.argv:
    os.environ["TRITON_INTERPRET"] = "1"  # before triton is imported

import torch
import torch.nn.functional as F
import triton
import triton.language as tl
from torch.nn.attention import SDPBackend, sdpa_kernel

HEADS, HEAD_DIM = 16, 64
SHAPES = {"windowed": (576, 9), "global": (5184, 1)}  # tokens, sequences an image
# (BLOCK_M, BLOCK_N, num_warps, num_stages)
OWN_CONFIGS = [(64, 64, 4, 3), (64, 64, 4, 4), (128, 64, 4, 3), (128, 64, 8, 3), (128, 64, 8, 4)]
TMA_CONFIGS = [(64, 64, 4, 3), (128, 64, 4, 3), (128, 64, 8, 3), (128, 64, 8, 4)]


@triton.jit
def _attention_tma_kernel(q_desc, k_desc, v_desc, out_ptr, heads, q_len, K_LEN: tl.constexpr,
                          QK_SCALE: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_M: tl.constexpr,
                          BLOCK_N: tl.constexpr, WARP_SPECIALIZE: tl.constexpr):
    """One (query block, image x head) per program; every key block through the online softmax in log2 units.
    TMA fills out-of-range query rows with zeros; K_LEN must be a multiple of BLOCK_N (no key mask)."""
    pair_head = tl.program_id(1)
    b, h = pair_head // heads, pair_head % heads
    start = tl.program_id(0) * BLOCK_M
    q = q_desc.load([b, h, start, 0]).reshape(BLOCK_M, HEAD_DIM)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM], tl.float32)
    for block in tl.range(0, K_LEN // BLOCK_N, warp_specialize=WARP_SPECIALIZE):
        k = k_desc.load([b, h, block * BLOCK_N, 0]).reshape(BLOCK_N, HEAD_DIM)
        v = v_desc.load([b, h, block * BLOCK_N, 0]).reshape(BLOCK_N, HEAD_DIM)
        s = tl.dot(q, k.T)
        m_new = tl.maximum(m_i, tl.max(s, 1) * QK_SCALE)
        p = tl.math.exp2(s * QK_SCALE - m_new[:, None])
        alpha = tl.math.exp2(m_i - m_new)
        l_i = l_i * alpha + tl.sum(p, 1)
        acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
        m_i = m_new
    out = (acc / l_i[:, None]).to(out_ptr.dtype.element_ty)
    rows = start + tl.arange(0, BLOCK_M)
    d = tl.arange(0, HEAD_DIM)
    out_rows = (b.to(tl.int64) * q_len + rows) * (heads * HEAD_DIM) + h * HEAD_DIM  # [B, Lq, H, D]
    tl.store(out_ptr + out_rows[:, None] + d[None, :], out, mask=(rows < q_len)[:, None])


def attention_tma(query, key, value, scale, block_m=128, block_n=64, num_warps=8, num_stages=3,
                  warp_specialize=False):
    """`[B, H, L, D]` views (last stride 1, the other strides 16-byte multiples) -> `[B, Lq, H, D]`."""
    from triton.tools.tensor_descriptor import TensorDescriptor

    batch, heads, q_len, head_dim = query.shape
    k_len = key.shape[2]
    if k_len % block_n:
        raise ValueError(f"{k_len} keys are not a multiple of BLOCK_N {block_n}")
    q_desc = TensorDescriptor.from_tensor(query, [1, 1, block_m, head_dim])
    k_desc = TensorDescriptor.from_tensor(key, [1, 1, block_n, head_dim])
    v_desc = TensorDescriptor.from_tensor(value, [1, 1, block_n, head_dim])
    out = query.new_empty(batch, q_len, heads, head_dim)
    _attention_tma_kernel[(triton.cdiv(q_len, block_m), batch * heads)](
        q_desc, k_desc, v_desc, out, heads, q_len, K_LEN=k_len, QK_SCALE=scale * math.log2(math.e),
        HEAD_DIM=head_dim, BLOCK_M=block_m, BLOCK_N=block_n, WARP_SPECIALIZE=warp_specialize,
        num_warps=num_warps, num_stages=num_stages)
    return out


def qkv(images: int, tokens: int, device: str, dtype=torch.bfloat16):
    """q, k, v as the ViT's qkv projection leaves them: `[B, L, 3, H, D]` viewed as three `[B, H, L, D]`."""
    generator = torch.Generator(device).manual_seed(0)
    packed = torch.randn(images, tokens, 3, HEADS, HEAD_DIM, generator=generator, device=device, dtype=dtype)
    return tuple(packed[:, :, i].transpose(1, 2) for i in range(3))


def exact(q, k, v, scale):
    """SDPA's math in fp32, `[B, Lq, H, D]`."""
    return F.scaled_dot_product_attention(q.float(), k.float(), v.float(), scale=scale).transpose(1, 2)


def interpret() -> None:
    q, k, v = qkv(1, 192, "cpu", torch.float32)
    q, k, v = (t[:, :2] for t in (q, k, v))  # two heads: the interpreter is slow
    scale = HEAD_DIM ** -0.5
    got = attention_tma(q, k, v, scale, block_m=128, block_n=64, num_warps=4, num_stages=1)
    torch.testing.assert_close(got, exact(q, k, v, scale), rtol=1e-4, atol=1e-4)
    print(f"interpreted: TMA kernel max abs difference {float((got - exact(q, k, v, scale)).abs().max()):.2e}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--interpret", action="store_true")
    parser.add_argument("--warp-specialize", action="store_true")
    args = parser.parse_args()
    if args.interpret:
        return interpret()
    from sam3_aoti.measure.timing import time_calls
    from sam3_aoti.pipeline.report import Report, Table, write_report
    from sam3_aoti.runtime.attention import launch_attention

    args.out.mkdir(parents=True, exist_ok=True)
    scale = HEAD_DIM ** -0.5
    results = {"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "triton": triton.__version__,
               "rows": []}
    table_rows = []
    for shape, (tokens, windows) in SHAPES.items():
        for images in (1, 16):
            q, k, v = qkv(images * windows, tokens, "cuda")
            flop = 4 * images * windows * HEADS * tokens * tokens * HEAD_DIM
            want = exact(q, k, v, scale)
            launches = {f"SDPA {name}": (lambda b=backend: _sdpa(q, k, v, scale, b)) for name, backend in (
                ("cuDNN", SDPBackend.CUDNN_ATTENTION), ("flash", SDPBackend.FLASH_ATTENTION),
                ("memory-efficient", SDPBackend.EFFICIENT_ATTENTION))}
            launches.update({f"own {c}": (lambda c=c: launch_attention(q, k, v, scale, config=c))
                             for c in OWN_CONFIGS})
            launches.update({f"TMA{' WS' if ws else ''} {c}": (lambda c=c, ws=ws: attention_tma(
                q, k, v, scale, *c, warp_specialize=ws)) for ws in (False, True)[:1 + args.warp_specialize]
                for c in TMA_CONFIGS})
            for name, launch in launches.items():
                row = {"shape": shape, "images": images, "kernel": name}
                try:
                    error = float((launch().float() - want).abs().max())
                    ms = statistics.median(time_calls(launch, (), "cuda", 5, 30))
                    row.update(ms=round(ms, 4), tflops=round(flop / (ms * 1e-3) / 1e12, 1), max_abs_error=error)
                except Exception as e:  # a tile this card cannot hold, a backend that refuses the shape: named
                    row["error"] = str(e).splitlines()[0][:160] if str(e) else type(e).__name__
                results["rows"].append(row)
                print(row, flush=True)
                table_rows.append([shape, images, name, *((row["ms"], row["tflops"], f"{row['max_abs_error']:.1e}")
                                                          if "ms" in row else (row["error"], "", ""))])
    table = Table("Every kernel", ["shape", "images", "kernel (BLOCK_M, BLOCK_N, warps, stages)", "ms", "TFLOP/s",
                                   "max abs error vs fp32"], table_rows)
    title = (f"The ViT's attentions, {HEADS} heads x {HEAD_DIM}: windowed (9 x 576 tokens an image) and global "
             f"(5,184) ({results['gpu']}, torch {results['torch']}, Triton {results['triton']})")
    write_report(Report(title, ["bf16 inputs in the qkv projection's layout; output `[B, L, H, D]` (SDPA's "
                                "transposed back, as the model reads it, is not counted)."], None, [table],
                        data=results), args.out / "vit-attention.json", args.out / "vit-attention.md")


def _sdpa(q, k, v, scale, backend):
    with sdpa_kernel([backend]):
        return F.scaled_dot_product_attention(q, k, v, scale=scale).transpose(1, 2)


if __name__ == "__main__":
    main()
