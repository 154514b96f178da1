"""A package's parts and the model's sections timed alone, with their FLOPs, weights read, rates and floors."""

from __future__ import annotations

import logging

from .counts import flop_counter, flops_and_weights_of, flops_of, run_under
from .rates import floor
from .timing import measure

log = logging.getLogger(__name__)

EXEMPLAR_BOXES = 4  # the boxes per image of bench's exemplar rows


def part_times(package, eager, images, token_ids, flops: int, device: str, opts: dict) -> dict:
    """A split package's parts timed alone at this shape, with their FLOPs (counted on eager's own parts; the
    heads' are the whole call's less the encoders'), and encode once / decode many: one more prompt, and
    this row's prompts, encoded and decoded against images encoded before; and with exemplar boxes
    (EXEMPLAR_BOXES per image, beside the phrases): the whole call, on a GPU also the other way (the parts one by
    one where the package's call is the split call, else the split call), and a new exemplar set against encoded
    images and prompts (encode_boxes and decode)."""
    import torch

    from ..model.exporting import example_boxes

    features, text = package.encode_image(images), package.encode_text(token_ids)
    # model_with_boxes is the split call where the package uses it: the other way is then the parts one by one
    other_way, other = (("the same, the parts one by one", package.parts_one_by_one) if package.split_call else
                        ("the same in one call, the text beside", package["model_with_boxes"]))
    with_new_prompts = lambda f, t: package.decode(f, package.encode_text(t))  # noqa: E731
    with_new_boxes = lambda f, t, b, l: package.decode(f, t, package.encode_boxes(f, b, l))  # noqa: E731
    boxes, _ = example_boxes(images.shape[0], EXEMPLAR_BOXES, device=images.device)
    labels = torch.ones(boxes.shape[:2], dtype=torch.long, device=images.device)
    image_flops = flops_of(eager, (images,), eager.encode_image)
    text_flops = flops_of(eager, (token_ids,), eager.encode_text)
    calls = {  # name: (call, args, FLOPs)
        "encode_image": (package.encode_image, (images,), image_flops),
        "encode_text": (package.encode_text, (token_ids,), text_flops),
        "decode": (package.decode, (features, text), flops - image_flops - text_flops),
        "a new prompt against encoded images": (with_new_prompts, (features, token_ids[:1]), None),
        "these prompts against encoded images": (with_new_prompts, (features, token_ids), None),
        f"the whole call with {EXEMPLAR_BOXES} exemplar boxes": (package.model_with_boxes,
                                                                (images, token_ids, boxes, labels), None),
        **({other_way: (other, (images, token_ids, boxes, labels), None)} if device == "cuda" else {}),
        f"a new set of {EXEMPLAR_BOXES} boxes against encoded images and prompts": (with_new_boxes,
                                                                                   (features, text, boxes, labels),
                                                                                   None),
    }
    parts = {}
    for name, (fn, args, flop) in calls.items():
        result = measure(fn, args, device, opts["warmup"], opts["iters"])
        if flop:
            result.update(flop=flop, tflop_per_s=round(flop / (result["median_ms"] * 1e-3) / 1e12, 2))
        parts[name] = result
        log.info("  %-38s median %8.2f ms", name, result["median_ms"])
    return parts


def time_section(wrapper, section, how: str, compiled: dict, device: str, opts: dict, gemm: float | None,
                 memory: float | None = None) -> dict:
    """One section (`model.section_calls.SectionCall`) timed alone, "compiled" (torch.compile, CUDA graphs on the
    GPU; `compiled` keeps the compiled callables across shapes) or "eager", with its FLOPs, the bytes of the
    weights it reads and its achieved rate. With the card's GEMM rate (TFLOP/s) and memory rate (GB/s), also
    its floor: its FLOPs at the one or its weights read once at the other, whichever takes longer (a lower
    bound: activations are not counted), and the share of that floor the section reaches."""
    import torch

    mode = "reduce-overhead" if device == "cuda" else None
    runner = section.compiled(lambda fn: torch.compile(fn, mode=mode), compiled) if how == "compiled" else section
    result = measure(runner.run, (), device, max(opts["warmup"], 3), opts["iters"])
    flop, weight_bytes = flops_and_weights_of(wrapper, (), section.run)
    result.update(flop=flop, weight_bytes=weight_bytes,
                  tflop_per_s=round(flop / (result["median_ms"] * 1e-3) / 1e12, 2))
    if gemm:
        result["share_of_gemm_rate"] = round(result["tflop_per_s"] / gemm, 3)
    if gemm and memory:
        result.update(floor(flop, weight_bytes, gemm, memory))
        result["share_of_floor"] = round(result["floor_ms"] / result["median_ms"], 3)
    return result


RAW_FRAME = (1080, 1920)  # what the transforms row resizes: B frames of this size (the model call starts after it)


def section_times(wrapper, transforms, images, token_ids, how: str, compiled: dict, device: str, opts: dict,
                  whole_ms: float | None, gemm: float | None, memory: float | None = None) -> dict:
    """Each section at this shape alone, fed what one whole call gives it (model.section_calls), `how`
    "compiled" (torch.compile, one compile per section kept across shapes in `compiled`; CUDA graphs on the GPU)
    or "eager", with its FLOPs (FlopCounterMode on the section), weights read, achieved rate and floor
    (`time_section`). `whole_ms`, the package's own call at this shape, less the sections' sum is what runs between
    them (and what fusing across them saves). `flop` is the whole call's FLOPs as the build computes them, which
    the sections' add up to: an optimization may restructure the model's arithmetic (`pixel_decoder_per_image` adds
    some at one pair and saves more from two pairs an image on), so it can differ from the model's count, the
    row's `flop`. The package's own `transforms` is timed on B raw frames beside them (before the model call,
    not in it)."""
    import torch

    from ..model.section_calls import record_section_calls

    counter = flop_counter()  # the recording call is a whole call: count it as it runs
    sections = run_under(wrapper, (wrapper, images, token_ids), record_section_calls, counter)
    rows = {name: time_section(wrapper, section, how, compiled, device, opts, gemm, memory)
            for name, section in sections.items()}
    frames = torch.rand(images.shape[0], 3, *RAW_FRAME, device=images.device) * 255
    before = measure(transforms, (frames,), device, opts["warmup"], opts["iters"])
    total = round(sum(r["median_ms"] for r in rows.values()), 2)
    log.info("  sections (%s): %s; sum %.2f ms, the package's call %s ms", how,
             ", ".join(f"{n} {r['median_ms']:.2f}" for n, r in rows.items()), total, whole_ms)
    return {"how": how, "sections": rows, "flop": counter.get_total_flops(), "transforms": before,
            "sum_ms": total, "package_ms": whole_ms,
            "between_ms": round(whole_ms - total, 2) if whole_ms is not None else None}


def section_rate(section: dict) -> str:
    """A timed section's GFLOP, weights read and achieved TFLOP/s (share of the GEMM rate), for a table cell."""
    share = f" ({section['share_of_gemm_rate']:.0%})" if "share_of_gemm_rate" in section else ""
    return f"{section['flop'] / 1e9:.4g} GFLOP, {section['weight_bytes'] / 1e6:.4g} MB, {section['tflop_per_s']}{share}"


def section_floor(section: dict) -> str:
    """A timed section's floor in ms, what sets it, and the share of it the section reaches, for a table cell."""
    return f"{section['floor_ms']:.3g} ({section['floor_of']}), {section['share_of_floor']:.0%}"
