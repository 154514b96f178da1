"""Which SDPA kernel is fastest for SAM3's attention shapes on this GPU (the `[export] sdpa_backends` order).

Times every backend (cuDNN, flash, memory-efficient, math) on the full model's attention shapes at
(B, P) = (2, 3): the ViT's global and windowed attention (bf16, head dim 64), the DETR encoder's
self-attention over the 72x72 image tokens (N = 6 pairs, head dim 32), and the DETR decoder's box-biased
cross-attention (fp32, as in a bf16 build; with an aligned dense bias). Median of CUDA-event timings.
Usage: scripts/gpu_run.sh --python experiments/sdpa_backends.py [--json PATH]
"""

import json
import statistics
import sys

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from sam3_aoti.measure.timing import time_calls
from sam3_aoti.model.export_fixes import dense_mask

BACKENDS = {"cudnn": SDPBackend.CUDNN_ATTENTION, "flash": SDPBackend.FLASH_ATTENTION,
            "efficient": SDPBackend.EFFICIENT_ATTENTION, "math": SDPBackend.MATH}
# name: (batch*heads layout (B, H), query tokens, key tokens, head dim, dtype, with bias)
SHAPES = {
    "ViT global (B=2)": ((2, 16), 5184, 5184, 64, torch.bfloat16, False),
    "ViT windowed 24x24 (B=2, 9 windows)": ((18, 16), 576, 576, 64, torch.bfloat16, False),
    "DETR encoder self-attn (N=6)": ((6, 8), 5184, 5184, 32, torch.bfloat16, False),
    "DETR decoder box-biased cross-attn (N=6, fp32)": ((6, 8), 201, 5184, 32, torch.float32, True),
    "DETR encoder text cross-attn (N=6, 33 keys)": ((6, 8), 5184, 33, 32, torch.bfloat16, True),
}


def timed(fn, iters=20, warmup=3) -> float:
    """Median ms of `fn()` (CUDA events, as bench times the package)."""
    return statistics.median(time_calls(fn, (), "cuda", warmup, iters))


def main() -> None:
    results = {}
    for name, ((b, h), lq, lk, d, dtype, biased) in SHAPES.items():
        q = torch.randn(b, h, lq, d, device="cuda", dtype=dtype)
        k, v = (torch.randn(b, h, lk, d, device="cuda", dtype=dtype) for _ in range(2))
        mask = None
        if biased:  # in the layout the package hands SDPA: last stride 1, rows padded to a multiple of 8
            mask = dense_mask(torch.randn(b, h, lq, lk, device="cuda"), dtype, lq, lk)
        flop = 4 * b * h * lq * lk * d
        results[name] = {}
        reference = F.scaled_dot_product_attention(q.float(), k.float(), v.float(),
                                                   attn_mask=None if mask is None else mask.float())
        for backend, kind in BACKENDS.items():
            try:
                with sdpa_kernel([kind]):
                    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
                    ms = timed(lambda: F.scaled_dot_product_attention(q, k, v, attn_mask=mask))
                err = float((out.float() - reference).norm() / reference.norm())
                results[name][backend] = {"ms": round(ms, 3), "tflops": round(flop / ms / 1e9, 1), "rel_err": err}
            except RuntimeError as e:
                results[name][backend] = {"error": str(e).splitlines()[0][:120]}
    print(f"{'shape':48} " + " ".join(f"{b:>18}" for b in BACKENDS))
    for name, row in results.items():
        cells = [f"{r['ms']:7.3f} ms {r['tflops']:5.0f} TF" if "ms" in r else f"{'n/a':>18}" for r in row.values()]
        print(f"{name:48} " + " ".join(f"{c:>18}" for c in cells))
    if "--json" in sys.argv:
        with open(sys.argv[sys.argv.index("--json") + 1], "w") as f:
            json.dump({"gpu": torch.cuda.get_device_name(0), "torch": torch.__version__, "results": results}, f, indent=2)


if __name__ == "__main__":
    main()
