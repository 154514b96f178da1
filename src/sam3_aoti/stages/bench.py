"""Stage `bench`: the yardstick. Latency of what users run today (Meta's `sam3` eager under bf16 autocast,
transformers eager) against the exported program and the AOTI package with and without CUDA graphs, and
how long each kind of consumer takes to load the package.

At each (B, P) of `[bench] shapes`, on the same pixels and prompts: median and p90 of timed calls after
warm-up (CUDA events on the GPU, wall clock on the CPU), images/s, peak working memory, FLOPs of one call
(`FlopCounterMode` on the eager model) and the achieved share of the card's bf16 GEMM rate, measured in the
same run. On the GPU also a kernel-category breakdown of one (2, 3) call with the launches per call. A split
package's parts (`[export] split`) are timed alone at each shape, with their FLOPs: the image encoder, the
text encoder, the heads, and new prompts against encoded images. And where a call's time goes by model part
(`[bench] model_parts`): ViT, text encoder, geometry encoder, DETR encoder, DETR decoder, mask decoder and
scoring, each compiled alone (torch.compile, CUDA graphs on the GPU) from the build's own wrapper and fed what
one whole call gives it, with FLOPs, weights read, achieved rate and (on the GPU) the floor of each part,
beside the package's `transforms`. Every column warms up at every shape before any is timed, and the rows
rotate the order the columns run in. Writes bench.json, bench.md and bench.png. A benchmark, not a gate: it
never fails on speed.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from ..pipeline.artifacts import record
from ..pipeline.paths import ProfilePaths
from ..pipeline.report import Report, Table, write_report
from ..pipeline.schema import BENCH_COLUMNS as COLUMNS
from ..pipeline.settings import Settings
from ..runtime.files import write_bytes_atomic
from ..runtime.scratch import process_folder

log = logging.getLogger(__spec__.name)  # not __name__: run by `python -m`, a stage is "__main__"

# Prompts the benched calls carry (the first P): real phrases, so Meta's model tokenizes what ours gets.
PHRASES = ("a person", "a car", "a tree", "a building", "a swimming pool", "a road", "a boat", "a roof",
           "a dog", "a bicycle", "a truck", "a field", "a river", "a bridge", "a solar panel", "a parking lot")
PROFILE_SHAPE = (2, 3)  # the call whose kernels are broken down
KERNEL_CATEGORIES = (  # first match wins, on the lower-cased kernel name
    ("attention (SDPA)", ("flash", "fmha", "attention", "cudnn_generated", "sdpa")),
    ("GEMM", ("gemm", "nvjet", "cutlass", "xmma", "matmul", "wgmma", "splitk")),
    ("convolution", ("conv", "implicit", "winograd", "dgrad", "wgrad")),
    ("Triton (fused pointwise/reductions)", ("triton",)),
    ("copies", ("copy", "memcpy", "memset", "cat")),
)


def time_calls(fn, args, device: str, warmup: int, iters: int) -> list[float]:
    """Milliseconds per call."""
    import torch

    with torch.no_grad():
        for _ in range(warmup):
            fn(*args)
        times = []
        for _ in range(iters):
            if device == "cuda":
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                start.record()
                fn(*args)
                end.record()
                torch.cuda.synchronize()
                times.append(start.elapsed_time(end))
            else:
                t0 = time.perf_counter()
                fn(*args)
                times.append((time.perf_counter() - t0) * 1e3)
    return times


def p90(values: list[float]) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, round(0.9 * (len(ordered) - 1)))]


def measure(fn, args, device: str, warmup: int, iters: int) -> dict:
    """Median and p90 ms and the peak memory the calls took beyond what was allocated before (CUDA)."""
    import torch

    if device == "cuda":
        torch.cuda.synchronize()
        torch.cuda.reset_peak_memory_stats()
        before = torch.cuda.memory_allocated()
    ms = time_calls(fn, args, device, warmup, iters)
    peak = (torch.cuda.max_memory_allocated() - before) / 2**20 if device == "cuda" else None
    return {"median_ms": round(statistics.median(ms), 2), "p90_ms": round(p90(ms), 2),
            "peak_mib": round(peak, 1) if peak is not None else None}


def warm_up(shapes: list, calls_at, warmup: int) -> None:
    """Every column's warm-up at every shape before any is timed: the first shape a column runs pays for its
    one-time work (kernel loads, allocator growth, autotuning), which no row should carry."""
    import torch

    with torch.no_grad():
        for shape in shapes:
            for fn, args in calls_at(shape).values():
                for _ in range(max(warmup, 1)):
                    fn(*args)


def rotated(names: list, index: int) -> list:
    """The columns in the order row `index` times them: each row starts one column later, so no column is
    always first (or always after the slowest)."""
    k = index % len(names) if names else 0
    return names[k:] + names[:k]


def part_times(package, eager, images, token_ids, flops: int, device: str, opts: dict) -> dict:
    """A split package's parts timed alone at this shape, with their FLOPs (counted on eager's own parts; the
    heads' are the whole call's less the encoders'), and encode once / decode many: one more prompt, and
    this row's prompts, encoded and decoded against images encoded before."""
    features, text = package.encode_image(images), package.encode_text(token_ids)
    with_new_prompts = lambda f, t: package.decode(f, package.encode_text(t))  # noqa: E731
    image_flops = flops_of(eager, (images,), eager.encode_image)
    text_flops = flops_of(eager, (token_ids,), eager.encode_text)
    calls = {  # name: (call, args, FLOPs)
        "encode_image": (package.encode_image, (images,), image_flops),
        "encode_text": (package.encode_text, (token_ids,), text_flops),
        "decode": (package.decode, (features, text), flops - image_flops - text_flops),
        "a new prompt against encoded images": (with_new_prompts, (features, token_ids[:1]), None),
        "these prompts against encoded images": (with_new_prompts, (features, token_ids), None),
    }
    parts = {}
    for name, (fn, args, flop) in calls.items():
        result = measure(fn, args, device, opts["warmup"], opts["iters"])
        if flop:
            result.update(flop=flop, tflop_per_s=round(flop / (result["median_ms"] * 1e-3) / 1e12, 2))
        parts[name] = result
        log.info("  %-38s median %8.2f ms", name, result["median_ms"])
    return parts


