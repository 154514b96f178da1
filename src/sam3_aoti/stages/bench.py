"""Stage `bench`: the yardstick. Latency of what users run today (Meta's `sam3` eager under bf16 autocast,
transformers eager) against the exported program and the AOTI package with and without CUDA graphs, and
how long each kind of consumer takes to load the package.

At each (B, P) of `[bench] shapes`, on the same pixels and prompts: median and p90 of timed calls after
warm-up (CUDA events on the GPU, wall clock on the CPU), images/s, peak working memory, FLOPs of one call
(`FlopCounterMode` on the eager model) and the achieved share of the card's bf16 GEMM rate, measured in the
same run. On the GPU also a kernel-category breakdown of one (2, 3) call with the launches per call. A split
package's parts (`[export] split`) are timed alone at each shape, with their FLOPs: the image encoder, the
text encoder, the heads, and new prompts against encoded images. And where a call's time goes by section
(`[bench] sections`): ViT, text encoder, geometry encoder, DETR encoder, DETR decoder, mask decoder and
scoring, each compiled alone (torch.compile, CUDA graphs on the GPU) from the build's own wrapper and fed what
one whole call gives it, with FLOPs, weights read, achieved rate and (on the GPU) the floor of each section,
beside the package's `transforms`. Every column warms up at every shape before any is timed, and the rows
rotate the order the columns run in. Writes bench.json, bench.md and bench.png. A benchmark, not a gate: it
never fails on speed.
"""

from __future__ import annotations

import logging
import time

from ..measure.counts import flops_of
from ..measure.kernels import kernel_breakdown
from ..measure.load_times import load_seconds
from ..measure.parts import RAW_FRAME, part_times, section_floor, section_rate, section_times
from ..measure.rates import copy_gbps, gemm_tflops
from ..measure.timing import measure, rotated, warm_up
from ..pipeline.artifacts import record
from ..pipeline.paths import ProfilePaths
from ..pipeline.report import Report, Table, dash, write_report
from ..pipeline.schema import BENCH_COLUMNS as COLUMNS
from ..pipeline.settings import Settings
from ..runtime.files import write_bytes_atomic

log = logging.getLogger(__spec__.name)  # not __name__: run by `python -m`, a stage is "__main__"

# Prompts the benched calls carry (the first P): real phrases, so Meta's model tokenizes what ours gets.
PHRASES = ("a person", "a car", "a tree", "a building", "a swimming pool", "a road", "a boat", "a roof",
           "a dog", "a bicycle", "a truck", "a field", "a river", "a bridge", "a solar panel", "a parking lot")
PROFILE_SHAPE = (2, 3)  # the call whose kernels are broken down

def section_wrapper(settings: Settings):
    """The model as the export stage wraps it (the build's precision recipe), whose sections bench times alone."""
    from ..model.checkpoints import load_model
    from ..model.grounding import Sam3Grounding

    return Sam3Grounding.built_as(load_model(settings).to(settings.device), settings)


def bench_inputs(config, package, batch: int, prompts: int, device: str):
    from ..model.configs import example_inputs

    phrases = [PHRASES[i % len(PHRASES)] for i in range(prompts)]
    images, _ = example_inputs(config, batch, 1, seed=batch, device=device)
    return images, package.encode_prompts(phrases).to(device), phrases


