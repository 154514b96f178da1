"""Stage `render`: one PNG per case, eager beside AOTI, so a person can judge the package at a glance."""

from __future__ import annotations

import functools
import logging

from ..pipeline.artifacts import record
from ..pipeline.paths import ProfilePaths
from ..pipeline.settings import Settings
from ..runtime.files import atomic_output

log = logging.getLogger(__spec__.name)  # not __name__: run by `python -m`, a stage is "__main__"


def side_by_side(left, right):
    from PIL import Image

    sheet = Image.new("RGB", (left.width + right.width + 8, max(left.height, right.height)), (255, 255, 255))
    sheet.paste(left, (0, 0))
    sheet.paste(right, (left.width + 8, 0))
    return sheet


def diff_heatmap(candidate_logits, reference_logits, title: str):
    """|sigmoid(AOTI) - sigmoid(eager)| of one mask, scaled to its own maximum (printed in the title)."""
    import numpy as np
    from PIL import Image, ImageDraw

    diff = (candidate_logits.float().sigmoid() - reference_logits.float().sigmoid()).abs().cpu().numpy()
    peak = float(diff.max())
    level = (diff / peak if peak > 0 else diff) * 255
    rgb = np.stack([level, level * 0.3, 255 - level], axis=-1).astype(np.uint8)  # blue = equal, red = peak
    picture = Image.fromarray(rgb).resize((288, 288), Image.NEAREST)
    draw = ImageDraw.Draw(picture)
    draw.rectangle((0, 0, 288, 14), fill=(0, 0, 0))
    draw.text((3, 1), f"{title}: max {peak:.2e}", fill=(255, 255, 255))
    return picture


def score_scatter(points: list[tuple[float, float]], size: int = 420):
    """AOTI score against eager score for every query of every case: all dots on the diagonal is the goal."""
    from PIL import Image, ImageDraw

    margin = 40
    picture = Image.new("RGB", (size, size), (255, 255, 255))
    draw = ImageDraw.Draw(picture)
    lo, hi = margin, size - margin
    draw.rectangle((lo, lo, hi, hi), outline=(0, 0, 0))
    draw.line((lo, hi, hi, lo), fill=(180, 180, 180))
    scale = lambda v: lo + v * (hi - lo)
    for x, y in points:
        px, py = scale(x), hi - (scale(y) - lo)
        draw.ellipse((px - 2, py - 2, px + 2, py + 2), fill=(0, 90, 200))
    worst = max((abs(x - y) for x, y in points), default=0.0)
    draw.text((lo, 8), f"score: AOTI (y) vs eager (x), {len(points)} queries, max |diff| {worst:.2e}", fill=(0, 0, 0))
    draw.text((lo, hi + 8), "0", fill=(0, 0, 0))
    draw.text((hi - 6, hi + 8), "1", fill=(0, 0, 0))
    return picture


def run(settings: Settings) -> None:
    import torch

    from ..model.checkpoints import eager_reference, reference_transforms
    from ..model.reference import ReferenceCache
    from ..pipeline.cases import load_cases
    from ..runtime.loader import load_package
    from ..runtime.postprocess import instances, overlay, scores, to_tensor

    paths, opts = ProfilePaths.of(settings), settings.stage("render")
    cases = load_cases()
    package = load_package(paths.package)
    transforms = reference_transforms(settings)
    eager = functools.cache(lambda: eager_reference(settings)[0])  # loaded only if the reference cache lacks a case
    cache = ReferenceCache.of(settings)  # the reference stage computed eager on these very inputs: drawn from disk
    cached_eager = lambda images, token_ids: cache.get((images, token_ids), lambda *a: eager()(*a))  # noqa: E731
    threshold, top_k = opts["score_threshold"], opts["max_instances"]
    random_note = " (random weights)" if settings.weights == "random" else ""
    lines = [f"# Render: {settings.profile}{random_note}", "",
             f"Left: eager transformers; right: AOTI package ({package.backends['model']}). "
             f"Instances with score >= {threshold}, else the best {top_k}.", ""]
    points = []
    with atomic_output(paths.render_dir) as tmp, torch.no_grad():
        tmp.mkdir()
        for case in cases:
            image = case.load_image()
            x = to_tensor(image, settings.device)
            token_ids = package.encode_prompts(list(case.prompts)).to(settings.device)
            boxes = (tuple(t.to(settings.device) for t in case.exemplars(image.shape[1], image.shape[0]))
                     if case.boxes else ())
            models = [("eager", cached_eager, transforms(x)), ("AOTI", package.model, package.transforms(x))]
            if boxes:  # through the parts, with the case's exemplar boxes
                models = [("eager", lambda i, t: cache.get((i, t, *boxes), lambda *a: eager().with_boxes(*a)),
                           transforms(x)), ("AOTI", lambda i, t: package.model_with_boxes(i, t, *boxes),
                                            package.transforms(x))]
            panels, outs = [], []
            for label, run_model, images in models:
                out = run_model(images, token_ids)
                outs.append(out)
                found = instances(out, list(case.prompts), image.shape[:2], threshold=threshold)
                if not found:
                    found = instances(out, list(case.prompts), image.shape[:2], top_k=1)[:top_k]
                panels.append(overlay(image, found[:top_k], f"{label}: " + ", ".join(case.prompts),
                                      zip(case.boxes, case.labels)))
            (reference, candidate) = outs
            ref_scores, cand_scores = scores(reference), scores(candidate)
            points += list(zip(ref_scores.flatten().tolist(), cand_scores.flatten().tolist()))
            pair, query = divmod(int(ref_scores.argmax()), ref_scores.shape[1])
            name, heat = f"{case.name}.png", f"{case.name}_mask_diff.png"
            side_by_side(*panels).save(tmp / name)
            diff_heatmap(candidate[2][pair, query], reference[2][pair, query],
                         f"top mask |AOTI - eager| ({case.prompts[pair]})").save(tmp / heat)
            given = f", {len(case.boxes)} exemplar boxes (white +, black -)" if case.boxes else ""
            lines.append(f"## {case.name}: {', '.join(case.prompts)}{given}\n\n"
                         f"![{case.name}]({name}) ![diff]({heat})\n")
            log.info("rendered %s", name)
        score_scatter(points).save(tmp / "scores.png")
        lines.insert(4, "![scores](scores.png)\n")
        (tmp / "index.md").write_text("\n".join(lines))
    log.info("eager outputs: %d of %d from the reference cache", cache.hits, len(cases))
    record(paths.manifest, "render", [paths.render_dir], settings.fingerprint("render"))
    log.info("pictures: %s (shown in %s)", paths.render_dir, paths.verify_report_html)


if __name__ == "__main__":
    from ..pipeline.runner import main

    main("render", run, __doc__.splitlines()[0])
