#!/usr/bin/env python3
"""One of the ViT's layers at full size (a windowed one and a global one; random weights, bf16), compiled by Inductor
as the package's AOTInductor compile would: transformers' (SDPA), with `vit_attention_kernel`, with the rotary
embedding applied in the projections' `[B, L, H, D]` layout (a candidate not taken: 0.05 ms a layer), with
`vit_gelu_epilogue` (fc1's GELU in cuBLASLt's epilogue: the tanh approximation on a GPU, where the CPU computes the
exact one, so on a GPU its difference is reported, not held to zero), and with `vit_rope_tables` too (the rotary
embedding's cos and sin as constant tables, not recomputed inside the kernel that rotates q and k); and the patch
embedding, cuDNN's convolution against `vit_patch_linear`'s GEMM. Median ms at 16 images (`--images`), the kernels
each call launches and the costliest of them (torch.profiler). Issue #50's microbenchmark: seconds on the GPU where a
build takes minutes.

Usage: scripts/gpu_run.sh --python experiments/vit_block.py --out DIR
       python experiments/vit_block.py --cpu      (tiny shapes on the CPU, eager: the variants agree)
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import torch  # noqa: E402

IN_PLACE = "vit_attention_kernel, the rotary embedding in [B, L, H, D]"
GELU = ("vit_attention_kernel", "vit_gelu_epilogue")
VARIANTS = {"transformers (SDPA)": (), "vit_attention_kernel": ("vit_attention_kernel",), IN_PLACE: (IN_PLACE,),
            ", ".join(GELU): GELU, ", ".join((*GELU, "vit_rope_tables")): (*GELU, "vit_rope_tables")}
# not the same arithmetic on a GPU (cuBLASLt's GELU is the tanh approximation): their difference is reported, not
# held to the others'
APPROXIMATE = {name for name, names in VARIANTS.items() if "vit_gelu_epilogue" in names}


def in_place_attention():
    """`Sam3ViTRoPEAttention` with its rotary embedding applied, and the kernel run, in the projections' layout."""
    from transformers.models.sam3.modeling_sam3 import Sam3ViTRoPEAttention, apply_rotary_pos_emb_2d

    from sam3_aoti.model import ops

    class InPlaceViTAttention(Sam3ViTRoPEAttention):
        def forward(self, hidden_states, position_embeddings, **kwargs):
            batch, height, width, _ = hidden_states.shape
            heads = (batch, height * width, self.num_attention_heads, self.head_dim)
            query, key, value = (p(hidden_states).view(heads) for p in (self.q_proj, self.k_proj, self.v_proj))
            cos, sin = (t.reshape(height * width, 1, self.head_dim) for t in position_embeddings)  # any head
            query, key = apply_rotary_pos_emb_2d(query, key, cos=cos, sin=sin)
            out = ops.attention(query.transpose(1, 2), key.transpose(1, 2), value.transpose(1, 2), self.scaling)
            return self.o_proj(out.reshape(batch, height, width, -1)), None

    return InPlaceViTAttention


def layer(config, window: int, names: tuple, device: str, dtype) -> torch.nn.Module:
    """A `Sam3ViTLayer` with random weights and the optimizations `names` applied to it."""
    from transformers.models.sam3.modeling_sam3 import Sam3ViTLayer

    torch.manual_seed(0)
    block = Sam3ViTLayer(config, window_size=window)
    for p in block.parameters():
        torch.nn.init.normal_(p, std=0.02)
    if IN_PLACE in names:
        block.attention.__class__ = in_place_attention()
    return optimized(block, [name for name in names if name != IN_PLACE], device, dtype)


def optimized(block: torch.nn.Module, names, device: str, dtype) -> torch.nn.Module:
    """`block` in `dtype` on `device`, then the registry's optimizations `names` applied to it, as the build orders
    them (its precision first), by the project's `optimize` on a stand-in whose `vision_encoder` is `block`."""
    from sam3_aoti.model.optimizations import optimize

    block.to(device, dtype)
    holder = torch.nn.Module()
    holder.vision_encoder = block
    optimize(holder, names)
    return block.eval()

