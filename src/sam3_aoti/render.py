"""Stage `render`: one PNG per case, eager beside AOTI, so a person can judge the package at a glance."""

from __future__ import annotations

import logging

from .artifacts import atomic_output, record, write_text_atomic
from .config import Settings
from .paths import ProfilePaths

log = logging.getLogger("sam3_aoti")


def side_by_side(left, right):
    from PIL import Image

    sheet = Image.new("RGB", (left.width + right.width + 8, max(left.height, right.height)), (255, 255, 255))
    sheet.paste(left, (0, 0))
    sheet.paste(right, (left.width + 8, 0))
    return sheet


def run(settings: Settings) -> None:
    import torch

    from .cases import load_cases
    from .model import DTYPES, ImageTransforms, Sam3Grounding
    from .package import load_package
    from .postprocess import instances, overlay, to_tensor
    from .weights import load_model

    paths, opts = ProfilePaths.of(settings), settings.stage("render")
    package = load_package(paths.package)
    eager = Sam3Grounding(load_model(settings).to(settings.device), DTYPES[settings.precision]).eval()
    transforms = ImageTransforms(eager.model.config.vision_config.backbone_config.image_size)
    threshold, top_k = opts["score_threshold"], opts["max_instances"]
    random_note = " (random weights)" if settings.weights == "random" else ""
    lines = [f"# Render: {settings.profile}{random_note}", "",
             f"Left: eager transformers; right: AOTI package ({package.backends['model']}). "
             f"Instances with score >= {threshold}, else the best {top_k}.", ""]
    outputs = []
    with atomic_output(paths.render_dir) as tmp, torch.no_grad():
        tmp.mkdir()
        for case in load_cases():
            image = case.load_image()
            x = to_tensor(image, settings.device)
            token_ids = package.encode_prompts(list(case.prompts)).to(settings.device)
            panels = []
            for label, run_model, images in [("eager", eager, transforms(x)), ("AOTI", package.model, package.transforms(x))]:
                out = run_model(images, token_ids)
                found = instances(out, list(case.prompts), image.shape[:2], threshold=threshold)
                if not found:
                    found = instances(out, list(case.prompts), image.shape[:2], top_k=1)[:top_k]
                panels.append(overlay(image, found[:top_k], f"{label}: " + ", ".join(case.prompts)))
            name = f"{case.name}.png"
            side_by_side(*panels).save(tmp / name)
            outputs.append(paths.render_dir / name)
            lines.append(f"## {case.name}: {', '.join(case.prompts)}\n\n![{case.name}]({name})\n")
            log.info("rendered %s", name)
        (tmp / "index.md").write_text("\n".join(lines))
    record(paths.manifest, "render", [paths.render_dir], settings.fingerprint("render"))
    log.info("pictures: %s", paths.render_dir)


if __name__ == "__main__":
    from .stage import main

    main("render", run, __doc__.splitlines()[0])
