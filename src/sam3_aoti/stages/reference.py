"""Stage `reference`: eager's outputs on every input verify compares, computed beside export and compile.

At full size the eager model's load and its runs were verify's first minute, after the package, on the critical
path of a fresh build; here they run while the compile keeps the CPUs busy and the GPU idle. Verify reads them
from the cache (`model.reference`) and loads eager only for an entry that is missing.
"""

from __future__ import annotations

import json
import logging

from ..model.reference import ReferenceCache, compared_inputs, eager_outputs
from ..pipeline.artifacts import record
from ..pipeline.paths import ProfilePaths
from ..pipeline.settings import Settings, compared_shapes
from ..runtime.files import write_text_atomic

log = logging.getLogger(__spec__.name)  # not __name__: run by `python -m`, a stage is "__main__"


def run(settings: Settings) -> None:
    import torch

    from ..model.checkpoints import eager_reference
    from ..pipeline.cases import load_cases
    from ..runtime.tokenizer import encode_prompts

    paths = ProfilePaths.of(settings)
    cases = load_cases()  # a broken case image fails here, before the model loads
    eager, transforms = eager_reference(settings)
    merges = paths.tokenizer_merges.read_text()  # what the package will hold, so the token ids are verify's
    cache = ReferenceCache.of(settings)
    entries = {}
    with torch.no_grad():
        for item in compared_inputs(settings, eager.model.config, cases, lambda p: encode_prompts(p, merges),
                                    transforms, torch.device(settings.device)):
            entry = cache.path(item.inputs)
            kept = entry.exists()
            eager_outputs(cache, item, lambda: eager)
            entries[item.label] = entry.name
            log.info("%s: %s", item.label, "kept from an earlier run" if kept else "computed")
    cache.prune()
    write_text_atomic(paths.reference_index, json.dumps(entries, indent=1) + "\n")
    record(paths.manifest, "reference", [paths.reference_index], {
        "entries": len(entries), "inputs": compared_shapes(settings), **settings.fingerprint("reference")})


if __name__ == "__main__":
    from ..pipeline.runner import main

    main("reference", run, __doc__.splitlines()[0])
