"""Stage `weights`: one HF-format checkpoint folder (config.json + model.safetensors) per profile.

Every later stage loads the model from this folder, so the weights' hash is the one input that says
"same model". Random init is seeded, so it is reproducible across machines.
"""

from __future__ import annotations

import logging
from pathlib import Path

from .artifacts import atomic_output, record
from .config import Settings
from .errors import WeightsError
from .paths import ProfilePaths

log = logging.getLogger("sam3_aoti")


def build_model(settings: Settings):
    """The eager model the stage writes: seeded random init, or an HF-format checkpoint folder."""
    from transformers import Sam3Config, Sam3Model

    from .model import random_model, tiny_config

    if settings.weights == "random":
        config = tiny_config() if settings.architecture == "tiny" else Sam3Config()
        seed = settings.stage("weights").get("seed", 0)
        log.info("random init (%s architecture, seed %d)", settings.architecture, seed)
        return random_model(config, seed)
    path = Path(settings.weights)
    if path.is_dir() and (path / "config.json").exists():
        log.info("loading HF-format checkpoint %s", path)
        return Sam3Model.from_pretrained(path).eval()
    raise WeightsError(f"weights={path}: expected random or an HF-format folder with config.json and model.safetensors")


def load_model(settings: Settings):
    """The model later stages use, read back from the profile's checkpoint folder."""
    from transformers import Sam3Model

    folder = ProfilePaths.of(settings).checkpoint
    if not (folder / "model.safetensors").exists():
        raise WeightsError(f"no checkpoint at {folder}: run `uv run doit weights profile={settings.profile}` first")
    return Sam3Model.from_pretrained(folder).eval()


def run(settings: Settings) -> None:
    paths = ProfilePaths.of(settings)
    model = build_model(settings)
    n_params = sum(p.numel() for p in model.parameters())
    with atomic_output(paths.checkpoint) as tmp:
        model.save_pretrained(tmp, max_shard_size="1000GB")  # one model.safetensors: the file later stages name
    log.info("%s parameters -> %s", f"{n_params:,}", paths.checkpoint)
    record(paths.manifest, "weights", [paths.checkpoint], {
        "source": settings.weights, "random_init": settings.weights == "random",
        "parameters": n_params, **settings.fingerprint("weights"),
    })


if __name__ == "__main__":
    from .stage import main

    main("weights", run, __doc__.splitlines()[0])
