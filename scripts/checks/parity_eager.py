"""Our eager wrapper (what export traces) against Meta's own SAM3 on the cases, without building a package.

A quick look at the conversion, the wrapper and a precision recipe before spending a compile: the same code
as `doit parity` (weights written in Meta's format and loaded by Meta's builder, same pixels and prompts, Meta
run as `doit parity` runs it: fp32, or bf16 autocast for a bf16 build), with `Sam3Grounding` as the export
stage builds it (precision and `[export]` choices of the pipeline.toml given) in place of the AOTI package,
checked against `[parity.tolerances]`. Needs a GPU and Meta's `sam3` (scripts/fetch_gpu_wheels.sh).
Usage: python scripts/checks/parity_eager.py [profile=sam3] [weights=random] [precision=fp32|bf16|fp8] [config=PATH]
"""

import json
import logging
import sys
import time

import torch

from sam3_aoti.model.checkpoints import load_model
from sam3_aoti.model.meta import meta_model, meta_outputs, write_meta_checkpoint
from sam3_aoti.model.grounding import ImageTransforms, Sam3Grounding
from sam3_aoti.pipeline.cases import load_cases
from sam3_aoti.pipeline.report import summarize
from sam3_aoti.pipeline.settings import load_settings
from sam3_aoti.runtime.postprocess import to_tensor
from sam3_aoti.runtime.tokenizer import encode_prompts
from sam3_aoti.pipeline.parity_checks import case_row, check


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    variables = dict(arg.split("=", 1) for arg in sys.argv[1:])
    settings = load_settings(variables.get("profile", "sam3"), "cuda", variables.get("precision", "fp32"),
                             variables.get("weights", "random"), variables.get("config"))
    tolerances = settings.stage("parity")["tolerances"][settings.spec.tolerances]
    t0 = time.perf_counter()
    write_meta_checkpoint(settings)
    meta = meta_model(settings)
    ours = Sam3Grounding.built_as(load_model(settings).to("cuda"), settings)
    transforms = ImageTransforms(ours.model.config.vision_config.backbone_config.image_size)
    rows = []
    with torch.inference_mode():
        for case in load_cases():
            image = case.load_image()
            pixels, ids = transforms(to_tensor(image, "cuda")), encode_prompts(list(case.prompts)).cuda()
            boxes = tuple(t.cuda() for t in case.exemplars(image.shape[1], image.shape[0])) if case.boxes else None
            mine = ours.with_boxes(pixels, ids, *boxes) if boxes else ours(pixels, ids)
            theirs = meta_outputs(meta, pixels, case.prompts, "cuda", settings.spec.parity, boxes)
            rows.append(case_row(case, mine, theirs, tolerances.get("mask_band", 0.0)))
    checks = check([{**row, "pixels_max_levels": 0} for row in rows], tolerances)  # the transforms are not compared
    for line in summarize(checks):
        logging.info("%s", line)
    print(json.dumps({"seconds": round(time.perf_counter() - t0, 1), "precision": settings.precision,
                      "export": settings.stage("export"), "failed": sum(not c.ok for c in checks),
                      "cases": rows}))

if __name__ == "__main__":
    main()
