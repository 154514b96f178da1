"""Which `[export] optimizations` change what torch.export's program computes: for each set named, the full-size
random SAM3 in bf16 (the build's recipe), exported at (2, 3), then the exported program and the eager wrapper
at other (B, P), each output's max |exported - eager| (and the optimized eager against the plain one).
  python scripts/export_drift.py --device cuda --sets pixel_decoder_per_image text_fused_qkv"""

import argparse
import copy

import torch

from sam3_aoti.model.wrapper import Sam3Grounding, example_inputs, full_config, random_model, tiny_config
from sam3_aoti.stages.export import export_model

parser = argparse.ArgumentParser()
parser.add_argument("--device", default="cuda")
parser.add_argument("--tiny", action="store_true")
parser.add_argument("--dtype", default="bfloat16")
parser.add_argument("--shapes", default="3x1,1x1,2x3")
parser.add_argument("--sets", nargs="+", default=["pixel_decoder_per_image", "text_fused_qkv"])
args = parser.parse_args()
base = random_model(tiny_config() if args.tiny else full_config(), 0, bias_noise=0.02)
dtype = getattr(torch, args.dtype)


def grounding(optimizations):
    return Sam3Grounding(copy.deepcopy(base), dtype, box_path_attention="bf16", box_path_linears="bf16",
                         optimizations=optimizations).eval().to(args.device)


plain = grounding(())
shapes = [tuple(int(n) for n in s.split("x")) for s in args.shapes.split(",")]
for name in args.sets:
    wrapper = grounding(tuple(name.split(",")))
    program = export_model(wrapper, example_inputs(base.config, 2, 3, device=args.device)).module()
    for b, p in shapes:
        inputs = example_inputs(base.config, b, p, seed=1, device=args.device)
        with torch.no_grad():
            got, want, reference = program(*inputs), wrapper(*inputs), plain(*inputs)
        drift = [f"{float((g.float() - w.float()).abs().max()):.3g}" for g, w in zip(got, want)]
        eager = [f"{float((w.float() - r.float()).abs().max()):.3g}" for w, r in zip(want, reference)]
        print(f"{name} at {b}x{p}: exported - eager {drift}; eager - plain eager {eager}", flush=True)
    del wrapper, program