def run(settings: Settings) -> None:
    import torch

    from ..model.checkpoints import eager_reference
    from ..model.meta import meta_grounding
    from ..runtime.loader import load_package

    paths, opts = ProfilePaths.of(settings), settings.stage("bench")
    cuda = settings.device == "cuda"
    columns = set(opts["columns"])
    package = load_package(paths.package, cuda_graphs=False)
    loads = load_seconds(paths.package, settings.device, opts["isa_probe_loaders"]) if opts["load_times"] else {}
    t0 = time.perf_counter()
    exported = package.exported_only()
    fallback_s = time.perf_counter() - t0
    log.info("load: exported-program fallback %.2f s", fallback_s)
    eager, _ = eager_reference(settings)  # also what FLOPs are counted on
    sections_how = opts.get("sections", "compiled")
    wrapper, compiled_sections = (section_wrapper(settings), {}) if sections_how != "off" else (None, None)
    backends = {COLUMNS[c]: fn for c, fn in
                [("transformers", eager), ("exported", exported.model), ("aoti", package.model)] if c in columns}
    graphed = None
    if cuda and "aoti_graphs" in columns:
        graphed = load_package(paths.package, cuda_graphs=True, max_graphs=len(opts["shapes"]))
        backends[COLUMNS["aoti_graphs"]] = graphed.model
        if "aoti_graphs_whole" in columns and graphed.split_call:
            backends[COLUMNS["aoti_graphs_whole"]] = graphed["model"]
    meta = meta_grounding(settings) if "meta" in columns else None
    if cuda and meta is None and "meta" in columns:
        log.info("Meta's sam3 is not importable here (or not the full model): its column is left out")
    gemm, memory = (gemm_tflops(), copy_gbps()) if cuda else (None, None)
    if gemm:
        log.info("bf16 GEMM 8192^3 on this card: %.0f TFLOP/s; a 2 GiB copy: %.0f GB/s", gemm, memory)
    shapes = [tuple(s) for s in opts["shapes"]]
    inputs = {(b, p): bench_inputs(eager.model.config, package, b, p, settings.device) for b, p in shapes}

    def calls_at(shape) -> dict:
        images, token_ids, phrases = inputs[shape]
        calls = {name: (fn, (images, token_ids)) for name, fn in backends.items()}
        return {COLUMNS["meta"]: (meta, (images, phrases)), **calls} if meta is not None else calls

    warm_up(shapes, calls_at, opts["warmup"])
    rows, breakdown = [], None
    for index, (b, p) in enumerate(shapes):
        images, token_ids, _ = inputs[(b, p)]
        flops = flops_of(eager, (images, token_ids))
        row = {"batch": b, "prompts": p, "flop": flops, "backends": {}}
        calls = calls_at((b, p))
        for name in rotated(list(calls), index):
            fn, args = calls[name]
            result = measure(fn, args, settings.device, opts["warmup"], opts["iters"])
            result["images_per_s"] = round(b / (result["median_ms"] / 1e3), 1)
            if gemm:
                result["share_of_gemm_rate"] = round(flops / (result["median_ms"] * 1e-3) / 1e12 / gemm, 3)
            row["backends"][name] = result
            log.info("B=%d P=%d %-32s median %8.2f ms  p90 %8.2f ms", b, p, name, result["median_ms"], result["p90_ms"])
        row["backends"] = {name: row["backends"][name] for name in calls}  # the table's column order
        row["order"] = rotated(list(calls), index)
        if (graphed or package).parts:
            row["parts"] = part_times(graphed or package, eager, images, token_ids, flops, settings.device, opts)
        if wrapper is not None:
            whole = row["backends"].get(COLUMNS["aoti_graphs"]) or row["backends"].get(COLUMNS["aoti"])
            row["sections"] = section_times(wrapper, package.transforms, images, token_ids, sections_how,
                                            compiled_sections, settings.device, opts,
                                            whole["median_ms"] if whole else None, gemm, memory)
        rows.append(row)
        if cuda and (b, p) == PROFILE_SHAPE:
            breakdown = kernel_breakdown(package.model, (images, token_ids))
            log.info("kernels of one AOTI call at %s: %s", PROFILE_SHAPE, breakdown)
        if cuda:
            torch.cuda.empty_cache()
    info = {"profile": settings.profile, "device": settings.device, "precision": settings.precision,
            "weights": settings.weights, "date": time.strftime("%Y-%m-%d"),
            "package_bytes": paths.package.stat().st_size, "fallback_bytes": paths.fallback_package.stat().st_size,
            "load_seconds": loads, "fallback_load_seconds": round(fallback_s, 2),
            "gpu": torch.cuda.get_device_name(0) if cuda else None, "bf16_gemm_tflops": gemm,
            "copy_gbps": memory,
            "versions": package.metadata.get("versions", {}), "torch": torch.__version__,
            "warmup": opts["warmup"], "iters": opts["iters"], "rows": rows, "aoti_kernels_at_2x3": breakdown,
            "cuda_graphs": graphed and {name: {"captures": runner.captures, "failed": runner.failed}
                                        for name, runner in graph_runners(graphed).items()}}
    write_bytes_atomic(paths.bench_plot, plot(rows, f"{settings.profile} {settings.precision} on {info['gpu'] or 'cpu'}"))
    write_report(bench_report(settings, info), paths.bench_json, paths.bench_md)
    record(paths.manifest, "bench", [paths.bench_json, paths.bench_md, paths.bench_plot], settings.fingerprint("bench"))
    log.info("table: %s", paths.bench_md)


def graph_runners(package) -> dict:
    """The package's CUDA graph runners by name (`model`, its parts, `model_with_boxes`): what was captured."""
    return {name: runner.graph_runner for name, runner in package.runners.items()
            if getattr(runner, "graph_runner", None) is not None}


