"""How far running a split package's parts side by side on CUDA streams goes (issue #50): on a built package, each
way of calling it inside one CUDA graph, timed in turn at each shape (median ms of --iters calls, CUDA events):

- whole:      the whole compiled `model`;
- in turn:    encode_image, encode_text, decode, one after the other (one stream);
- text beside: the runtime's `split_call.SplitCall` (encode_text on a side stream beside encode_image);
- halves:     text beside, and the batch in two halves, the second half's image encoder on a second stream, so
              the first half's decode runs beside it (B >= 2);
- prompt halves: text beside, and decode's pairs in two halves of the prompts on two streams (P >= 2).

Each way's outputs are checked against `in turn` (the same kernels: equal up to the order of the pairs, which the
halves put back). Usage: python experiments/split_overlap.py PACKAGE [--shapes 1x1,2x3,16x1,1x16] [--out DIR]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path


def raw(package, name):
    """The package's AOTI runner `name`, without checks or graphs (loaded with cuda_graphs=False)."""
    return package.runners[name].runner


def ways(package):
    import torch

    from sam3_aoti.runtime.split_call import SplitCall

    image, text, decode = raw(package, "encode_image"), raw(package, "encode_text"), raw(package, "decode")
    parts = {"encode_image": image, "encode_text": text, "encode_boxes": raw(package, "encode_boxes"),
             "decode": decode}
    beside = SplitCall(parts, "cuda")
    second = torch.cuda.Stream()

    def in_turn(images, ids):
        features, prompts = image(images), text(ids)
        return decode(*features[:6], *prompts)

    def halves(images, ids):
        caller, half = torch.cuda.current_stream(), images.shape[0] // 2
        beside.side.wait_stream(caller)
        with torch.cuda.stream(beside.side):
            prompts = text(ids)
        second.wait_stream(caller)
        first = image(images[:half])
        with torch.cuda.stream(second):
            rest = image(images[half:])
        caller.wait_stream(beside.side)
        out_first = decode(*first[:6], *prompts)
        second.wait_stream(beside.side)
        with torch.cuda.stream(second):
            out_rest = decode(*rest[:6], *prompts)
        caller.wait_stream(second)
        return tuple(torch.cat([a, b]) for a, b in zip(out_first, out_rest))

    def prompt_halves(images, ids):
        caller, half = torch.cuda.current_stream(), ids.shape[0] // 2
        beside.side.wait_stream(caller)
        with torch.cuda.stream(beside.side):
            first_prompts = text(ids[:half])
            rest_prompts = text(ids[half:])
        features = image(images)
        caller.wait_stream(beside.side)
        second.wait_stream(caller)
        out_first = decode(*features[:6], *first_prompts)
        with torch.cuda.stream(second):
            out_rest = decode(*features[:6], *rest_prompts)
        caller.wait_stream(second)
        batch = images.shape[0]  # pairs are (image, prompt), prompt fastest: put each image's prompts back together
        return tuple(torch.cat([a.unflatten(0, (batch, -1)), b.unflatten(0, (batch, -1))], 1).flatten(0, 1)
                     for a, b in zip(out_first, out_rest))

    return {"whole": raw(package, "model"), "in turn": in_turn, "text beside": beside, "halves": halves,
            "prompt halves": prompt_halves}


def time_graphed(fn, args, iters: int) -> float:
    """Median ms of `fn(*args)` replayed as one CUDA graph."""
    from sam3_aoti.measure.timing import time_calls
    from sam3_aoti.runtime.cuda_graphs import CudaGraphRunner

    runner = CudaGraphRunner(fn, copy_outputs=False)
    times = time_calls(runner, args, "cuda", 3, iters)
    assert runner.failed is None, runner.failed
    return statistics.median(times)


def main() -> None:
    import torch

    from sam3_aoti.runtime.loader import load_package
    from sam3_aoti.stages.bench import PHRASES

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("package", type=Path)
    parser.add_argument("--shapes", default="1x1,2x3,4x4,16x1,1x16")
    parser.add_argument("--iters", type=int, default=20)
    parser.add_argument("--out", type=Path)
    args = parser.parse_args()
    package = load_package(args.package, cuda_graphs=False)
    side = package.metadata["models"]["model"]["inputs"]["images"]["shape"][2]  # any size: transforms resizes
    calls, rows = ways(package), []
    for index, shape in enumerate(args.shapes.split(",")):
        b, p = (int(n) for n in shape.split("x"))
        g = torch.Generator().manual_seed(b)
        images = package.transforms((torch.rand(b, 3, side, side, generator=g) * 255).cuda())
        ids = package.encode_prompts([PHRASES[i % len(PHRASES)] for i in range(p)]).cuda()
        names = list(calls)
        with torch.no_grad():
            reference = calls["in turn"](images, ids)
            row = {"batch": b, "prompts": p, "ms": {}, "max_abs_vs_in_turn": {}}
            for name in names[index % len(names):] + names[:index % len(names)]:  # a rotated order per shape
                if (name == "halves" and b < 2) or (name == "prompt halves" and p < 2):
                    continue
                try:  # one way that fails (a capture, say) is recorded, and the others still run
                    got = calls[name](images, ids)
                    row["max_abs_vs_in_turn"][name] = max(float((a.float() - r.float()).abs().max())
                                                          for a, r in zip(got, reference))
                    row["ms"][name] = round(time_graphed(calls[name], (images, ids), args.iters), 2)
                except (RuntimeError, AssertionError) as e:
                    row.setdefault("failed", {})[name] = str(e).strip().splitlines()[0] if str(e).strip() else repr(e)
                    print(f"{b} x {p}: {name} failed: {row['failed'][name]}", flush=True)
        row["ms"] = {n: row["ms"][n] for n in names if n in row["ms"]}
        rows.append(row)
        print(f"{b} x {p}: " + ", ".join(f"{n} {ms} ms" for n, ms in row["ms"].items()), flush=True)
    result = {"gpu": torch.cuda.get_device_name(0), "package": str(args.package),
              "precision": package.metadata.get("precision"), "rows": rows}
    if args.out:
        args.out.mkdir(parents=True, exist_ok=True)
        (args.out / "split-overlap.json").write_text(json.dumps(result, indent=1))
        names = list(calls)
        lines = [f"# Ways of calling the split package on {result['gpu']} ({result['precision']}), median ms in one "
                 "CUDA graph each", "", "| B x P | " + " | ".join(names) + " |", "|---|" + "---|" * len(names)]
        lines += [f"| {r['batch']} x {r['prompts']} | " + " | ".join(str(r["ms"].get(n, "-")) for n in names) + " |"
                  for r in rows]
        (args.out / "split-overlap.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
