"""Each section at some shapes, compiled alone and timed, without a build: what `doit bench`'s by-section table
measures (`[bench] sections`), for a machine with minutes, not a package. The model is the profile's
random init in the build's precision recipe (a pipeline.toml of your own with --config, e.g. another
`[export] box_path_linears`); each section gets the inputs one whole call gives it. With --kernels N, the N
kernels that take most of each section's GPU time (torch.profiler over the compiled section). One JSON line per
section and shape as soon as it is measured (a run stopped early keeps what it measured), then a markdown table.
torch.compile specializes a size of 1, so a batch of 1 is a graph for one image alone, where the package runs its
one dynamic-batch program at every batch: its kernels at 1 x 1 may differ from these (the bench times the package).

Usage: python scripts/checks/section_times.py --profile sam3 --precision bf16 --shapes 1x1,1x16 --out DIR
       [--sections "DETR encoder,DETR decoder,..."] (default: the per-pair sections first, the ViT last)
       [--config PATH] [--kernels N]
"""

import argparse
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "src"))

ORDER = ("DETR encoder", "DETR decoder", "mask decoder", "scoring", "geometry encoder", "text encoder", "ViT")


def shape_list(text: str) -> list[tuple[int, int]]:
    try:
        shapes = [tuple(int(n) for n in item.split("x")) for item in text.split(",")]
    except ValueError:
        shapes = []
    if not shapes or any(len(s) != 2 or min(s) < 1 for s in shapes):
        raise argparse.ArgumentTypeError(f"{text!r}: give shapes as BxP[,BxP...], e.g. 1x1,1x16")
    return shapes


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", default="tiny")
    parser.add_argument("--precision")
    parser.add_argument("--device")
    parser.add_argument("--config", help="a pipeline.toml (default: the repository's)")
    parser.add_argument("--shapes", type=shape_list, default=[(1, 16)], help="BxP[,BxP...] (default 1x16)")
    parser.add_argument("--iters", type=int, default=10)
    parser.add_argument("--kernels", type=int, default=0, help="also list each section's N costliest kernels")
    parser.add_argument("--sections", default=",".join(ORDER))
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    import torch

    from sam3_aoti.model.checkpoints import build_model
    from sam3_aoti.model.section_calls import record_section_calls
    from sam3_aoti.model.configs import example_inputs
    from sam3_aoti.model.grounding import Sam3Grounding
    from sam3_aoti.pipeline.settings import load_settings
    from sam3_aoti.measure.kernels import top_kernels
    from sam3_aoti.measure.parts import section_floor, time_section
    from sam3_aoti.measure.rates import copy_gbps, gemm_tflops
    from sam3_aoti.pipeline.report import dash

    settings = load_settings(args.profile, args.device, args.precision, "random", args.config)
    device = settings.device
    t0 = time.perf_counter()
    model = build_model(settings).to(device)
    wrapper = Sam3Grounding.built_as(model, settings)
    gemm, memory = (gemm_tflops(), copy_gbps()) if device == "cuda" else (None, None)
    args.out.mkdir(parents=True, exist_ok=True)
    lines = args.out / "section_times.jsonl"
    head = {"profile": settings.profile, "precision": settings.precision, "device": device,
            "export": settings.stage("export"), "bf16_gemm_tflops": gemm, "copy_gbps": memory,
            "setup_s": round(time.perf_counter() - t0, 1),
            "gpu": torch.cuda.get_device_name(0) if device == "cuda" else None, "torch": torch.__version__}
    lines.write_text(json.dumps(head) + "\n")
    print(json.dumps(head), flush=True)
    rows, compiled = [], {}  # one compile per section, kept across shapes (the second compiles with dynamic shapes)
    for batch, prompts in args.shapes:
        images, token_ids = example_inputs(model.config, batch, prompts, device=device)
        sections = record_section_calls(wrapper, images, token_ids)
        for name in args.sections.split(","):
            t0 = time.perf_counter()
            result = time_section(wrapper, sections[name], "compiled", compiled, device,
                                  {"warmup": 3, "iters": args.iters}, gemm, memory)
            row = {"section": name, "batch": batch, "prompts": prompts, "share_of_gemm_rate": None, **result}
            if args.kernels and device == "cuda":
                runner = sections[name].compiled(None, compiled)  # the callables time_section compiled
                row["kernels"] = top_kernels(runner.run, (), args.kernels)
            row["compile_and_time_s"] = round(time.perf_counter() - t0, 1)
            rows.append(row)
            with lines.open("a") as f:
                f.write(json.dumps(row) + "\n")
            print(json.dumps(row), flush=True)
    columns = ["B", "P", "section", "ms (p90)", "GFLOP", "weights MB", "TFLOP/s", "share of GEMM rate",
               "floor ms (bound), share reached"]
    table = ["| " + " | ".join(columns) + " |", "|" + "---|" * len(columns)]
    table += [f"| {r['batch']} | {r['prompts']} | {r['section']} | {r['median_ms']} ({r['p90_ms']}) | "
              f"{r['flop'] / 1e9:.4g} | {r['weight_bytes'] / 1e6:.4g} | {r['tflop_per_s']} | "
              f"{dash(r['share_of_gemm_rate'])} | {section_floor(r) if 'floor_ms' in r else '-'} |" for r in rows]
    sums = [f"B = {b}, P = {p}: {sum(r['median_ms'] for r in rows if (r['batch'], r['prompts']) == (b, p)):.2f} ms"
            for b, p in args.shapes]
    kernels = []
    for r in rows:
        if "kernels" in r:
            k = r["kernels"]
            kernels += [f"\n### {r['section']}, B = {r['batch']}, P = {r['prompts']}: {k['kernel_ms_per_call']} ms of "
                        f"kernels in {k['launches_per_call']} launches per call\n",
                        "| kernel | ms per call | launches per call |", "|---|---|---|"]
            kernels += [f"| `{t['kernel']}` | {t['ms_per_call']} | {t['launches_per_call']} |" for t in k["top"]]
    graphs = ", CUDA graphs" if device == "cuda" else ""
    (args.out / "section_times.md").write_text(
        f"# {settings.profile} {settings.precision} on {head['gpu'] or device}: each section compiled alone "
        f"(torch.compile{graphs}), median of {args.iters}\n\n" + "\n".join(table)
        + "\n\nSum of the sections: " + "; ".join(sums) + "\n" + "\n".join(kernels) + "\n")


if __name__ == "__main__":
    main()