def pipeline_sdpa_backends() -> list[str]:
    """`[compile] sdpa_backends` of pipeline.toml: the SDPA kernels in the order the package's compile prefers them."""
    from sam3_aoti.pipeline.settings import load_settings

    return load_settings("sam3", "cpu", "fp32", "random").stage("compile")["sdpa_backends"]  # device-free


def sdpa_priority(names):
    import contextlib

    from sam3_aoti.aoti.compile import sdpa_priority as priority

    return priority(names) if names else contextlib.nullcontext()


def kernels(fn, x, top: int = 6) -> dict:
    """Launches per call and the `top` kernels by GPU time (ms per call), over 5 calls."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(5):
            fn(x)
        torch.cuda.synchronize()
    events = [e for e in prof.key_averages() if e.device_type.name == "CUDA"]
    rows = sorted(events, key=lambda e: e.device_time_total, reverse=True)
    return {"launches_per_call": sum(e.count for e in events) / 5,
            "top": [{"kernel": e.key[:120], "ms_per_call": round(e.device_time_total / 5 / 1000, 4)}
                    for e in rows[:top]]}


def embeddings(config, names: tuple, device: str, dtype) -> torch.nn.Module:
    """The ViT's `Sam3ViTEmbeddings` (patch embedding and position embeddings) with random weights and `names`."""
    from transformers.models.sam3.modeling_sam3 import Sam3ViTEmbeddings

    torch.manual_seed(0)
    return optimized(Sam3ViTEmbeddings(config), names, device, dtype)

def measured(kind: str, images: int, variants: dict, x, cpu: bool) -> list[dict]:
    """Each variant (a function that makes its module) run on `x`, compiled on a GPU: its largest difference from
    the first variant's output, and on a GPU its median ms, launches and costliest kernels."""
    from sam3_aoti.measure.timing import time_calls

    rows, want = [], None
    for variant, make in variants.items():
        block = make()
        torch._dynamo.reset()  # each variant compiled anew: one code object, more variants than its cache
        with torch.no_grad(), sdpa_priority(None if cpu else pipeline_sdpa_backends()):
            run = block if cpu else torch.compile(block, fullgraph=True)
            got = run(x)
            got = got[0] if isinstance(got, tuple) else got
            want = got.float() if want is None else want
            row = {"layer": kind, "images": images, "variant": variant,
                   "max_abs_vs_first": float((got.float() - want).abs().max())}
            if not cpu:
                row["ms"] = round(statistics.median(time_calls(run, (x,), "cuda", 3, 20)), 4)
                row.update(kernels(run, x))
        rows.append(row)
        print(json.dumps(row), flush=True)
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path)
    parser.add_argument("--cpu", action="store_true")
    parser.add_argument("--images", default="16", help="batch sizes, comma-separated (default 16)")
    args = parser.parse_args()
    from sam3_aoti.model.configs import full_config, tiny_config

    config = copy.copy((tiny_config() if args.cpu else full_config()).vision_config.backbone_config)
    config._attn_implementation = "sdpa"  # as the model sets it for its layers
    side = config.image_size // config.patch_size
    device, dtype = ("cpu", torch.float32) if args.cpu else ("cuda", torch.bfloat16)
    results = {"gpu": None if args.cpu else torch.cuda.get_device_name(), "torch": torch.__version__, "rows": []}
    for images in ((2,) if args.cpu else [int(n) for n in args.images.split(",")]):
        for kind, window in (("windowed", config.window_size), ("global", 0)):
            x = torch.randn(images, side, side, config.hidden_size, device=device, dtype=dtype)
            variants = {variant: (lambda names=names: layer(config, window, names, device, dtype))
                        for variant, names in VARIANTS.items()}
            results["rows"] += measured(kind, images, variants, x, args.cpu)
        pixels = torch.randn(images, 3, config.image_size, config.image_size, device=device)  # fp32, as the model's
        variants = {"transformers (convolution)": lambda: embeddings(config, (), device, dtype),
                    "vit_patch_linear": lambda: embeddings(config, ("vit_patch_linear",), device, dtype)}
        results["rows"] += measured("patch embedding", images, variants, pixels, args.cpu)
    if args.cpu:
        assert all(r["max_abs_vs_first"] < 1e-4 for r in results["rows"] if r["variant"] not in APPROXIMATE), results
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "vit-block.json").write_text(json.dumps(results, indent=2) + "\n")


if __name__ == "__main__":
    main()
