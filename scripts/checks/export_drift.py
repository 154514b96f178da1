"""Which `[export] optimizations` change what torch.export's program computes: for each set named, the profile's
random model in the build's recipe (`Sam3Grounding.built_as`, the named optimizations in place of
pipeline.toml's), exported at (2, 3), then the exported program and the eager wrapper at other (B, P): each
output's max |exported - eager|, and the optimized eager against the wrapper with none.
  python scripts/checks/export_drift.py --profile sam3 --precision bf16 --device cuda \\
      --sets pixel_decoder_per_image text_fused_qkv [--shapes 3x1,1x1] [--config PATH]"""

import argparse
import copy
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default="sam3")
    parser.add_argument("--precision", default="bf16")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--config", help="a pipeline.toml (default: the repository's)")
    parser.add_argument("--shapes", default="3x1,1x1,2x3", help="BxP[,BxP...]")
    parser.add_argument("--sets", nargs="+", required=True, help="comma-separated optimizations, one set each")
    args = parser.parse_args()

    import torch

    from sam3_aoti.model.checkpoints import build_model
    from sam3_aoti.model.configs import example_inputs
    from sam3_aoti.model.grounding import Sam3Grounding
    from sam3_aoti.pipeline.settings import load_settings
    from sam3_aoti.model.exporting import export_model

    settings = load_settings(args.profile, args.device, args.precision, "random", args.config)
    base = build_model(settings)

    def grounding(optimizations):
        return Sam3Grounding.built_as(copy.deepcopy(base), settings, optimizations).to(settings.device)

    plain = grounding(())
    shapes = [tuple(int(n) for n in s.split("x")) for s in args.shapes.split(",")]
    for name in args.sets:
        wrapper = grounding(name.split(","))
        program = export_model(wrapper, example_inputs(base.config, 2, 3, device=settings.device)).module()
        for b, p in shapes:
            inputs = example_inputs(base.config, b, p, seed=1, device=settings.device)
            with torch.no_grad():
                got, want, reference = program(*inputs), wrapper(*inputs), plain(*inputs)
            drift = [f"{float((g.float() - w.float()).abs().max()):.3g}" for g, w in zip(got, want)]
            eager = [f"{float((w.float() - r.float()).abs().max()):.3g}" for w, r in zip(want, reference)]
            print(f"{name} at {b}x{p}: exported - eager {drift}; eager - plain eager {eager}", flush=True)
        del wrapper, program


if __name__ == "__main__":
    main()
