"""Stage `probe`: prove that AOTInductor can compile, load and run on this machine with cuda.env's toolchain,
just before a compile that really runs (the compile task runs it; a substituted compile skips it).

The probe runs in a subprocess (`toolchain.probe`), so a crash in native code is a reported failure. One that
fails gets the known fixes of `compiler_fixes`; the first that works goes to `artifacts/toolchain/probe.env`,
which every later stage applies after cuda.env. The verdict is kept in `probe.json` with cuda.env's sha256: a
machine probes once per toolchain.
"""

from __future__ import annotations

import json
import logging
import os

from ..errors import ToolchainError
from ..pipeline.paths import ToolchainPaths
from ..pipeline.settings import Settings
from ..runtime.files import sha256, write_text_atomic
from ..toolchain.compiler_fixes import candidate_fixes, run_probe
from ..toolchain.cuda_env import FIX_VARIABLE, write_env_file

log = logging.getLogger(__spec__.name)  # not __name__: run by `python -m`, a stage is "__main__"


def passed_before(paths: ToolchainPaths, env_sha256: str) -> bool:
    try:
        verdict = json.loads(paths.probe_report.read_text())
    except (OSError, ValueError):
        return False
    return verdict.get("cuda_env_sha256") == env_sha256 and verdict.get("ok") is True


def run(settings: Settings) -> dict:
    paths = ToolchainPaths.of(settings)
    env_sha256 = sha256(paths.env_file) if paths.env_file.exists() else "-"
    if passed_before(paths, env_sha256):
        log.info("the probe passed before with this cuda.env: %s", paths.probe_report)
        return json.loads(paths.probe_report.read_text())
    paths.probe_env.unlink(missing_ok=True)  # a fix found for another toolchain says nothing of this one
    log.info("probe: AOT-compiling, loading and running a two-layer model on %s", settings.device)
    probe = run_probe(settings.device, dict(os.environ))
    verdict = {"cuda_env_sha256": env_sha256, "probe": probe, "ok": probe["ok"]}
    if probe["ok"]:
        log.info("probe ok in %.1f s", probe["seconds"])
    else:
        log.warning("probe failed (%s); trying known fixes", probe["failure"])
        cxx = os.environ.get("CXX") or "g++"
        for name, extra in candidate_fixes(paths.root, cxx):
            if extra.get("CXX") == cxx:
                continue
            attempt = run_probe(settings.device, {**os.environ, **extra})
            verdict.setdefault("fix_attempts", []).append({"fix": name, **attempt})
            if attempt["ok"]:
                log.info("fix '%s' works: recorded in %s", name, paths.probe_env)
                write_env_file(paths.probe_env, {**extra, FIX_VARIABLE: name})
                verdict.update(ok=True, fix=name)
                break
    write_text_atomic(paths.probe_report, json.dumps(verdict, indent=2) + "\n")
    if not verdict["ok"]:
        raise ToolchainError(f"the AOTI probe {probe['failure']} on {settings.device} and no known fix helps; "
                             f"see {paths.probe_report}")
    return verdict


if __name__ == "__main__":
    from ..pipeline.runner import main

    main("probe", run, __doc__.splitlines()[0])
