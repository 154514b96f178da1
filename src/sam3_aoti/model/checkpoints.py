"""Checkpoints to `Sam3Model`, strictly: seeded random init, a Hugging Face folder, or Meta's `sam3.pt`.

A missing, unexpected or wrongly shaped tensor is an error naming it, never a silently re-initialized weight.
"""

from __future__ import annotations

import logging
from pathlib import Path

from ..errors import WeightsError, first_line
from ..pipeline.paths import ProfilePaths
from ..pipeline.settings import Settings

log = logging.getLogger(__name__)

META_SUFFIXES = (".pt", ".pth")


def _listing(keys: list, limit: int = 4) -> str:
    shown = ", ".join(str(k) for k in keys[:limit])
    return shown + (f" and {len(keys) - limit} more" if len(keys) > limit else "")


def key_problems(missing: list, unexpected: list, mismatched: list) -> str | None:
    """One sentence about keys that do not fit, or None when everything fits."""
    parts = []
    if missing:
        parts.append(f"{len(missing)} missing ({_listing(sorted(missing))})")
    if unexpected:
        parts.append(f"{len(unexpected)} unexpected ({_listing(sorted(unexpected))})")
    if mismatched:
        parts.append(f"{len(mismatched)} wrongly shaped ({_listing(mismatched)})")
    return "; ".join(parts) or None


def load_hf_folder(folder: Path):
    """`Sam3Model.from_pretrained`, strict: transformers only warns about missing keys and re-initializes them."""
    from transformers import Sam3Model

    try:
        model, info = Sam3Model.from_pretrained(folder, output_loading_info=True, ignore_mismatched_sizes=True)
    except Exception as e:
        raise WeightsError(f"cannot load {folder} ({first_line(e)}): the checkpoint is damaged or incomplete; "
                           "copy it again") from e
    mismatched = [f"{key} {tuple(old)} vs model {tuple(new)}" for key, old, new in info["mismatched_keys"]]
    problems = key_problems(info["missing_keys"], info["unexpected_keys"], mismatched)
    if problems:
        raise WeightsError(f"{folder} does not fit Sam3Model: {problems}")
    return model.eval()


def shapes_of(config) -> dict:
    """Every tensor's shape of a Sam3Model of `config`, built on the meta device (no memory, no init)."""
    import torch
    from transformers import Sam3Model

    with torch.device("meta"):
        return {k: v.shape for k, v in Sam3Model(config).state_dict().items()}


def check_architecture(folder: Path, expected, architecture: str) -> None:
    """An HF folder's config.json against the profile's architecture, compared as tensor shapes on the meta
    device (no weights read, no memory): a checkpoint of another architecture is refused by name."""
    import json

    from transformers import Sam3Config

    try:
        model_type = json.loads((folder / "config.json").read_text()).get("model_type")
        config = Sam3Config.from_pretrained(folder)
    except Exception as e:
        raise WeightsError(f"{folder / 'config.json'} is not a SAM3 config ({first_line(e)}): pass a SAM3 "
                           "checkpoint") from e
    if model_type != "sam3":
        raise WeightsError(f"{folder / 'config.json'} is not a SAM3 config (model_type {model_type!r}): pass a SAM3 "
                           "checkpoint")
    want, got = shapes_of(expected), shapes_of(config)
    differ = [f"{k} {tuple(got[k])} vs {tuple(want[k])}" for k in want if k in got and got[k] != want[k]]
    missing = [k for k in want if k not in got]
    if differ or missing:
        raise WeightsError(f"{folder} is a SAM3 checkpoint of another architecture than `{architecture}`: "
                           f"{key_problems(missing, [], differ)}: pass a checkpoint of the `{architecture}` "
                           "architecture, or a config whose profile names its architecture")


