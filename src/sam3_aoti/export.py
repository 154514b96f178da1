"""Stage `export`: torch.export the grounding model and the image transforms, with dynamic batch/prompts.

The exported programs are re-run at a (B, P) other than the trace example before the stage succeeds:
one specialization only shows up at run time.
"""

from __future__ import annotations

import logging
import time

from .artifacts import atomic_output, human_size, record
from .config import Settings
from .errors import ExportError, first_line
from .paths import ProfilePaths

log = logging.getLogger("sam3_aoti")


def export_model(wrapper, example_args, batch_name="batch", prompts_name="num_prompts"):
    import torch
    from torch.export import Dim

    dynamic = {"images": {0: Dim(batch_name, min=1)}, "token_ids": {0: Dim(prompts_name, min=1)}}
    with torch.no_grad():
        return torch.export.export(wrapper, example_args, dynamic_shapes=dynamic)


def export_transforms(module, example_image):
    import torch
    from torch.export import Dim

    dynamic = {"images": {0: Dim("batch", min=1), 2: Dim("height", min=2), 3: Dim("width", min=2)}}
    with torch.no_grad():
        return torch.export.export(module, (example_image,), dynamic_shapes=dynamic)


def check_against_eager(name: str, program, eager, args, atol: float) -> float:
    """Run the exported program at new shapes; it must run and agree with eager."""
    import torch

    with torch.no_grad():
        try:
            got = program.module()(*args)
        except Exception as e:
            shapes = [tuple(a.shape) for a in args]
            raise ExportError(f"exported {name} fails at input shapes {shapes}: {first_line(e)}") from None
        want = eager(*args)
    got, want = (got,) if torch.is_tensor(got) else got, (want,) if torch.is_tensor(want) else want
    worst = max((g.float() - w.float()).abs().max().item() for g, w in zip(got, want))
    if not worst <= atol:
        raise ExportError(f"exported {name} drifts from eager by {worst:.3g} (> {atol}) at shapes "
                          f"{[tuple(a.shape) for a in args]}: the export changed the model's behaviour")
    return worst


def run(settings: Settings) -> None:
    import torch

    from .model import DTYPES, ImageTransforms, Sam3Grounding, example_inputs
    from .weights import load_model

    paths, opts = ProfilePaths.of(settings), settings.stage("export")
    device = torch.device(settings.device)
    model = load_model(settings).to(device)
    config = model.config
    wrapper = Sam3Grounding(model, DTYPES[settings.precision]).eval()
    atol = 1e-4 if settings.precision == "fp32" else 5e-2

    example = example_inputs(config, opts["example_batch"], opts["example_prompts"], device=device)
    log.info("exporting model at example (B, P) = (%d, %d)", *(a.shape[0] for a in example))
    t0 = time.perf_counter()
    try:
        model_ep = export_model(wrapper, example)
    except Exception as e:
        raise ExportError(f"torch.export of the SAM3 wrapper failed: {first_line(e)}") from None
    export_s = time.perf_counter() - t0
    log.info("model exported in %.1f s", export_s)
    for b, p in [(opts["check_batch"], opts["check_prompts"]), (1, 1)]:
        diff = check_against_eager("model", model_ep, wrapper, example_inputs(config, b, p, seed=1, device=device), atol)
        log.info("re-run at (B, P) = (%d, %d): max |exported - eager| = %.3g", b, p, diff)

    image_size = config.vision_config.backbone_config.image_size
    transforms = ImageTransforms(image_size).eval()
    example_image = torch.rand(*opts["transforms_example_size"], device=device) * 255
    try:
        transforms_ep = export_transforms(transforms, example_image)
    except Exception as e:
        raise ExportError(f"torch.export of the image transforms failed: {first_line(e)}") from None
    check_image = torch.rand(1, 3, 97, 150, device=device) * 255
    check_against_eager("transforms", transforms_ep, transforms, (check_image,), 1e-5)

    for program, target in [(model_ep, paths.exported_model), (transforms_ep, paths.exported_transforms)]:
        with atomic_output(target) as tmp:
            torch.export.save(program, tmp)
        log.info("saved %s (%s)", target, human_size(target.stat().st_size))
    record(paths.manifest, "export", [paths.exported_model, paths.exported_transforms], {
        "export_seconds": round(export_s, 2), "image_size": image_size, **settings.fingerprint("export"),
    })


if __name__ == "__main__":
    from .stage import main

    main("export", run, __doc__.splitlines()[0])
