"""Our eager wrapper (what export traces) against Meta's own SAM3 on the cases, without building a package.

A quick look at the conversion and the wrapper before spending a compile: the same code as `doit parity`
(weights written in Meta's format and loaded by Meta's builder, same pixels and prompts, TF32 off), with
`Sam3Grounding` in place of the AOTI package. Needs a GPU and Meta's `sam3` (scripts/fetch_gpu_wheels.sh).
Usage: python scripts/parity_eager.py [doit-style variables: profile=sam3 weights=random ...]
"""

import json
import logging
import sys
import time

import torch

from sam3_aoti.pipeline.cases import load_cases
from sam3_aoti.pipeline.settings import load_settings
from sam3_aoti.stages.parity import case_row
from sam3_aoti.model.meta import meta_model, meta_outputs, write_meta_checkpoint
from sam3_aoti.runtime.postprocess import to_tensor
from sam3_aoti.runtime.tokenizer import encode_prompts
from sam3_aoti.model.checkpoints import eager_reference


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    variables = dict(arg.split("=", 1) for arg in sys.argv[1:])
    settings = load_settings(variables.get("profile", "sam3"), "cuda", "fp32", variables.get("weights", "random"))
    t0 = time.perf_counter()
    write_meta_checkpoint(settings)
    meta = meta_model(settings)
    ours, transforms = eager_reference(settings)
    rows = []
    with torch.inference_mode():
        for case in load_cases():
            pixels = transforms(to_tensor(case.load_image(), "cuda"))
            mine = ours(pixels, encode_prompts(list(case.prompts)).cuda())
            rows.append(case_row(case, mine, meta_outputs(meta, pixels, case.prompts, "cuda")))
    print(json.dumps({"seconds": round(time.perf_counter() - t0, 1), "cases": rows}))


if __name__ == "__main__":
    main()