def bench_report(settings: Settings, info: dict) -> Report:
    rows = info["rows"]
    names = list(rows[0]["backends"]) if rows else []
    latency = Table("Latency", ["B", "P", "GFLOP", *(f"{n} ms (p90)" for n in names), "best images/s",
                                "best share of GEMM rate", "best peak MiB"], [])
    for r in rows:
        best = min(r["backends"].values(), key=lambda v: v["median_ms"])
        latency.rows.append([r["batch"], r["prompts"], f"{r['flop'] / 1e9:.4g}",
                             *(f"{v['median_ms']} ({v['p90_ms']})" for v in r["backends"].values()),
                             best["images_per_s"], f"{best['share_of_gemm_rate']:.0%}" if "share_of_gemm_rate" in best else "-",
                             best["peak_mib"] if best["peak_mib"] is not None else "-"])
    loads = Table("Load (fresh process each, page cache warm)", ["consumer", "seconds"],
                  [[k, v] for k, v in info["load_seconds"].items()] + [["exported-program fallback", info["fallback_load_seconds"]]])
    tables = [latency, loads] if info["load_seconds"] else [latency]
    split = [r for r in rows if r.get("parts")]
    if split:
        parts = list(split[0]["parts"])
        rated = [n for n in parts if "tflop_per_s" in split[0]["parts"][n]]
        tables.append(Table("Encode once, decode many: the split models, each timed alone (through CUDA graphs "
                            "where the bench has them)", ["B", "P", *(f"{n} ms (p90)" for n in parts),
                                                     *(f"{n} TFLOP/s" for n in rated)],
                            [[r["batch"], r["prompts"], *(f"{r['parts'][n]['median_ms']} ({r['parts'][n]['p90_ms']})"
                                                          for n in parts),
                              *(r["parts"][n]["tflop_per_s"] for n in rated)] for r in split]))
    by_section = [r for r in rows if r.get("sections")]
    if by_section:
        names = list(by_section[0]["sections"]["sections"])
        how = by_section[0]["sections"]["how"]
        tables.append(Table(f"Where a call's time goes, by section: each section {how} alone, fed what the whole "
                            "model gives it (ms, median)",
                            ["B", "P", f"transforms (B {RAW_FRAME[0]} × {RAW_FRAME[1]} frames, the package's, "
                             "before the call)", *names, "sum of sections", "the package's call", "between the sections"],
                            [[r["batch"], r["prompts"], r["sections"]["transforms"]["median_ms"],
                              *(r["sections"]["sections"][n]["median_ms"] for n in names),
                              r["sections"]["sum_ms"], dash(r["sections"]["package_ms"]),
                              dash(r["sections"]["between_ms"])] for r in by_section]))
        first = by_section[0]["sections"]["sections"][names[0]]
        rate = ("The same sections' GFLOP, the weights they read and their achieved TFLOP/s"
                + (" (share of the GEMM rate)" if "share_of_gemm_rate" in first else "")
                + "; the whole call's GFLOP as the build computes them, which the sections' add up to, beside the "
                "model's count (the latency table's; optimizations may restructure the arithmetic)")
        tables.append(Table(rate, ["B", "P", *names, "whole call, the build's GFLOP", "the model's GFLOP"],
                            [[r["batch"], r["prompts"], *(section_rate(r["sections"]["sections"][n]) for n in names),
                              f"{r['sections']['flop'] / 1e9:.4g}", f"{r['flop'] / 1e9:.4g}"] for r in by_section]))
        if "floor_ms" in first:
            tables.append(Table("The same sections against their floor: their FLOPs at the GEMM rate or their weights "
                                "read once at the copy rate, whichever takes longer (a lower bound: activations "
                                "are not counted); ms, and the share of it each section reaches",
                                ["B", "P", *names],
                                [[r["batch"], r["prompts"], *(section_floor(r["sections"]["sections"][n]) for n in names)]
                                 for r in by_section]))
    kernels = info.get("aoti_kernels_at_2x3")
    if kernels:
        tables.append(Table(f"AOTI kernels of one {PROFILE_SHAPE[0]} x {PROFILE_SHAPE[1]} call (torch.profiler)",
                            ["category", "ms per call"],
                            [[c, ms] for c, ms in kernels["kernel_ms_per_call"].items()]
                            + [["GPU idle between kernels", kernels["gpu_idle_ms_per_call"]],
                               ["wall (CUDA events)", kernels["wall_ms_per_call"]],
                               ["launches per call", kernels["launches_per_call"]]]))
    gemm = (f"; this card's bf16 GEMM rate in this run: {info['bf16_gemm_tflops']} TFLOP/s, its copy rate "
            f"{info.get('copy_gbps')} GB/s (bytes read and written)" if info["bf16_gemm_tflops"] else "")
    notes = [f"{info['date']}, weights {info['weights']}: median (p90) of {info['iters']} calls after {info['warmup']} "
             f"warm-up, same pixels and prompts for every column{gemm}. 'best' is the fastest column of the row. "
             "Every column warms up at every shape before any is timed, and each row times the columns in a "
             "rotated order (`order` in bench.json).",
             f"Package {info['package_bytes'] / 1e9:.2f} GB, fallback beside it {info['fallback_bytes'] / 1e9:.2f} GB."]
    if COLUMNS["aoti_graphs_whole"] in names:
        notes.append("The AOTI columns run the package's `model`: its parts in one call (one CUDA graph with "
                     "graphs), the prompts' encoder on a stream of its own beside the image encoder "
                     "(`runtime/split_call.py`); 'the whole compiled model' is `package[\"model\"]`, what "
                     "`split_call=False` runs.")
    if settings.spec.reference != settings.precision:
        notes.append(f"An {settings.precision} build: 'transformers eager' is the {settings.spec.reference} model "
                     "(verify's reference), and FLOPs are its.")
    return Report(f"Bench: {settings.profile} on {info['gpu'] or 'cpu'} ({settings.precision})", notes, None, tables,
                  [("bench.png", "median ms per call")], data=info)


