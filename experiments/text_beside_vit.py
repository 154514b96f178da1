"""How much of the text encoder hides behind the image encoder on two CUDA streams (issue #50: what
`runtime/split_call.py` does with a split package's parts), without a build: the full model's random init in the
build's precision recipe, its ViT and text encoder sections each compiled alone (torch.compile, no CUDA graphs of
its own), then each way captured in one CUDA graph and timed (median ms, CUDA events):

- ViT alone, text alone;
- in turn: the ViT, then the text encoder, on one stream (the whole compiled model's order);
- beside: the text encoder on a side stream forked from the ViT's and joined after both.

One JSON line per shape as it is measured (--out DIR/text_beside_vit.jsonl), then a markdown table.
Usage: python experiments/text_beside_vit.py [--precision bf16] [--shapes 1x1,16x1,1x16] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))


def graphed_ms(fn, iters: int) -> float:
    """Median ms of `fn()` replayed as one CUDA graph."""
    from sam3_aoti.measure.timing import time_calls
    from sam3_aoti.runtime.cuda_graphs import CudaGraphRunner

    runner = CudaGraphRunner(fn, copy_outputs=False)
    times = time_calls(runner, (), "cuda", 3, iters)
    assert runner.failed is None, runner.failed
    return round(statistics.median(times), 3)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--precision", default="bf16")
    parser.add_argument("--shapes", default="1x1,16x1,1x16")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()

    import torch

    from sam3_aoti.model.checkpoints import build_model
    from sam3_aoti.model.configs import example_inputs
    from sam3_aoti.model.grounding import Sam3Grounding
    from sam3_aoti.model.section_calls import record_section_calls
    from sam3_aoti.pipeline.settings import load_settings

    settings = load_settings("sam3", "cuda", args.precision, "random")
    model = build_model(settings).to("cuda")
    wrapper = Sam3Grounding.built_as(model, settings)
    args.out.mkdir(parents=True, exist_ok=True)
    lines, rows, compiled = args.out / "text_beside_vit.jsonl", [], {}
    lines.write_text(json.dumps({"gpu": torch.cuda.get_device_name(0), "precision": args.precision,
                                 "torch": torch.__version__}) + "\n")
    side = torch.cuda.Stream()
    for shape in args.shapes.split(","):
        batch, prompts = (int(n) for n in shape.split("x"))
        t0 = time.perf_counter()
        images, token_ids = example_inputs(model.config, batch, prompts, device="cuda")
        with torch.no_grad():
            sections = record_section_calls(wrapper, images, token_ids)
            vit = sections["ViT"].compiled(torch.compile, compiled)
            text = sections["text encoder"].compiled(torch.compile, compiled)

            def in_turn():
                return vit.run(), text.run()

            def beside():
                caller = torch.cuda.current_stream()
                side.wait_stream(caller)
                with torch.cuda.stream(side):
                    out = text.run()
                image = vit.run()
                caller.wait_stream(side)
                return image, out

            row = {"batch": batch, "prompts": prompts}
            for name, fn in (("ViT", vit.run), ("text", text.run), ("in turn", in_turn), ("beside", beside)):
                row[name] = graphed_ms(fn, args.iters)
            row["hidden_ms"] = round(row["in turn"] - row["beside"], 3)
            row["setup_and_time_s"] = round(time.perf_counter() - t0, 1)
        rows.append(row)
        with lines.open("a") as f:
            f.write(json.dumps(row) + "\n")
        print(json.dumps(row), flush=True)
    table = ["| B x P | ViT ms | text ms | in turn ms | beside ms | hidden ms (of text's) |",
             "|---|---|---|---|---|---|"]
    table += [f"| {r['batch']} x {r['prompts']} | {r['ViT']} | {r['text']} | {r['in turn']} | {r['beside']} | "
              f"{r['hidden_ms']} |" for r in rows]
    (args.out / "text_beside_vit.md").write_text(
        f"# The text encoder beside the ViT on {torch.cuda.get_device_name(0)} ({args.precision}): each section "
        f"compiled alone, each way one CUDA graph, median of {args.iters}\n\n" + "\n".join(table) + "\n")


if __name__ == "__main__":
    main()