def load_meta_checkpoint(path: Path, config=None, architecture: str = "full"):
    """Meta's `sam3.pt` -> Sam3Model (Meta's architecture unless a config is given), every tensor accounted for.
    Names and shapes are compared on the meta device first: a checkpoint that does not fit costs no model (a
    full-size random init is 3 GB and most of a minute on a CPU)."""
    import torch
    from transformers import Sam3Model

    from .meta_keys import meta_state_dict, to_transformers
    from .configs import full_config

    try:
        checkpoint = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception as e:
        raise WeightsError(f"cannot read {path} ({first_line(e)}): not a complete PyTorch checkpoint; "
                           "copy it again") from e
    state, unknown = to_transformers(meta_state_dict(checkpoint))
    config = config or full_config()
    expected = shapes_of(config)
    missing = [k for k in expected if k not in state]
    unexpected = unknown + [k for k in state if k not in expected]
    mismatched = [f"{k} {tuple(v.shape)} vs model {tuple(expected[k])}"
                  for k, v in state.items() if k in expected and v.shape != expected[k]]
    problems = key_problems(missing, unexpected, mismatched)
    if problems:
        raise WeightsError(f"{path} does not fit SAM3's `{architecture}` architecture as Meta's checkpoint format: "
                           f"{problems}")
    model = Sam3Model(config).eval()
    model.load_state_dict(state, strict=True)
    return model


def build_model(settings: Settings):
    """The eager model the stage writes: seeded random init, an HF-format folder, or Meta's sam3.pt."""
    from .configs import full_config, random_model, tiny_config

    config = tiny_config() if settings.architecture == "tiny" else full_config()
    if settings.weights == "random":
        options = settings.stage("weights")
        spread = options["random_init"][settings.architecture]
        log.info("random init (%s architecture, seed %d, %s)", settings.architecture, options["seed"], spread)
        return random_model(config, options["seed"], spread.get("matrix_gain"), spread["bias_noise"])
    path = Path(settings.weights)
    if path.is_dir() and (path / "config.json").exists():
        log.info("loading HF-format checkpoint %s", path)
        check_architecture(path, config, settings.architecture)
        return load_hf_folder(path)
    if path.is_file() and path.suffix in META_SUFFIXES:
        log.info("converting Meta-format checkpoint %s", path)
        return load_meta_checkpoint(path, config, settings.architecture)
    raise WeightsError(f"weights={path}: expected random, an HF-format folder (config.json, model.safetensors) "
                       "or Meta's sam3.pt")


def checkpoint_folder(settings: Settings) -> Path:
    """The profile's checkpoint folder, which the `weights` stage writes."""
    folder = ProfilePaths.of(settings).checkpoint
    if not (folder / "model.safetensors").exists():
        raise WeightsError(f"no checkpoint at {folder}: run `uv run doit weights profile={settings.profile}` first")
    return folder


def load_model(settings: Settings):
    """The model later stages use, read back from the profile's checkpoint folder."""
    from transformers import Sam3Model

    return Sam3Model.from_pretrained(checkpoint_folder(settings)).eval()


def checkpoint_config(settings: Settings):
    """The checkpoint's `Sam3Config`, no weights read."""
    from transformers import Sam3Config

    return Sam3Config.from_pretrained(checkpoint_folder(settings))


def reference_transforms(settings: Settings):
    """The eager image transforms, from the checkpoint's config alone: no weights read (verify and render need
    no model when the `reference` stage's cache holds every eager output)."""
    from .grounding import ImageTransforms

    return ImageTransforms(checkpoint_config(settings).vision_config.backbone_config.image_size)


def eager_reference(settings: Settings):
    """The eager wrapper and image transforms from the profile's checkpoint: what verify, render and bench
    compare the package against. Its masked attentions are transformers' plain matmul-softmax, so verify
    also gates the SDPA path the package is exported with. An fp8 build is compared with the bf16 model (its
    ViT linears unquantized): verify then gates what fp8 costs against the precision users would run instead."""
    from ..pipeline.precision import PRECISIONS, without_tf32
    from .grounding import ImageTransforms, Sam3Grounding

    without_tf32(settings.spec)
    eager = Sam3Grounding.at(load_model(settings).to(settings.device), PRECISIONS[settings.spec.reference],
                             masked_attention="eager").eval()
    return eager, ImageTransforms(eager.model.config.vision_config.backbone_config.image_size)
