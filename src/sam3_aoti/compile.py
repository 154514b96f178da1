"""Stage `compile`: AOTInductor-compile both exported programs into one PT2 archive with metadata."""

from __future__ import annotations

import logging
import os
import platform
import time

from .artifacts import atomic_output, human_size, record, sha256
from .config import Settings
from .errors import CompileError, first_line
from .paths import ProfilePaths

log = logging.getLogger("sam3_aoti")


def aoti_compile(program, options: dict) -> list:
    """AOTInductor files for one exported program, ready for `package_pt2`."""
    import torch

    try:
        gm = program.module(check_guards=False)
    except TypeError:  # torch 2.10 has no check_guards
        gm = program.module()
    args, kwargs = program.example_inputs
    return torch._inductor.aot_compile(gm, args, kwargs, options={**options, "aot_inductor.package": True})


def platform_info(device: str) -> dict:
    import torch

    info = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "machine": platform.machine(),
    }
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, compute_capability=f"{props.major}.{props.minor}")
    return info


def build_metadata(settings: Settings, exported_model, paths: ProfilePaths, inductor: dict) -> dict:
    import transformers

    from .model import IMAGE_MEAN, IMAGE_STD, OUTPUT_NAMES
    from .tokenizer import CONTEXT_LENGTH, END, PAD, START

    images, token_ids = exported_model.example_inputs[0]
    outputs = exported_model.module()(images, token_ids)
    n = images.shape[0] * token_ids.shape[0]
    return {
        "format": "sam3-aoti/1",
        "profile": settings.profile,
        "weights": settings.weights,
        "random_weights": settings.weights == "random",
        "precision": settings.precision,
        "device": settings.device,
        "models": {
            "model": {
                "inputs": {
                    "images": {"shape": ["batch", 3, images.shape[2], images.shape[3]], "dtype": "float32"},
                    "token_ids": {"shape": ["num_prompts", CONTEXT_LENGTH], "dtype": "int64"},
                },
                "outputs": {
                    name: {"shape": ["batch*num_prompts", *o.shape[1:]], "dtype": str(o.dtype).removeprefix("torch.")}
                    for name, o in zip(OUTPUT_NAMES, outputs) if n == o.shape[0]
                },
                "output_order": list(OUTPUT_NAMES),  # the runner returns a tuple; json sorts the dict above
                "dynamic_dims": {"batch": {"min": 1}, "num_prompts": {"min": 1}},
                "pairing": "pair i = (image i // num_prompts, prompt i % num_prompts)",
            },
            "transforms": {
                "inputs": {"images": {"shape": ["batch", 3, "height", "width"], "dtype": "float32", "range": [0, 255]}},
                "outputs": {"images": {"shape": ["batch", 3, images.shape[2], images.shape[3]], "dtype": "float32"}},
                "normalize": {"mean": IMAGE_MEAN, "std": IMAGE_STD, "after_scale": 1 / 255},
                "resize": "bilinear, antialias",
            },
        },
        "box_format": "cxcywh, normalized to [0, 1]",
        "mask_format": "logits; > 0 is foreground",
        "score": "sigmoid(pred_logits) * sigmoid(presence_logit_dec)",
        "tokenizer": {"start": START, "end": END, "pad": PAD, "context_length": CONTEXT_LENGTH,
                      "vocab_file": "tokenizer/bpe_simple_vocab_16e6.txt", "attention_mask": "token_ids != 0"},
        "versions": {**platform_info(settings.device), "transformers": transformers.__version__},
        "inductor_options": inductor,
        "toolchain": {k: os.environ.get(k) for k in ("CUDA_HOME", "CXX", "SAM3_AOTI_TOOLCHAIN_FIX")},
        "inputs_sha256": {
            "checkpoint": sha256(paths.checkpoint / "model.safetensors"),
            "exported_model": sha256(paths.exported_model),
            "exported_transforms": sha256(paths.exported_transforms),
        },
    }


def run(settings: Settings) -> None:
    import torch

    from .package import load_package, write_package

    paths = ProfilePaths.of(settings)
    inductor = dict(settings.stage("compile").get("inductor", {}))
    exported = {"model": torch.export.load(paths.exported_model), "transforms": torch.export.load(paths.exported_transforms)}
    aoti_files, seconds = {}, {}
    for name, program in exported.items():
        log.info("AOTInductor compiling %s on %s (this is the slow part)", name, settings.device)
        t0 = time.perf_counter()
        try:
            aoti_files[name] = aoti_compile(program, inductor)
        except Exception as e:
            raise CompileError(f"AOTInductor failed on {name}: {first_line(e)} "
                               "(run `uv run doit toolchain` to check the compiler setup)") from None
        seconds[name] = round(time.perf_counter() - t0, 1)
        log.info("compiled %s in %.1f s", name, seconds[name])

    metadata = build_metadata(settings, exported["model"], paths, inductor)
    with atomic_output(paths.package) as tmp:
        write_package(tmp, exported, aoti_files, metadata, paths.tokenizer_merges.read_text())
        package = load_package(tmp)  # a package that does not load is not a package
        if set(package.backends.values()) != {"aoti"}:
            raise CompileError(f"the fresh package's AOTI models do not load ({package.fallback_reason})")
    size = paths.package.stat().st_size
    log.info("package %s (%s)", paths.package, human_size(size))
    record(paths.manifest, "compile", [paths.package], {
        "compile_seconds": seconds, **settings.fingerprint("compile"),
    })


if __name__ == "__main__":
    from .stage import main

    main("compile", run, __doc__.splitlines()[0])