def part_wrapper(settings: Settings):
    """The model as the export stage wraps it (the build's precision recipe), whose parts bench times alone."""
    from ..model.checkpoints import load_model
    from ..model.wrapper import Sam3Grounding

    return Sam3Grounding.built_as(load_model(settings).to(settings.device), settings)


def time_part(wrapper, part, how: str, compiled: dict, device: str, opts: dict, gemm: float | None,
              memory: float | None = None) -> dict:
    """One model part (`model.part_calls.PartCall`) timed alone, "compiled" (torch.compile, CUDA graphs on the
    GPU; `compiled` keeps the compiled callables across shapes) or "eager", with its FLOPs, the bytes of the
    weights it reads and its achieved rate. With the card's GEMM rate (TFLOP/s) and memory rate (GB/s), also
    its floor: its FLOPs at the one or its weights read once at the other, whichever takes longer (a lower
    bound: activations are not counted), and the share of that floor the part reaches."""
    import torch

    mode = "reduce-overhead" if device == "cuda" else None
    runner = part.compiled(lambda fn: torch.compile(fn, mode=mode), compiled) if how == "compiled" else part
    result = measure(runner.run, (), device, max(opts["warmup"], 3), opts["iters"])
    flop, weight_bytes = flops_and_weights_of(wrapper, (), part.run)
    result.update(flop=flop, weight_bytes=weight_bytes,
                  tflop_per_s=round(flop / (result["median_ms"] * 1e-3) / 1e12, 2))
    if gemm:
        result["share_of_gemm_rate"] = round(result["tflop_per_s"] / gemm, 3)
    if gemm and memory:
        flop_ms, weights_ms = flop / (gemm * 1e9), weight_bytes / (memory * 1e6)
        floor = max(flop_ms, weights_ms)
        result.update(floor_ms=round(floor, 4), floor_of="FLOPs" if flop_ms >= weights_ms else "weights",
                      share_of_floor=round(floor / result["median_ms"], 3))
    return result


