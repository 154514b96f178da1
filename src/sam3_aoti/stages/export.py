"""Stage `export`: torch.export the grounding model and the image transforms, with dynamic batch/prompts
(and for the profiles `[export] split` names, the model's parts: encode_image, encode_text, decode).

The exported programs are re-run at a (B, P) other than the trace example before the stage succeeds:
one specialization only shows up at run time.
"""

from __future__ import annotations

import hashlib
import json
import logging
import time
import zipfile
from pathlib import Path

from ..errors import ExportError
from ..model.exporting import (TENSOR_FILES, check_against_eager, composed, composed_with_boxes, example_boxes,
                               export_programs, is_tensor_config, save_programs, transforms_example)
from ..pipeline.artifacts import check_free_space, record
from ..pipeline.paths import ProfilePaths
from ..pipeline.settings import Settings
from ..runtime.archive import archive_entries
from ..runtime.files import atomic_output, human_size, write_text_atomic

log = logging.getLogger(__spec__.name)  # not __name__: run by `python -m`, a stage is "__main__"


def run(settings: Settings) -> None:
    import torch

    from ..model.checkpoints import load_model
    from ..model.configs import example_inputs
    from ..model.grounding import ImageTransforms, Sam3Grounding

    paths, opts = ProfilePaths.of(settings), settings.stage("export")
    checkpoint = paths.checkpoint / "model.safetensors"
    if checkpoint.is_file():  # the archive holds the weights once more, in the build's dtype at most fp32
        check_free_space({paths.exported.parent: int(1.1 * checkpoint.stat().st_size) + (64 << 20)}, "export")
    device = torch.device(settings.device)
    if settings.spec.fp8_parts:
        from ..model.fp8 import check_fp8_device

        if reason := check_fp8_device(device):
            raise ExportError(f"precision={settings.precision}: {reason}; build precision=bf16 on this machine")
    model = load_model(settings).to(device)
    config = model.config
    wrapper = Sam3Grounding.built_as(model, settings)
    atol = settings.spec.export_atol

    example = example_inputs(config, opts["example_batch"], opts["example_prompts"], device=device)
    log.info("exporting model at example (B, P) = (%d, %d)", *(a.shape[0] for a in example))
    split = settings.profile in opts.get("split", [])
    image_size = config.vision_config.backbone_config.image_size
    transforms = ImageTransforms(image_size).eval()
    programs, seconds = export_programs(wrapper, example, split, transforms, transforms_example(opts, device))
    log.info("model exported in %.1f s", seconds["model"])
    if split:
        log.info("encode_image, encode_text, encode_boxes and decode exported in %.1f s", seconds["parts"])
    # Each program's module made once for every check (unlifting a graph is seconds).
    model_run = programs["model"].module()
    parts_run, boxes_run = (composed(programs), composed_with_boxes(programs)) if split else (None, None)
    for b, p in [(opts["check_batch"], opts["check_prompts"]), (1, 1)]:
        args = example_inputs(config, b, p, seed=1, device=device)
        diff = check_against_eager("model", model_run, wrapper, args, atol)
        log.info("re-run at (B, P) = (%d, %d): max |exported - eager| = %.3g", b, p, diff)
        if split:
            diff = check_against_eager("decode(encode_image, encode_text)", parts_run, wrapper, args, atol)
            log.info("re-run of the parts at (B, P) = (%d, %d): max |exported - eager| = %.3g", b, p, diff)
            for count in (1, 5):  # exemplar boxes: one, and more than the trace's
                boxes = example_boxes(b, count, seed=count, device=device)
                diff = check_against_eager("decode with encode_boxes", boxes_run, wrapper.with_boxes,
                                           (*args, *boxes), atol)
                log.info("re-run with %d exemplar boxes at (B, P) = (%d, %d): max |exported - eager| = %.3g", count,
                         b, p, diff)
    check_image = (torch.rand(1, 3, 97, 150, generator=torch.Generator().manual_seed(1)) * 255).to(device)
    check_against_eager("transforms", programs["transforms"].module(), transforms, (check_image,), 1e-5)

    with atomic_output(paths.exported) as tmp:
        save_programs(programs, tmp)
    log.info("saved %s (%s)", paths.exported, human_size(paths.exported.stat().st_size))
    digest = program_digest(paths.exported, programs)
    changed = write_if_changed(paths.program_digest, json.dumps(digest, indent=2, sort_keys=True) + "\n")
    log.info("program digest %s (%s)", digest["sha256"][:12],
             "changed: compile reruns" if changed else "unchanged: the compiled code is reused")
    record(paths.manifest, "export", [paths.exported, paths.program_digest], {
        "export_seconds": round(seconds["model"], 2), "image_size": image_size, **settings.fingerprint("export"),
    })


# Archive entries that hold values (weights, lifted constants, sample inputs) or a random id: the
# compiled code does not depend on them, so the program digest leaves them out.
VALUE_ENTRIES = (*TENSOR_FILES, "data/sample_inputs/", ".data/serialization_id")


def program_digest(archive: Path, programs: dict) -> dict:
    """Everything AOTInductor's output depends on, and nothing it does not: the serialized graphs,
    signatures, dynamic ranges and weight layouts (dtype, shape, stride, offset), plus the example shapes
    it tunes for. A new seed or checkpoint of the same architecture gives the same digest."""
    h = hashlib.sha256()
    with zipfile.ZipFile(archive) as zf:
        for inner, name in sorted(archive_entries(zf).items()):
            if not inner.startswith(VALUE_ENTRIES):
                h.update(inner.encode() + b"\0" + layout_only(inner, zf.read(name)) + b"\0")
    signature = {name: io_signature(program) for name, program in programs.items()}
    h.update(json.dumps(signature, sort_keys=True).encode())
    return {"sha256": h.hexdigest(), "programs": signature}


def layout_only(inner: str, data: bytes) -> bytes:
    """A tensor config without its files' names: which file holds a tensor's bytes depends on the values
    (equal tensors share one, `shared_tensor_writer`), its layout does not."""
    if not is_tensor_config(inner):
        return data
    payload = json.loads(data)
    for meta in payload["config"].values():
        meta.pop("path_name", None)
    return json.dumps(payload, sort_keys=True).encode()


def io_signature(program) -> dict:
    """Input and output shapes and dtypes at the trace example (the metadata of the package)."""
    import torch

    args, _ = program.example_inputs
    with torch.no_grad():
        outputs = program.module()(*args)
    outputs = (outputs,) if torch.is_tensor(outputs) else outputs
    described = [{"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")} for t in outputs]
    return {"example_inputs": [{"shape": list(a.shape), "dtype": str(a.dtype).removeprefix("torch.")} for a in args],
            "outputs": described}


def write_if_changed(path: Path, text: str) -> bool:
    """Leave an equal file untouched, so its consumers see no change at all (early cutoff)."""
    if path.exists() and path.read_text() == text:
        return False
    write_text_atomic(path, text)
    return True


if __name__ == "__main__":
    from ..pipeline.runner import main

    main("export", run, __doc__.splitlines()[0])
