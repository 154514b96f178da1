"""Stage `probe`: prove that AOTInductor can compile, load and run on this machine with cuda.env's toolchain,
just before a compile that really runs (the compile task runs it; a substituted compile skips it).

The probe runs in a subprocess (`toolchain.probe`), so a crash in native code is a reported failure. One that
fails gets the known fixes of `compiler_fixes`; the first that works goes to `artifacts/toolchain/probe.env`,
which every later stage applies after cuda.env. The verdict is kept in `probe.json` with cuda.env's sha256,
and a pass with no fix also in the user's cache (`probe/KEY.json`, KEY: cuda.env, the device, torch, the
interpreter and the C++ compiler), under a lock: a machine probes once per toolchain, however many checkouts
build on it (two at once: the second waits for the first's verdict, beside its compile).
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import logging
import os
import sys
from importlib.metadata import version
from pathlib import Path

from ..pipeline.vec_isa import compiler_identity
from ..errors import ToolchainError
from ..pipeline.paths import ToolchainPaths
from ..pipeline.settings import Settings
from ..runtime.files import sha256, write_text_atomic
from ..runtime.scratch import cache_dir
from ..toolchain.compiler_fixes import candidate_fixes, run_probe
from ..toolchain.cuda_env import FIX_VARIABLE, write_env_file

log = logging.getLogger(__spec__.name)  # not __name__: run by `python -m`, a stage is "__main__"


def passing_verdict(report: Path, env_sha256: str) -> dict | None:
    """The verdict in `report` if it is a pass for this cuda.env, else None."""
    try:
        verdict = json.loads(report.read_text())
    except (OSError, ValueError):
        return None
    ok = isinstance(verdict, dict) and verdict.get("cuda_env_sha256") == env_sha256 and verdict.get("ok") is True
    return verdict if ok else None


def passed_before(paths: ToolchainPaths, env_sha256: str) -> bool:
    return passing_verdict(paths.probe_report, env_sha256) is not None


def machine_verdict(device: str, env_sha256: str) -> Path:
    """Where this machine keeps a pass of the probe for this toolchain, across checkouts."""
    text = f"{env_sha256} {device} {version('torch')} {sys.executable} {compiler_identity()}"
    return cache_dir() / "probe" / f"{hashlib.sha256(text.encode()).hexdigest()[:24]}.json"


@contextlib.contextmanager
def held(lock: Path):
    """`lock` held exclusively (waits for another checkout's probe); without one where the cache is read-only."""
    try:
        lock.parent.mkdir(parents=True, exist_ok=True)
        handle = open(lock, "a")
    except OSError:
        yield
        return
    with handle:
        fcntl.flock(handle, fcntl.LOCK_EX)
        yield


def run(settings: Settings) -> dict:
    paths = ToolchainPaths.of(settings)
    env_sha256 = sha256(paths.env_file) if paths.env_file.exists() else "-"
    verdict = passing_verdict(paths.probe_report, env_sha256)
    if verdict:
        log.info("the probe passed before with this cuda.env: %s", paths.probe_report)
        return verdict
    shared = machine_verdict(settings.device, env_sha256)
    with held(shared.with_suffix(".lock")):
        verdict = passing_verdict(shared, env_sha256)
        if verdict:
            paths.probe_env.unlink(missing_ok=True)  # the shared pass needed no fix
            write_text_atomic(paths.probe_report, json.dumps(verdict, indent=2) + "\n")
            log.info("the probe passed on this machine before with this toolchain: %s", shared)
            return verdict
        verdict = probe_here(settings, paths, env_sha256)
        if verdict.get("fix") is None:
            with contextlib.suppress(OSError):  # a read-only cache: each checkout probes, as before
                write_text_atomic(shared, json.dumps(verdict, indent=2) + "\n")
        return verdict


def probe_here(settings: Settings, paths: ToolchainPaths, env_sha256: str) -> dict:
    """Run the probe, and the known fixes if it fails; the verdict goes to probe.json (raises if none works)."""
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