RAW_FRAME = (1080, 1920)  # what the transforms row resizes: B frames of this size (the model call starts after it)


def model_part_times(wrapper, transforms, images, token_ids, how: str, compiled: dict, device: str, opts: dict,
                     whole_ms: float | None, gemm: float | None, memory: float | None = None) -> dict:
    """Each model part at this shape alone, fed what one whole call gives it (model.part_calls), `how`
    "compiled" (torch.compile, one compile per part kept across shapes in `compiled`; CUDA graphs on the GPU)
    or "eager", with its FLOPs (FlopCounterMode on the part), weights read, achieved rate and floor
    (`time_part`). `whole_ms`, the package's own call at this shape, less the parts' sum is what runs between
    them (and what fusing across them saves). `flop` is the whole call's FLOPs as the build computes them, which
    the parts' add up to: an optimization may restructure the model's arithmetic (`pixel_decoder_per_image` adds
    some at one pair and saves more from two pairs an image on), so it can differ from the model's count, the
    row's `flop`. The package's own `transforms` is timed on B raw frames beside them (before the model call,
    not in it)."""
    import torch

    from ..model.part_calls import record_part_calls

    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)  # the recording call is a whole call: count it as it runs
    parts = _run_under(wrapper, (wrapper, images, token_ids), record_part_calls, counter)
    rows = {name: time_part(wrapper, part, how, compiled, device, opts, gemm, memory)
            for name, part in parts.items()}
    frames = torch.rand(images.shape[0], 3, *RAW_FRAME, device=images.device) * 255
    before = measure(transforms, (frames,), device, opts["warmup"], opts["iters"])
    total = round(sum(r["median_ms"] for r in rows.values()), 2)
    log.info("  model parts (%s): %s; sum %.2f ms, the package's call %s ms", how,
             ", ".join(f"{n} {r['median_ms']:.2f}" for n, r in rows.items()), total, whole_ms)
    return {"how": how, "parts": rows, "flop": counter.get_total_flops(), "transforms": before,
            "sum_ms": total, "package_ms": whole_ms,
            "between_ms": round(whole_ms - total, 2) if whole_ms is not None else None}


def flops_of(module, args, call=None) -> int:
    """FLOPs of one call of `module` (or of `call`, one of its methods), counted by torch's FlopCounterMode
    (matmuls, convolutions, attention)."""
    from torch.utils.flop_counter import FlopCounterMode

    counter = FlopCounterMode(display=False)
    _run_under(module, args, call, counter)
    return counter.get_total_flops()


def flops_and_weights_of(module, args, call=None) -> tuple[int, int]:
    """`flops_of`, and the bytes of `module`'s weights the same call reads (`weights_read`)."""
    from torch.utils.flop_counter import FlopCounterMode

    counter, reads = FlopCounterMode(display=False), weights_read(module)
    _run_under(module, args, call, counter, reads)
    return counter.get_total_flops(), reads.bytes


def _run_under(module, args, call, *modes):
    """One no_grad call of `module` (or `call`) under `modes`, its result returned. FlopCounterMode's module tracker hooks autograd,
    which no_grad tensors of parameters that require grad trip over: they are frozen for the call."""
    import contextlib

    import torch

    trainable = [p for p in module.parameters() if p.requires_grad]
    try:
        for p in trainable:
            p.requires_grad_(False)
        with torch.no_grad(), contextlib.ExitStack() as stack:
            for mode in modes:
                stack.enter_context(mode)
            return (call or module)(*args)
    finally:
        for p in trainable:
            p.requires_grad_(True)


def weights_read(module):
    """A dispatch mode that counts, in `.bytes`, the bytes of `module`'s parameters and buffers that the ops run
    under it read, each storage once (a view of a weight, its transpose or a slice, counts as all of it; of an
    embedding table, the rows looked up): what a part moves at least once per call, whatever its kernels."""
    return _weights_read_mode()(module)


