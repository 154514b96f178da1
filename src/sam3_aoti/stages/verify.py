"""Stage `verify`: may this package ship? AOTI (and its exported-program fallback) against eager.

Runs the dynamic-shape sweep on random inputs and every case on real photographs; each check is one
✓/✗ row in report.md / report.json, and any ✗ fails the task and leaves the package unverified.
"""

from __future__ import annotations

import logging
from concurrent.futures import ThreadPoolExecutor

from ..errors import DriftError, Sam3AotiError
from ..measure.drift import fallback_key, measure_drift
from ..model.reference import ReferenceCache, sweep_shapes
from ..pipeline.artifacts import mark, record
from ..pipeline.gates import gated
from ..pipeline.paths import ProfilePaths
from ..pipeline.report import Check, Report, margin, summarize, write_report
from ..pipeline.settings import Settings

log = logging.getLogger(__spec__.name)  # not __name__: run by `python -m`, a stage is "__main__"


def pictures(cases) -> list[tuple[str, str]]:
    """The PNGs `render` makes, by name, with captions."""
    figures = [("../render/scores.png", "AOTI vs eager score of every query of every case")]
    for case in cases:
        figures += [(f"../render/{case.name}.png", f"{case.name}: {', '.join(case.prompts)} (left eager, right AOTI)"),
                  (f"../render/{case.name}_mask_diff.png", f"{case.name}: top mask, |AOTI - eager| after sigmoid")]
    return figures


def verify_report(settings: Settings, paths: ProfilePaths, rows: list[Check], backends: dict, cases) -> Report:
    note = (f"Package `{paths.package.name}`, weights `{settings.weights}`"
            + (" (random init: outputs mean nothing, drift still does)" if settings.weights == "random" else "")
            + ". In the pictures, left of each case: eager transformers; right: the AOTI package."
            + (f" Reference: the {settings.spec.reference} model, so every row is the accuracy cost of "
               f"{settings.spec.summary}." if settings.spec.reference != settings.precision else ""))
    tolerances = settings.stage("verify")["tolerances"][settings.spec.tolerances]  # so a later change can re-gate it
    return Report(f"Verify: {settings.profile} ({settings.device}, {settings.precision})", [note], rows,
                  figures=pictures(cases), data={"backends": backends, "tolerances": tolerances})


def timed(what: str, load, *args):
    """`load(*args)`, its seconds logged: verify's wait before its first check is these loads."""
    import time

    t0 = time.perf_counter()
    value = load(*args)
    log.info("loaded %s in %.1f s", what, time.perf_counter() - t0)
    return value


def run_checks(settings: Settings, backends: dict, eager, transforms, cases, cache, measured: list | None = None
               ) -> list[Check]:
    """Every ✓/✗ row: `backends` measured now, plus `measured`, records of the fallback_drift stage."""
    tol = settings.stage("verify")["tolerances"][settings.spec.tolerances]
    records = measure_drift(settings, backends, eager, transforms, cases, cache) + (measured or [])
    return gated(records, tol)


def fallback_measured(settings: Settings, paths: ProfilePaths, cache) -> list[dict] | None:
    """The fallback_drift stage's records, where they hold for the fallback beside this package (its bytes checked
    against the digest beside it, as a load would check them) and for today's inputs and eager; else None."""
    import json

    from ..runtime.archive import fallback_of
    from ..runtime.integrity import check_package, digest_file, read_digest_file

    fallback = fallback_of(paths.package)
    try:
        stored = json.loads(paths.fallback_drift.read_text())
        check_package(fallback)
        digest = read_digest_file(digest_file(fallback))
        same = stored.get("key") == fallback_key(settings, digest, cache)
    except (OSError, ValueError, AttributeError, Sam3AotiError):
        return None  # measured here instead: whatever is wrong, loading it says so in one line
    return stored.get("records") if same else None


def run(settings: Settings) -> None:
    import functools

    from ..model.checkpoints import eager_reference, reference_transforms
    from ..pipeline.cases import load_cases
    from ..pipeline.precision import without_tf32
    from ..runtime.loader import load_exported, load_package

    paths = ProfilePaths.of(settings)
    mark(paths.manifest, "verify", verified=False)  # until this run says otherwise, whatever stops it
    cases = load_cases()  # a broken case image fails here, not after the models loaded
    without_tf32(settings.spec)  # the package's convolutions in real fp32, as eager's were
    cache = ReferenceCache.of(settings)
    measured = fallback_measured(settings, paths, cache)
    with ThreadPoolExecutor(1) as loader:  # the fallback, if this run must measure it, loads beside the package
        exported = None if measured else loader.submit(timed, "the exported fallback", load_exported, paths.package)
        package = timed("the package", load_package, paths.package)
        if package.fallback_reason:
            raise DriftError(f"the package's AOTI models do not load here ({package.fallback_reason}): "
                             f"rebuild with `uv run doit compile device={settings.device}`")
        backends = {"aoti": package, **({"exported": package.exported_only(exported.result())} if exported else {})}
    log.info("%d sweep shapes, %d cases, backends %s; the fallback %s", len(sweep_shapes(settings.stage("verify"))),
             len(cases), package.backends, "measured now" if exported else "as its stage measured it")
    eager = functools.cache(lambda: timed("the eager model", eager_reference, settings)[0])  # on a miss only
    rows = run_checks(settings, backends, eager, reference_transforms(settings), cases, cache, measured)
    log.info("eager reference: %d of %d from the reference cache", cache.hits, len(cache.used))
    cache.prune()
    for r in rows:
        log.debug("%s", r.line())
    for line in summarize(rows):
        (log.error if line.startswith("✗") else log.info)("%s", line)
    failed = [r for r in rows if not r.ok]
    write_report(verify_report(settings, paths, rows, package.backends, cases), paths.verify_report_json,
                 paths.verify_report_md, paths.verify_report_html)
    record(paths.manifest, "verify", [paths.verify_report_json, paths.verify_report_md, paths.verify_report_html], {
        "verified": not failed, "package_sha256": package.metadata.get("inputs_sha256"),
        **settings.fingerprint("verify"),
    })
    log.info("report: %s (with the pictures: %s)", paths.verify_report_md, paths.verify_report_html)
    if failed:
        worst = min(failed, key=margin)
        raise DriftError(f"{len(failed)}/{len(rows)} checks failed, worst: {worst.backend} {worst.case} "
                         f"{worst.metric} = {worst.value} (limit {worst.limit}); see {paths.verify_report_md}")


if __name__ == "__main__":
    from ..pipeline.runner import main

    main("verify", run, __doc__.splitlines()[0])
