#!/usr/bin/env python3
"""The ViT trunk's next speed levers on SAM3's own shapes, each measured alone (GPU, bf16, torch.compile):
Inductor's max-autotune GEMMs (Triton templates with fused epilogues against cuBLAS), one fused q/k/v
projection per layer instead of three, and fp8 linears (sam3_aoti.model.fp8) with and without the fused projection
(which quantizes each layer's input once instead of three times).

The trunk is SAM3's ViT scaled to 8 of its 32 layers, keeping its ratio of windowed to global layers (7:1):
its ms are per 8 layers (x4 for the trunk). Each variant is compiled in an empty Inductor cache (its compile
seconds include the tuning), timed (median of 20 after 3 warm-up, CUDA events) and profiled by kernel category.
Variants stop being started after --limit seconds; the JSON is rewritten after each one.

Usage: scripts/gpu_run.sh --python experiments/vit_levers.py --json OUT.json [--batch 2] [--limit 360]
       python experiments/vit_levers.py --tiny --json OUT.json     (a CPU check of the script, tiny shapes)
"""

from __future__ import annotations

import argparse
import copy
import json
import os
import sys
import tempfile
import time
import types
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402
from torch import nn  # noqa: E402

TUNED = {"max_autotune_gemm": True, "max_autotune_gemm_backends": "ATEN,TRITON"}
VARIANTS = [  # name, inductor options, fused q/k/v, fp8 linears
    ("bf16", {}, False, False),
    ("bf16, max-autotune GEMMs", TUNED, False, False),
    ("bf16, fused qkv", {}, True, False),
    ("fp8", {}, False, True),
    ("fp8, fused qkv", {}, True, True),
    ("bf16, fused qkv, max-autotune GEMMs", TUNED, True, False),
]


def trunk_config(tiny: bool):
    from sam3_aoti.model.configs import full_config, tiny_config

    vit = (tiny_config() if tiny else full_config()).vision_config.backbone_config
    if not tiny:
        vit.num_hidden_layers, vit.global_attn_indexes = 8, [7]
    return vit


def fused_qkv_forward(self, hidden_states, position_embeddings, **kwargs):
    """Sam3ViTRoPEAttention.forward with one projection for q, k and v (the weights concatenated)."""
    from transformers.models.sam3.modeling_sam3 import ALL_ATTENTION_FUNCTIONS, apply_rotary_pos_emb_2d

    batch, height, width, _ = hidden_states.shape
    shape = (batch, height * width, self.num_attention_heads, self.head_dim)
    query, key, value = (t.reshape(shape).transpose(1, 2) for t in self.qkv_proj(hidden_states).chunk(3, dim=-1))
    query, key = apply_rotary_pos_emb_2d(query, key, cos=position_embeddings[0], sin=position_embeddings[1])
    attention = ALL_ATTENTION_FUNCTIONS.get_interface(self.config._attn_implementation, None)
    out, _ = attention(self, query, key, value, attention_mask=None, dropout=0.0, scaling=self.scaling,
                       is_causal=False)
    return self.o_proj(out.reshape(batch, height, width, -1).contiguous()), None


def fuse_qkv(trunk: nn.Module) -> None:
    for layer in trunk.layers:
        attn = layer.attention
        fused = nn.Linear(attn.q_proj.in_features, 3 * attn.q_proj.out_features, device=attn.q_proj.weight.device,
                          dtype=attn.q_proj.weight.dtype)
        with torch.no_grad():
            fused.weight.copy_(torch.cat([attn.q_proj.weight, attn.k_proj.weight, attn.v_proj.weight]))
            fused.bias.copy_(torch.cat([attn.q_proj.bias, attn.k_proj.bias, attn.v_proj.bias]))
        attn.qkv_proj = fused
        del attn.q_proj, attn.k_proj, attn.v_proj
        attn.forward = types.MethodType(fused_qkv_forward, attn)


def run_variant(base, pixels, options, fused, fp8, device):
    from sam3_aoti.measure.kernels import kernel_breakdown
    from sam3_aoti.measure.timing import measure
    from sam3_aoti.model.fp8 import quantize_linears

    model = copy.deepcopy(base)
    if fused:
        fuse_qkv(model)
    if fp8:
        quantize_linears(model.layers)
    torch._dynamo.reset()
    compiled = torch.compile(model, options=options or None)
    forward = lambda x: compiled(x).last_hidden_state  # noqa: E731
    with torch.no_grad():
        t0 = time.perf_counter()
        out = forward(pixels)
        if device == "cuda":
            torch.cuda.synchronize()
        compile_s = time.perf_counter() - t0
        want = base(pixels).last_hidden_state
    result = {"compile_s": round(compile_s, 1), **measure(forward, (pixels,), device, 3, 20),
              "rel_err_vs_eager_bf16": round(float((out.float() - want.float()).norm() / want.float().norm()), 4)}
    if device == "cuda":
        result["kernels"] = kernel_breakdown(forward, (pixels,))
    return result


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--json", required=True)
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--limit", type=float, default=360, help="start no variant after this many seconds")
    parser.add_argument("--tiny", action="store_true", help="tiny trunk on the CPU, fp32 (checks the script)")
    args = parser.parse_args()
    os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="vit-levers-")  # every tuning from nothing
    from transformers.models.sam3.modeling_sam3 import Sam3ViTModel

    device = "cpu" if args.tiny else "cuda"
    dtype = torch.float32 if args.tiny else torch.bfloat16
    config = trunk_config(args.tiny)
    config._attn_implementation = "sdpa"
    torch.manual_seed(0)
    base = Sam3ViTModel(config).eval().to(device, dtype)
    pixels = torch.randn(args.batch, 3, config.image_size, config.image_size, device=device, dtype=dtype)
    report = {"gpu": torch.cuda.get_device_name(0) if device == "cuda" else None, "torch": torch.__version__,
              "batch": args.batch, "layers": config.num_hidden_layers, "global_layers": config.global_attn_indexes,
              "variants": {}}
    start = time.perf_counter()
    for name, options, fused, fp8 in VARIANTS:
        if time.perf_counter() - start > args.limit:
            report["variants"][name] = "not run: --limit reached"
            continue
        if fp8 and args.tiny:
            continue  # fp8's emulated CPU product is no speed figure; its arithmetic is tests/test_fp8.py's
        try:
            report["variants"][name] = run_variant(base, pixels, options, fused, fp8, device)
        except Exception as e:  # a lever that fails to compile is a finding, not the end of the run
            report["variants"][name] = f"failed: {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}"
        print(name, json.dumps(report["variants"][name])[:400], flush=True)
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