@functools.lru_cache(maxsize=1)
def _weights_read_mode():  # made on first use: the stage modules import no torch at load
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_leaves

    class WeightsRead(TorchDispatchMode):
        def __init__(self, module):
            super().__init__()
            self.sizes = {t.untyped_storage().data_ptr(): t.untyped_storage().nbytes()
                          for t in (*module.parameters(), *module.buffers())}
            self.read: set[int] = set()
            self.rows: dict[int, tuple[int, set]] = {}  # embedding table -> (bytes per row, rows looked up)

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            tensors = [t for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)]
            if func is torch.ops.aten.embedding.default:  # (table, indices, ...): the table's rows it gathers
                table, indices = args[0], args[1]
                row_bytes, rows = self.rows.setdefault(table.untyped_storage().data_ptr(),
                                                       (table[0].nbytes, set()))
                rows.update(indices.unique().tolist())
                tensors = tensors[1:]
            self.read.update(p for p in (t.untyped_storage().data_ptr() for t in tensors) if p in self.sizes)
            return func(*args, **kwargs)

        @property
        def bytes(self) -> int:
            gathered = sum(row_bytes * len(rows) for ptr, (row_bytes, rows) in self.rows.items()
                           if ptr in self.sizes and ptr not in self.read)
            return sum(self.sizes[ptr] for ptr in self.read) + gathered

    return WeightsRead


def copy_gbps(iters: int = 10) -> float:
    """The card's memory rate in this run: bytes read and written by a 2 GiB device-to-device copy, median of
    `iters`, in GB/s (what a part that only streams its weights could reach)."""
    import torch

    src = torch.empty(1 << 30, dtype=torch.int16, device="cuda")
    dst = torch.empty_like(src)
    ms = statistics.median(time_calls(dst.copy_, (src,), "cuda", 3, iters))
    return round(2 * src.nbytes / (ms * 1e-3) / 1e9, 1)


def gemm_tflops(iters: int = 10) -> float:
    """The card's bf16 GEMM rate in this run: an 8192^3 product on random data, median of `iters`."""
    import torch

    a, b = (torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16) for _ in range(2))
    ms = statistics.median(time_calls(torch.matmul, (a, b), "cuda", 3, iters))
    return round(2 * 8192**3 / (ms * 1e-3) / 1e12, 1)


