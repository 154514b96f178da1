"""Stage `weights`: one HF-format checkpoint folder (config.json + model.safetensors) per profile.

Sources: seeded random init, a Hugging Face-format folder, or Meta's original `sam3.pt` (converted with
the table in `model.meta_keys`). Every source is loaded strictly: a missing, unexpected or wrongly shaped
tensor is an error naming it, never a silently re-initialized weight. The tokenizer's merges are written
beside the weights (the checkpoint's own files when it has them, else CLIP's, shipped as package data).
Every later stage loads this folder, so its hash is the one input that says "same model".
"""

from __future__ import annotations

import logging
from pathlib import Path

from ..errors import ConfigError, WeightsError
from ..model.checkpoints import build_model
from ..pipeline.artifacts import check_free_space, record
from ..pipeline.paths import ProfilePaths
from ..pipeline.settings import Settings
from ..runtime.files import atomic_output, write_text_atomic

log = logging.getLogger(__spec__.name)  # not __name__: run by `python -m`, a stage is "__main__"


def tokenizer_merges(settings: Settings) -> tuple[str, str]:
    """(merges text, where it came from): the checkpoint's own tokenizer files first."""
    from ..runtime.tokenizer import ClipTokenizer, bundled_vocab_path, checkpoint_merges, read_merges_text

    if settings.weights != "random":
        path = Path(settings.weights)
        try:
            found = checkpoint_merges(path if path.is_dir() else path.parent)
        except ConfigError as e:
            raise WeightsError(str(e)) from None
        if found:
            return found[0], str(found[1])
    text = read_merges_text()
    ClipTokenizer(text)
    return text, f"{bundled_vocab_path().name} (shipped with sam3_aoti)"


def run(settings: Settings) -> None:
    paths = ProfilePaths.of(settings)
    merges, merges_source = tokenizer_merges(settings)
    model = build_model(settings)
    n_params = sum(p.numel() for p in model.parameters())
    size = sum(t.numel() * t.element_size() for t in model.state_dict().values())
    check_free_space({paths.checkpoint.parent: int(1.05 * size) + (16 << 20)}, "weights")
    with atomic_output(paths.checkpoint) as tmp:
        model.save_pretrained(tmp, max_shard_size="1000GB")  # one model.safetensors: the file later stages name
    write_text_atomic(paths.tokenizer_merges, merges)
    log.info("%s parameters -> %s; tokenizer merges from %s", f"{n_params:,}", paths.checkpoint, merges_source)
    record(paths.manifest, "weights", [paths.checkpoint, paths.tokenizer_merges], {
        "source": settings.weights, "random_init": settings.weights == "random",
        "parameters": n_params, "tokenizer": merges_source, **settings.fingerprint("weights"),
    })


if __name__ == "__main__":
    from ..pipeline.runner import main

    main("weights", run, __doc__.splitlines()[0])
