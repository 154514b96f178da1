"""Do two builds of a package give bit-identical outputs? Run both (AOTI and the exported fallback, `model`
and, in a split package, `encode_image`, `encode_text` and `decode`) on every verify case of cases.toml and
on verify's shape sweep, and compare every output tensor with `torch.equal`. Exits 1 on the first run that
differs anywhere, after printing one line per input.

Usage (e.g. a refactor: build before and after, then compare):
    uv run python scripts/checks/same_outputs.py BEFORE/sam3.pt2 AFTER/sam3.pt2 [--cases cases.toml]
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def calls(package) -> dict:
    """Every way the package computes, by name: (images, token_ids) -> tensors."""
    ways = {"model": lambda images, ids: package.model(images, ids)}
    if package.parts:
        ways["encode_image"] = lambda images, ids: package.encode_image(images)
        ways["encode_text"] = lambda images, ids: package.encode_text(ids)
        ways["decode"] = lambda images, ids: package.decode(package.encode_image(images), package.encode_text(ids))
    return ways


def flat(outputs) -> list:
    import torch

    if torch.is_tensor(outputs):
        return [outputs]
    return [t for o in outputs for t in flat(o)]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("before", type=Path)
    parser.add_argument("after", type=Path)
    parser.add_argument("--cases", type=Path, default=Path("cases.toml"))
    parser.add_argument("--device", default="cpu")
    args = parser.parse_args()

    import torch

    from sam3_aoti.pipeline.cases import load_cases
    from sam3_aoti.pipeline.settings import load_settings
    from sam3_aoti.runtime.loader import load_package
    from sam3_aoti.runtime.postprocess import to_tensor

    packages = [load_package(path, cuda_graphs=False) for path in (args.before, args.after)]
    builds = {name: [p.exported_only() if name == "exported" else p for p in packages]
              for name in ("aoti", "exported")}
    size = packages[0].metadata["models"]["model"]["inputs"]["images"]["shape"][-1]
    verify = load_settings(device=args.device).stage("verify")
    shapes = [tuple(s) for s in verify["shapes"]] + [tuple(verify["largest_shape"])]
    inputs = {}
    for b, p in dict.fromkeys(shapes):
        images = torch.randn(b, 3, size, size, generator=torch.Generator().manual_seed(b * 10 + p))
        phrases = [f"a {word}" for word in ("car", "red roof", "tree", "swimming pool", "road", "boat", "dog", "field")]
        inputs[f"sweep B={b} P={p}"] = (images.to(args.device), packages[0].encode_prompts(phrases[:p] * (p // 8 + 1))[:p])
    for case in load_cases(args.cases):
        image = to_tensor(case.load_image(), args.device)
        inputs[case.name] = (packages[0].transforms(image), packages[0].encode_prompts(list(case.prompts)))
        inputs[f"{case.name} transforms"] = image
    differ = 0
    with torch.no_grad():
        for label, given in inputs.items():
            for backend, (before, after) in builds.items():
                if torch.is_tensor(given):  # a raw image: the packages' transforms
                    pairs = {"transforms": (before.transforms(given), after.transforms(given))}
                else:
                    pairs = {name: (way(*given), calls(after)[name](*given)) for name, way in calls(before).items()}
                for name, (a, b) in pairs.items():
                    a, b = flat(a), flat(b)
                    same = len(a) == len(b) and all(x.shape == y.shape and torch.equal(x, y) for x, y in zip(a, b))
                    worst = max((float((x.float() - y.float()).abs().max()) for x, y in zip(a, b)
                                 if x.shape == y.shape), default=float("nan"))
                    differ += not same
                    print(f"{'✓' if same else '✗'} {label:28} {backend:8} {name:12} "
                          f"{'bit-identical' if same else f'max |diff| {worst:.3g}'}")
    print(f"{differ} of the runs differ" if differ else "every run bit-identical")
    return 1 if differ else 0


if __name__ == "__main__":
    sys.exit(main())