def profiled_kernels(fn, args, calls: int = 5) -> tuple[list[tuple[str, float]], float]:
    """Every GPU kernel of `calls` calls of `fn` (torch.profiler; copies and memsets left out) as (name, ms),
    and the calls' wall time in ms (CUDA events)."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    with torch.no_grad():
        fn(*args)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            start.record()
            for _ in range(calls):
                fn(*args)
            end.record()
            torch.cuda.synchronize()
    kernels = [(event.name, event.time_range.elapsed_us() / 1e3) for event in prof.events()
               if event.device_type == torch.autograd.DeviceType.CUDA
               and not event.name.startswith(("Memcpy", "Memset"))]
    return kernels, start.elapsed_time(end)


def kernel_breakdown(fn, args, calls: int = 5) -> dict:
    """GPU time per kernel category and launches, per call, from torch.profiler over `calls` calls."""
    kernels, wall = profiled_kernels(fn, args, calls)
    categories: dict[str, float] = {}
    for name, ms in kernels:
        lower = name.lower()
        category = next((c for c, keys in KERNEL_CATEGORIES if any(k in lower for k in keys)), "other")
        categories[category] = categories.get(category, 0.0) + ms
    per_call = {c: round(ms / calls, 2) for c, ms in sorted(categories.items(), key=lambda kv: -kv[1])}
    busy = sum(per_call.values())
    return {"kernel_ms_per_call": per_call, "launches_per_call": round(len(kernels) / calls),
            "wall_ms_per_call": round(wall / calls, 2), "gpu_idle_ms_per_call": round(max(wall / calls - busy, 0.0), 2)}


def top_kernels(fn, args, count: int, calls: int = 5) -> dict:
    """The `count` kernels that take most GPU time per call of `fn`, by name, with their launches per call."""
    kernels, wall = profiled_kernels(fn, args, calls)
    by_name: dict[str, list[float]] = {}
    for name, ms in kernels:
        by_name.setdefault(name, []).append(ms)
    ranked = sorted(by_name.items(), key=lambda kv: -sum(kv[1]))
    return {"kernel_ms_per_call": round(sum(ms for _, ms in kernels) / calls, 3),
            "launches_per_call": round(len(kernels) / calls), "wall_ms_per_call": round(wall / calls, 3),
            "top": [{"kernel": name[:160], "ms_per_call": round(sum(times) / calls, 4),
                     "launches_per_call": round(len(times) / calls, 1)} for name, times in ranked[:count]]}


# How each consumer loads a package: ours, torch's by name, and `load_pt2` as a production loader calls it.
# torch's two with their CPU vector-ISA probe on (the default) cost 20-50 s per process on the H200 before any
# byte of the package is read (README); `[bench] isa_probe_loaders = true` times them too.
TORCH_LOAD = "from torch._inductor.package import load_package\nload = lambda p: load_package(p, '{}')"
PT2_LOAD = "from torch.export.pt2_archive._package import load_pt2\nload = lambda p: load_pt2(p)"
NO_ISA_PROBE = {"TORCHINDUCTOR_VEC_ISA_OK": "0"}
OURS = "from sam3_aoti import load_package\nload = lambda p: load_package(p)"
LOADERS = {  # ours twice: the first start hashes the package, the next finds that check remembered
    "sam3_aoti load_package, first start": (OURS, {}),
    "sam3_aoti load_package, next start": (OURS, {}),
    "torch load_package model, no ISA probe": (TORCH_LOAD.format("model"), NO_ISA_PROBE),
    "load_pt2, no ISA probe": (PT2_LOAD, NO_ISA_PROBE),
}
ISA_PROBE_LOADERS = {
    "torch load_package model": (TORCH_LOAD.format("model"), {}),
    "torch load_package transforms": (TORCH_LOAD.format("transforms"), {}),
    "load_pt2": (PT2_LOAD, {}),
}
LOAD_SCRIPT = """
import json, sys, time, torch
{loader}
if sys.argv[2] == "cuda":
    torch.zeros(1, device="cuda")  # a service has its CUDA context before it loads a model
