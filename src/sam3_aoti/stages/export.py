"""Stage `export`: torch.export the grounding model and the image transforms, with dynamic batch/prompts.

The model's parts (encode_image, encode_text, encode_boxes, decode) are the `export_parts` stage's, which runs
beside this model's compile: the longest compile of the build starts as soon as its own program is saved.
The exported programs are re-run at a (B, P) other than the trace example before the stage succeeds:
one specialization only shows up at run time.
"""

from __future__ import annotations

import logging

from ..model.exporting import check_against_eager, export_programs, export_subject, save_with_digest, transforms_example
from ..pipeline.artifacts import record
from ..pipeline.paths import ProfilePaths
from ..pipeline.settings import Settings

log = logging.getLogger(__spec__.name)  # not __name__: run by `python -m`, a stage is "__main__"


def run(settings: Settings) -> None:
    import torch

    from ..model.configs import example_inputs
    from ..model.grounding import ImageTransforms

    paths, opts = ProfilePaths.of(settings), settings.stage("export")
    wrapper, example, device = export_subject(settings, "export")
    config = wrapper.model.config
    log.info("exporting model at example (B, P) = (%d, %d)", *(a.shape[0] for a in example))
    image_size = config.vision_config.backbone_config.image_size
    transforms = ImageTransforms(image_size).eval()
    programs, seconds = export_programs(wrapper, example, False, transforms, transforms_example(opts, device))
    log.info("model exported in %.1f s", seconds["model"])
    model_run = programs["model"].module()  # made once for both checks (unlifting a graph is seconds)
    for b, p in [(opts["check_batch"], opts["check_prompts"]), (1, 1)]:
        args = example_inputs(config, b, p, seed=1, device=device)
        diff = check_against_eager("model", model_run, wrapper, args, settings.spec.export_atol)
        log.info("re-run at (B, P) = (%d, %d): max |exported - eager| = %.3g", b, p, diff)
    check_image = (torch.rand(1, 3, 97, 150, generator=torch.Generator().manual_seed(1)) * 255).to(device)
    check_against_eager("transforms", programs["transforms"].module(), transforms, (check_image,), 1e-5)
    save_with_digest(programs, paths.exported, paths.program_digest, log)
    record(paths.manifest, "export", [paths.exported, paths.program_digest], {
        "export_seconds": round(seconds["model"], 2), "image_size": image_size, **settings.fingerprint("export"),
    })


if __name__ == "__main__":
    from ..pipeline.runner import main

    main("export", run, __doc__.splitlines()[0])
