"""AOTI vs eager drift of an fp32 build on the GPU, with cuDNN's TF32 convolutions on (PyTorch's default) and
off: which one verify's fp32 limits are measuring. Usage (GPU): python scripts/checks/tf32_drift.py ARTIFACTS_ROOT"""

import json
import sys

import torch

from sam3_aoti.pipeline.cases import load_cases
from sam3_aoti.pipeline.settings import load_settings
from sam3_aoti.runtime.contract import OUTPUT_NAMES
from sam3_aoti.runtime.loader import load_package
from sam3_aoti.pipeline.paths import ProfilePaths
from sam3_aoti.runtime.postprocess import to_tensor
from sam3_aoti.model.checkpoints import eager_reference


def main() -> None:
    settings = load_settings("tiny", "cuda", "fp32", artifacts=sys.argv[1])
    package = load_package(ProfilePaths.of(settings).package)
    eager, transforms = eager_reference(settings)
    worst = {}
    for tf32 in (True, False):
        torch.backends.cudnn.allow_tf32 = tf32
        drift = dict.fromkeys(OUTPUT_NAMES, 0.0)
        with torch.inference_mode():
            for case in load_cases():
                pixels = transforms(to_tensor(case.load_image(), "cuda"))
                ids = package.encode_prompts(case.prompts).cuda()
                for name, a, b in zip(OUTPUT_NAMES, package.model(pixels, ids), eager(pixels, ids)):
                    drift[name] = max(drift[name], float((a - b).abs().max() / b.abs().max()))
        worst[f"cudnn.allow_tf32={tf32}"] = drift
    print(json.dumps({"max |aoti - eager| / max |eager|": worst}, indent=1))


if __name__ == "__main__":
    main()
