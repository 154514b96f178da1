"""What the next speed levers of issue #12 are worth on this GPU, measured on SAM3's own shapes at (B, P) = (2, 3)
before any of them is built into the pipeline:

1. fp8: the ViT's linear layers (32 layers; qkv, proj, fc1, fc2 at M = 2 x 5184 tokens) as bf16 GEMMs against
   rowwise-scaled fp8 `torch._scaled_mm`, with and without quantizing the activations in the same call.
2. The DETR decoder's box-biased vision cross-attention (6 layers; 201 queries x 5184 keys x 8 heads, head
   dim 32, N = 6 pairs): fp32 (as a bf16 build runs the decoder today) against bf16, through SDPA and
   through torch.compile'd matmul-softmax.
3. The GELU left outside the ViT's fc1 GEMM: one pass over its output.
Median of CUDA-event timings; the table at the end, JSON with --json PATH.
Usage: scripts/gpu_run.sh --python experiments/speed_levers.py [--json PATH]
"""

import json
import statistics
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from sam3_aoti.measure.timing import time_calls
from sam3_aoti.model.fp8 import quantize_rows
from sam3_aoti.model.export_fixes import dense_mask

TOKENS = 2 * 72 * 72
VIT_LINEARS = {"qkv": (1024, 3072), "proj": (1024, 1024), "fc1": (1024, 4736), "fc2": (4736, 1024)}
VIT_LAYERS = 32


def timed(fn, iters=30, warmup=5) -> float:
    """Median ms of `fn()` (CUDA events, as bench times the package)."""
    return statistics.median(time_calls(fn, (), "cuda", warmup, iters))


def fp8_levers() -> dict:
    rows = {}
    for name, (k, n) in VIT_LINEARS.items():
        x = torch.randn(TOKENS, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
        bf16 = timed(lambda: F.linear(x, w))
        xq, xs = quantize_rows(x)
        wq, ws = quantize_rows(w)  # weights quantized once, offline
        scaled = lambda a, sa: torch._scaled_mm(a, wq.t(), scale_a=sa, scale_b=ws.t(), out_dtype=torch.bfloat16)
        kernel = timed(lambda: scaled(xq, xs))
        quantize_too = timed(lambda: scaled(*quantize_rows(x)))
        ref = F.linear(x.float(), w.float())
        err = float((scaled(xq, xs).float() - ref).norm() / ref.norm())
        rows[name] = {"bf16_ms": round(bf16, 4), "fp8_kernel_ms": round(kernel, 4),
                      "fp8_with_eager_quantize_ms": round(quantize_too, 4), "fp8_rel_err": round(err, 5),
                      "bf16_tflops": round(2 * TOKENS * k * n / bf16 / 1e9, 1)}
    total = {key: round(VIT_LAYERS * sum(r[key] for r in rows.values()), 2)
             for key in ("bf16_ms", "fp8_kernel_ms", "fp8_with_eager_quantize_ms")}
    return {"per_linear": rows, "vit_total_ms": total}


def decoder_attention_levers() -> dict:
    n, h, lq, lk, d = 6, 8, 201, 5184, 32
    out = {}

    def attention(q, k, v, bias):
        return torch.softmax(q @ k.transpose(-1, -2) * d**-0.5 + bias, dim=-1) @ v

    compiled = torch.compile(attention, dynamic=False)
    for dtype in (torch.float32, torch.bfloat16):
        q = torch.randn(n, h, lq, d, device="cuda", dtype=dtype)
        k, v = (torch.randn(n, h, lk, d, device="cuda", dtype=dtype) for _ in range(2))
        bias = dense_mask(torch.randn(n, h, lq, lk, device="cuda"), dtype, lq, lk)
        name = str(dtype).removeprefix("torch.")
        with sdpa_kernel([SDPBackend.EFFICIENT_ATTENTION]):
            out[f"sdpa efficient {name}"] = round(6 * timed(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=bias)), 3)
        if dtype == torch.bfloat16:
            try:
                with sdpa_kernel([SDPBackend.CUDNN_ATTENTION]):
                    out[f"sdpa cudnn {name}"] = round(6 * timed(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=bias)), 3)
            except RuntimeError as e:
                out[f"sdpa cudnn {name}"] = str(e).splitlines()[0][:100]
        out[f"compiled matmul-softmax {name}"] = round(6 * timed(lambda: compiled(q, k, v, bias)), 3)
    return {"six_layers_ms": out}


def gelu_lever() -> dict:
    y = torch.randn(TOKENS, 4736, device="cuda", dtype=torch.bfloat16)
    return {"vit_gelu_total_ms": round(VIT_LAYERS * timed(lambda: F.gelu(y)), 3)}


def main() -> None:
    results = {"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__,
               "fp8": fp8_levers(), "decoder_attention": decoder_attention_levers(), "gelu": gelu_lever()}
    print(json.dumps(results, indent=1))
    if "--json" in sys.argv:
        with open(sys.argv[sys.argv.index("--json") + 1], "w") as f:
            json.dump(results, f, indent=2)


if __name__ == "__main__":
    main()
