"""Eager outputs on disk (`reference/`), so a re-compile re-runs only the package, never the slow
full-size eager model, and `render` draws eager's side from what `verify` computed instead of running it again.
The `reference` stage fills it beside export and compile (`compared_inputs`: verify's inputs, built the same
way), so verify, on the critical path of a fresh build, loads no eager model at all.

Keyed by everything an output depends on: the weights (their hash in the manifest), the model code, device,
precision, library versions, and the inputs' bytes. Bounded and cleaned: after each verify only the entries
that run used are kept (the ones `render` asks for next), so old weights or code leave nothing behind.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

from ..pipeline.paths import ProfilePaths
from ..pipeline.settings import Settings
from ..runtime.files import atomic_output


class ReferenceCache:
    def __init__(self, folder: Path, identity: dict):
        self.folder, self.identity, self.hits, self.used = folder, identity, 0, set()

    @classmethod
    def of(cls, settings: Settings) -> "ReferenceCache":
        paths = ProfilePaths.of(settings)
        return cls(paths.reference_cache, identity(settings, paths))

    def path(self, inputs: tuple) -> Path:
        h = hashlib.sha256(json.dumps(self.identity, sort_keys=True).encode())
        for t in inputs:
            h.update(str((tuple(t.shape), t.dtype)).encode())
            h.update(t.detach().cpu().contiguous().numpy().tobytes())
        return self.folder / f"{h.hexdigest()[:24]}.pt"

    def get(self, inputs: tuple, compute):
        """`compute(*inputs)`, from disk when these inputs were computed with this identity before."""
        import torch

        path = self.path(inputs)
        self.used.add(path.name)
        if path.exists():
            self.hits += 1
            return tuple(o.to(inputs[0].device) for o in torch.load(path))
        outputs = compute(*inputs)
        self.folder.mkdir(parents=True, exist_ok=True)
        with atomic_output(path) as tmp:
            torch.save(tuple(o.cpu() for o in outputs), tmp)
        return outputs

    def prune(self) -> int:
        """Remove every entry this run did not use; returns how many went."""
        stale = [p for p in self.folder.glob("*.pt") if p.name not in self.used] if self.folder.is_dir() else []
        for p in stale:
            p.unlink(missing_ok=True)
        return len(stale)


def sha256s(outputs: dict) -> dict:
    """The content of manifest outputs, without their file times (a copied checkout's are new)."""
    return {k: sha256s(v) if isinstance(v, dict) and "sha256" not in v else v["sha256"] if isinstance(v, dict) else v
            for k, v in outputs.items()}


def identity(settings: Settings, paths: ProfilePaths) -> dict:
    """What eager outputs depend on besides their inputs: weights (hash from the manifest), model code,
    device, precision, library versions, and whether TF32 was off (`precision.without_tf32`: entries computed
    with it on, before it was, are not read)."""
    manifest = json.loads(paths.manifest.read_text()) if paths.manifest.exists() else {}
    weights = sha256s(manifest.get("stages", {}).get("weights", {}).get("outputs", {}))
    return {"weights": weights, "model_code": wrapper_code_digest(), "tf32_off": settings.spec.strict_fp32,
            **{k: v for k, v in settings.fingerprint("verify").items() if k not in ("stage", "options")}}


def wrapper_code_digest() -> str:
    """One hash of the wrapper's code (`grounding` and the modules it is built from), in a fixed order."""
    folder = Path(__file__).parent
    files = [folder / f"{name}.py" for name in ("configs", "export_fixes", "mixed_precision", "grounding")]
    files += sorted((folder / "optimizations").glob("*.py"))
    h = hashlib.sha256()
    for path in files:
        h.update(path.relative_to(folder).as_posix().encode() + b"\0" + path.read_bytes())
    return h.hexdigest()


@dataclass(frozen=True)
class Compared:
    """One input verify runs the package and eager on: a sweep shape's random inputs, or a case's photograph."""
    label: str  # "sweep B=2 P=3", or the case's name
    inputs: tuple  # eager's: (images, token_ids), a case's images already through the eager transforms, + boxes
    with_boxes: bool = False  # through `eager.with_boxes` (a case of exemplar boxes)
    image: object = None  # a case's picture as the package takes it (uint8 on the device); None for a sweep


def sweep_shapes(opts: dict) -> list[tuple[int, int]]:
    """verify's (B, P) shapes: `[verify] shapes`, and `largest_shape` when it is not one of them."""
    shapes = [tuple(s) for s in opts["shapes"]]
    if opts.get("largest_shape") and tuple(opts["largest_shape"]) not in shapes:
        shapes.append(tuple(opts["largest_shape"]))
    return shapes


def compared_inputs(settings: Settings, config, cases, encode_prompts, transforms, device):
    """Every `Compared` of verify, in its order: the sweep, then the cases (`encode_prompts`: the package's
    tokenizer, or the same merges read from the weights stage; `transforms`: eager's)."""
    from ..runtime.postprocess import to_tensor
    from .configs import example_inputs

    for b, p in sweep_shapes(settings.stage("verify")):
        yield Compared(f"sweep B={b} P={p}", example_inputs(config, b, p, seed=b * 10 + p, device=device))
    for case in cases:
        picture = case.load_image()
        image = to_tensor(picture, device)
        token_ids = encode_prompts(list(case.prompts)).to(device)
        boxes = tuple(t.to(device) for t in case.exemplars(picture.shape[1], picture.shape[0])) if case.boxes else ()
        yield Compared(case.name, (transforms(image), token_ids, *boxes), bool(case.boxes), image)


def eager_outputs(cache: ReferenceCache, item: Compared, eager) -> tuple:
    """Eager's outputs on `item`, from the cache, else computed by `eager()` (a model loaded only when needed)."""
    return cache.get(item.inputs, lambda *a: (eager().with_boxes if item.with_boxes else eager())(*a))