t0 = time.perf_counter()
load(sys.argv[1])
print(json.dumps(time.perf_counter() - t0))
"""


def load_seconds(package, device: str, with_isa_probe: bool) -> dict[str, float]:
    """Seconds each consumer takes to load `package`, each in a fresh process, after one read of the
    file so the page cache is warm (as on a service's second start)."""
    with open(package, "rb") as f:
        while f.read(1 << 26):
            pass
    src = str(Path(__file__).resolve().parents[2])  # this checkout's library (src/) for the first loader
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")]))}
    loaders = {**LOADERS, **(ISA_PROBE_LOADERS if with_isa_probe else {})}
    times = {}
    with tempfile.TemporaryDirectory(dir=process_folder()) as cache:  # an empty record of checked packages
        env["SAM3_AOTI_CACHE"] = cache
        for name, (loader, extra_env) in loaders.items():
            times.update(_load_in_fresh_process(name, loader, package, device, {**env, **extra_env}))
    return times


def _load_in_fresh_process(name, loader, package, device, env) -> dict[str, float]:
    proc = subprocess.run([sys.executable, "-c", LOAD_SCRIPT.format(loader=loader), str(package), device],
                          capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        log.warning("%s could not load the package: %s", name, (proc.stderr.strip().splitlines() or ["?"])[-1])
        return {}
    seconds = round(json.loads(proc.stdout.strip().splitlines()[-1]), 2)
    log.info("load: %s %.2f s", name, seconds)
    return {name: seconds}


def meta_backend(settings: Settings):
    """Meta's own SAM3 as its users run it (`sam3`, eager, bf16 autocast), on our weights; None where it
    cannot run (not importable, not the full model, not a GPU)."""
    import importlib.util

    if settings.device != "cuda" or settings.architecture != "full" or importlib.util.find_spec("sam3") is None:
        return None
    import torch

    from ..model.meta import meta_find_stage, meta_model, write_meta_checkpoint

    write_meta_checkpoint(settings)
    tf32 = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
    model = meta_model(settings)
    torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = tf32  # the other columns' settings

    def run(pixels, prompts: list[str]):
        """All B x P pairs in one grounding call, the pair order of the package (image-major), with TF32 on
        as Meta's import sets it."""
        n, p = pixels.shape[0] * len(prompts), len(prompts)
        ids = torch.arange(n, device="cuda")
        find = meta_find_stage(ids // p, ids % p)
        saved = torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32
        torch.backends.cuda.matmul.allow_tf32 = torch.backends.cudnn.allow_tf32 = True
        try:
            with torch.inference_mode(), torch.autocast("cuda", dtype=torch.bfloat16):
                backbone_out = {**model.backbone.forward_image(pixels),
                                **model.backbone.forward_text(prompts, device="cuda")}
                return model.forward_grounding(backbone_out=backbone_out, find_input=find,
                                               geometric_prompt=model._get_dummy_prompt(n), find_target=None)
        finally:
            torch.backends.cuda.matmul.allow_tf32, torch.backends.cudnn.allow_tf32 = saved

    return run


def bench_inputs(config, package, batch: int, prompts: int, device: str):
    from ..model.wrapper import example_inputs

    phrases = [PHRASES[i % len(PHRASES)] for i in range(prompts)]
    images, _ = example_inputs(config, batch, 1, seed=batch, device=device)
    return images, package.encode_prompts(phrases).to(device), phrases


def run(settings: Settings) -> None:
    import torch

    from ..model.checkpoints import eager_reference
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
    parts_how = opts.get("model_parts", "compiled")
    wrapper, compiled_parts = (part_wrapper(settings), {}) if parts_how != "off" else (None, None)
    backends = {COLUMNS[c]: fn for c, fn in
                [("transformers", eager), ("exported", exported.model), ("aoti", package.model)] if c in columns}
    graphed = None
    if cuda and "aoti_graphs" in columns:
        graphed = load_package(paths.package, cuda_graphs=True, max_graphs=len(opts["shapes"]))
        backends[COLUMNS["aoti_graphs"]] = graphed.model
    meta = meta_backend(settings) if "meta" in columns else None
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
            row["model_parts"] = model_part_times(wrapper, package.transforms, images, token_ids, parts_how,
                                                  compiled_parts, settings.device, opts,
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
            "cuda_graphs": graphed and {"captures": graphed.graph_runner.captures,
                                        "failed": graphed.graph_runner.failed}}
    write_bytes_atomic(paths.bench_plot, plot(rows, f"{settings.profile} {settings.precision} on {info['gpu'] or 'cpu'}"))
    write_report(bench_report(settings, info), paths.bench_json, paths.bench_md)
    record(paths.manifest, "bench", [paths.bench_json, paths.bench_md, paths.bench_plot], settings.fingerprint("bench"))
    log.info("table: %s", paths.bench_md)


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
    by_part = [r for r in rows if r.get("model_parts")]
    if by_part:
        names = list(by_part[0]["model_parts"]["parts"])
        how = by_part[0]["model_parts"]["how"]
        tables.append(Table(f"Where a call's time goes, by model part: each part {how} alone, fed what the whole "
                            "model gives it (ms, median)",
                            ["B", "P", f"transforms (B {RAW_FRAME[0]} × {RAW_FRAME[1]} frames, the package's, "
                             "before the call)", *names, "sum of parts", "the package's call", "between the parts"],
                            [[r["batch"], r["prompts"], r["model_parts"]["transforms"]["median_ms"],
                              *(r["model_parts"]["parts"][n]["median_ms"] for n in names),
                              r["model_parts"]["sum_ms"], dash(r["model_parts"]["package_ms"]),
                              dash(r["model_parts"]["between_ms"])] for r in by_part]))
        first = by_part[0]["model_parts"]["parts"][names[0]]
        rate = ("The same parts' GFLOP, the weights they read and their achieved TFLOP/s"
                + (" (share of the GEMM rate)" if "share_of_gemm_rate" in first else "")
                + "; the whole call's GFLOP as the build computes them, which the parts' add up to, beside the "
                "model's count (the latency table's; optimizations may restructure the arithmetic)")
        tables.append(Table(rate, ["B", "P", *names, "whole call, the build's GFLOP", "the model's GFLOP"],
                            [[r["batch"], r["prompts"], *(part_rate(r["model_parts"]["parts"][n]) for n in names),
                              f"{r['model_parts']['flop'] / 1e9:.4g}", f"{r['flop'] / 1e9:.4g}"] for r in by_part]))
        if "floor_ms" in first:
            tables.append(Table("The same parts against their floor: their FLOPs at the GEMM rate or their weights "
                                "read once at the copy rate, whichever takes longer (a lower bound: activations "
                                "are not counted); ms, and the share of it each part reaches",
                                ["B", "P", *names],
                                [[r["batch"], r["prompts"], *(part_floor(r["model_parts"]["parts"][n]) for n in names)]
                                 for r in by_part]))
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
    if settings.spec.reference != settings.precision:
        notes.append(f"An {settings.precision} build: 'transformers eager' is the {settings.spec.reference} model "
                     "(verify's reference), and FLOPs are its.")
    return Report(f"Bench: {settings.profile} on {info['gpu'] or 'cpu'} ({settings.precision})", notes, None, tables,
                  [("bench.png", "median ms per call")], data=info)


def dash(value):
    return "-" if value is None else value


def part_rate(part: dict) -> str:
    share = f" ({part['share_of_gemm_rate']:.0%})" if "share_of_gemm_rate" in part else ""
    return f"{part['flop'] / 1e9:.4g} GFLOP, {part['weight_bytes'] / 1e6:.4g} MB, {part['tflop_per_s']}{share}"


def part_floor(part: dict) -> str:
    return f"{part['floor_ms']:.3g} ({part['floor_of']}), {part['share_of_floor']:.0%}"


def plot(rows: list[dict], title: str) -> bytes:
    """Grouped bars, one group per (B, P), one bar per backend; below them, where the rows have it, one stacked
    bar per (B, P) of the model parts' ms. A PNG (PIL: no plotting dependency)."""
    import io

    from PIL import Image, ImageDraw

    names = list(rows[0]["backends"]) if rows else []
    by_part = [r for r in rows if r.get("model_parts")]
    colors = ["#7f7f7f", "#bcbd22", "#1f77b4", "#ff7f0e", "#2ca02c", "#d62728", "#9467bd", "#8c564b"]
    width, panel, left, bottom, top = 900, 420, 60, 50, 40
    image = Image.new("RGB", (width, panel * (2 if by_part else 1)), "white")
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
    if by_part:
        parts = list(by_part[0]["model_parts"]["parts"])
        base = 2 * panel
        draw.text((left, panel + 10), f"by model part ({by_part[0]['model_parts']['how']} alone): median ms, "
                                      "stacked; the line: the package's call", fill="black")
        peak = max(max(r["model_parts"]["sum_ms"], r["model_parts"]["package_ms"] or 0) for r in by_part) or 1.0
        group = (width - left - 20) / len(by_part)
        scale = (panel - bottom - top) / peak
        for gi, r in enumerate(by_part):
            x0, y = left + gi * group + group * 0.3, base - bottom
            for pi, name in enumerate(parts):
                h = r["model_parts"]["parts"][name]["median_ms"] * scale
                draw.rectangle([x0, y - h, x0 + group * 0.4, y], fill=colors[pi % len(colors)])
                y -= h
            if r["model_parts"]["package_ms"]:
                line = base - bottom - r["model_parts"]["package_ms"] * scale
                draw.line([x0 - 6, line, x0 + group * 0.4 + 6, line], fill="black", width=2)
            draw.text((x0, base - bottom + 5), f"B={r['batch']} P={r['prompts']}", fill="black")
        legend(draw, parts, colors, left, base - 20, step=115)
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
