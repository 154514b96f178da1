"""Each model part at one shape, compiled alone and timed, without a build: what `doit bench`'s by-part table
measures (`[bench] model_parts`), for a machine with minutes, not a package. The model is the profile's
random init in the build's precision recipe; each part gets the inputs one whole call gives it. One JSON line
per part as soon as it is timed (a run stopped early keeps what it measured), then a markdown table.

Usage: python scripts/part_times.py --profile sam3 --precision bf16 --batch 1 --prompts 16 --out DIR
       [--parts "DETR encoder,DETR decoder,..."] (default: the per-pair parts first, the ViT last)
"""

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

ORDER = ("DETR encoder", "DETR decoder", "mask decoder", "scoring", "geometry encoder", "text encoder", "ViT")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default="tiny")
    parser.add_argument("--precision")
    parser.add_argument("--device")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--parts", default=",".join(ORDER))
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    import torch

    from sam3_aoti.model.checkpoints import build_model
    from sam3_aoti.model.part_calls import record_part_calls
    from sam3_aoti.model.wrapper import Sam3Grounding, example_inputs
    from sam3_aoti.pipeline.settings import load_settings
    from sam3_aoti.stages.bench import gemm_tflops, time_part

    settings = load_settings(args.profile, args.device, args.precision, "random", None)
    device = settings.device
    t0 = time.perf_counter()
    model = build_model(settings).to(device)
    wrapper = Sam3Grounding.built_as(model, settings)
    images, token_ids = example_inputs(model.config, args.batch, args.prompts, device=device)
    parts = record_part_calls(wrapper, images, token_ids)
    gemm = gemm_tflops() if device == "cuda" else None
    args.out.mkdir(parents=True, exist_ok=True)
    lines = args.out / "part_times.jsonl"
    head = {"profile": settings.profile, "precision": settings.precision, "device": device, "batch": args.batch,
            "prompts": args.prompts, "bf16_gemm_tflops": gemm, "setup_s": round(time.perf_counter() - t0, 1),
            "gpu": torch.cuda.get_device_name(0) if device == "cuda" else None, "torch": torch.__version__}
    lines.write_text(json.dumps(head) + "\n")
    print(json.dumps(head), flush=True)
    rows = []
    for name in args.parts.split(","):
        t0 = time.perf_counter()
        result = time_part(wrapper, parts[name], "compiled", {}, device, {"warmup": 3, "iters": args.iters}, gemm)
        row = {"part": name, "share_of_gemm_rate": None, **result,
               "compile_and_time_s": round(time.perf_counter() - t0, 1)}
        rows.append(row)
        with lines.open("a") as f:
            f.write(json.dumps(row) + "\n")
        print(json.dumps(row), flush=True)
    table = ["| part | ms (p90) | GFLOP | TFLOP/s | share of GEMM rate |", "|---|---|---|---|---|"]
    table += [f"| {r['part']} | {r['median_ms']} ({r['p90_ms']}) | {r['flop'] / 1e9:.4g} | {r['tflop_per_s']} | "
              f"{r['share_of_gemm_rate'] if r['share_of_gemm_rate'] is not None else '-'} |" for r in rows]
    graphs = ", CUDA graphs" if device == "cuda" else ""
    (args.out / "part_times.md").write_text(
        f"# {settings.profile} {settings.precision} on {head['gpu'] or device}, B = {args.batch}, P = {args.prompts}: "
        f"each part compiled alone (torch.compile{graphs}), median of {args.iters}\n\n"
        + "\n".join(table) + f"\n\nSum of parts: {sum(r['median_ms'] for r in rows):.2f} ms\n")


if __name__ == "__main__":
    main()