def plot(rows: list[dict], title: str) -> bytes:
    """Grouped bars, one group per (B, P), one bar per backend; below them, where the rows have it, one stacked
    bar per (B, P) of the sections' ms. A PNG (PIL: no plotting dependency)."""
    import io

    from PIL import Image, ImageDraw

    names = list(rows[0]["backends"]) if rows else []
    by_section = [r for r in rows if r.get("sections")]
    colors = ["#7f7f7f", "#bcbd22", "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b"]
    width, panel, left, bottom, top = 900, 420, 60, 50, 40
    image = Image.new("RGB", (width, panel * (2 if by_section else 1)), "white")
    draw = ImageDraw.Draw(image)
    draw.text((left, 10), f"{title}: median ms per call", fill="black")
    peak = max((v["median_ms"] for r in rows for v in r["backends"].values()), default=1.0)
    group = (width - left - 20) / max(len(rows), 1)
    bar = group * 0.8 / max(len(names), 1)
    for gi, r in enumerate(rows):
        x0 = left + gi * group + group * 0.1
        for bi, name in enumerate(names):
            ms = r["backends"][name]["median_ms"]
            h = (panel - bottom - top) * ms / peak
            x = x0 + bi * bar
            draw.rectangle([x, panel - bottom - h, x + bar - 2, panel - bottom], fill=colors[bi % len(colors)])
            draw.text((x, panel - bottom - h - 12), f"{ms:.0f}", fill="black")
        draw.text((x0, panel - bottom + 5), f"B={r['batch']} P={r['prompts']}", fill="black")
    legend(draw, names, colors, left, panel - 20)
    if by_section:
        sections = list(by_section[0]["sections"]["sections"])
        base = 2 * panel
        draw.text((left, panel + 10), f"by section ({by_section[0]['sections']['how']} alone): median ms, "
                                      "stacked; the line: the package's call", fill="black")
        peak = max(max(r["sections"]["sum_ms"], r["sections"]["package_ms"] or 0) for r in by_section) or 1.0
        group = (width - left - 20) / len(by_section)
        scale = (panel - bottom - top) / peak
        for gi, r in enumerate(by_section):
            x0, y = left + gi * group + group * 0.3, base - bottom
            for pi, name in enumerate(sections):
                h = r["sections"]["sections"][name]["median_ms"] * scale
                draw.rectangle([x0, y - h, x0 + group * 0.4, y], fill=colors[pi % len(colors)])
                y -= h
            if r["sections"]["package_ms"]:
                line = base - bottom - r["sections"]["package_ms"] * scale
                draw.line([x0 - 6, line, x0 + group * 0.4 + 6, line], fill="black", width=2)
            draw.text((x0, base - bottom + 5), f"B={r['batch']} P={r['prompts']}", fill="black")
        legend(draw, sections, colors, left, base - 20, step=115)
    out = io.BytesIO()
    image.save(out, format="PNG")
    return out.getvalue()


def legend(draw, names: list, colors: list, left: int, y: int, step: int = 150) -> None:
    for i, name in enumerate(names):
        draw.rectangle([left + i * step, y + 2, left + i * step + 10, y + 12], fill=colors[i % len(colors)])
        draw.text((left + i * step + 14, y), name[:22], fill="black")


if __name__ == "__main__":
    from ..pipeline.runner import main

    main("bench", run, __doc__.splitlines()[0])
