"""Our `transforms` against Meta's Sam3Processor transform on the CPU, per photograph: the largest difference
in uint8 levels and the share of pixels that differ (the README's figures; tests/test_meta_parity.py gates them).
Usage: uv run python scripts/checks/preprocessing_vs_meta.py [IMAGE_SIZE]   (default 1008, the full model's input)"""

import sys
import tempfile
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "tests"))
from test_meta_parity import images, run_meta_sam3  # noqa: E402

from sam3_aoti.model.grounding import ImageTransforms


def main() -> None:
    size = int(sys.argv[1]) if len(sys.argv) > 1 else 1008
    shots = images()
    raw = [torch.from_numpy(image).permute(2, 0, 1).contiguous() for _, image in shots]
    with tempfile.TemporaryDirectory() as folder:
        theirs = run_meta_sam3({"image_size": size, "images": raw}, Path(folder))["pixels"]
    ours = ImageTransforms(size)
    print(f"| image | size | max levels | pixels differing |  (resized to {size}x{size})\n|---|---|---|---|")
    for (name, image), one, meta in zip(shots, raw, theirs):
        levels = (ours(one[None].float()) - meta).abs() * 127.5
        print(f"| {name} | {image.shape[0]}x{image.shape[1]} | {float(levels.max()):.0f} | "
              f"{float((levels > 1e-3).float().mean()):.1%} |")


if __name__ == "__main__":
    main()
