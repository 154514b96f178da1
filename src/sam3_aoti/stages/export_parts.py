"""Stage `export_parts`: torch.export the model in parts for encode once / decode many and exemplar boxes:
encode_image, encode_text, encode_boxes and decode, each with dynamic batch, prompt and box counts.

Its own stage, for the profiles `[export] split` names, beside `model`'s compile (the longest of the build),
which so starts before the parts are traced. The parts are re-run against eager at a (B, P) other than the
trace example, with one exemplar box and with more than the trace's.
"""

from __future__ import annotations

import logging
import time

from ..errors import ConfigError
from ..model.exporting import (check_against_eager, composed, composed_with_boxes, example_boxes, export_parts,
                               export_subject, save_with_digest)
from ..pipeline.artifacts import record
from ..pipeline.paths import ProfilePaths
from ..pipeline.settings import Settings

log = logging.getLogger(__spec__.name)  # not __name__: run by `python -m`, a stage is "__main__"


def run(settings: Settings) -> None:
    from ..model.configs import example_inputs

    paths, opts = ProfilePaths.of(settings), settings.stage("export")
    if not settings.split:
        raise ConfigError(f"profile {settings.profile} is not in [export] split (pipeline.toml): its package has "
                          "no parts to export")
    wrapper, example, device = export_subject(settings, "export_parts")
    log.info("exporting encode_image, encode_text, encode_boxes and decode at example (B, P) = (%d, %d)",
             *(a.shape[0] for a in example))
    t0 = time.perf_counter()
    programs = export_parts(wrapper, example)
    seconds = time.perf_counter() - t0
    log.info("exported in %.1f s", seconds)
    parts_run, boxes_run = composed(programs), composed_with_boxes(programs)  # each part's module made once
    atol = settings.spec.export_atol
    for b, p in [(opts["check_batch"], opts["check_prompts"]), (1, 1)]:
        args = example_inputs(wrapper.model.config, b, p, seed=1, device=device)
        diff = check_against_eager("decode(encode_image, encode_text)", parts_run, wrapper, args, atol)
        log.info("re-run at (B, P) = (%d, %d): max |exported - eager| = %.3g", b, p, diff)
        for count in (1, 5):  # exemplar boxes: one, and more than the trace's
            boxes = example_boxes(b, count, seed=count, device=device)
            diff = check_against_eager("decode with encode_boxes", boxes_run, wrapper.with_boxes, (*args, *boxes),
                                       atol)
            log.info("re-run with %d exemplar boxes at (B, P) = (%d, %d): max |exported - eager| = %.3g", count,
                     b, p, diff)
    save_with_digest(programs, paths.exported_parts, paths.parts_digest, log)
    record(paths.manifest, "export_parts", [paths.exported_parts, paths.parts_digest], {
        "export_seconds": round(seconds, 2), **settings.fingerprint("export_parts", "export"),
    })


if __name__ == "__main__":
    from ..pipeline.runner import main

    main("export_parts", run, __doc__.splitlines()[0])
