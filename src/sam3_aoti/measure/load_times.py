"""How long each kind of consumer takes to load a package, each in a fresh process with a warm page cache."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import tempfile
from pathlib import Path

from ..runtime.scratch import process_folder

log = logging.getLogger(__name__)

# How each consumer loads a package: ours, torch's by name, and `load_pt2` as a production loader calls it.
# torch's two with their CPU vector-ISA probe on (the default) cost tens of seconds per process before any
# byte of the package is read (docs/package.md); `[bench] isa_probe_loaders = true` times them too.
TORCH_LOAD = "from torch._inductor.package import load_package\nload = lambda p: load_package(p, '{}')"
PT2_LOAD = "from torch.export.pt2_archive._package import load_pt2\nload = lambda p: load_pt2(p)"
NO_ISA_PROBE = {"TORCHINDUCTOR_VEC_ISA_OK": "0"}
OURS = "from sam3_aoti import load_package\nload = lambda p: load_package(p)"
LOADERS = {  # ours twice: the first start hashes the package, the next finds that check remembered
    "sam3_aoti load_package, first start": (OURS, {}),
    "sam3_aoti load_package, next start": (OURS, {}),
    "torch load_package model, no ISA probe": (TORCH_LOAD.format("model"), NO_ISA_PROBE),
    "load_pt2, no ISA probe": (PT2_LOAD, NO_ISA_PROBE),
}
ISA_PROBE_LOADERS = {
    "torch load_package model": (TORCH_LOAD.format("model"), {}),
    "torch load_package transforms": (TORCH_LOAD.format("transforms"), {}),
    "load_pt2": (PT2_LOAD, {}),
}
LOAD_SCRIPT = """
import json, sys, time, torch
{loader}
if sys.argv[2] == "cuda":
    torch.zeros(1, device="cuda")  # a service has its CUDA context before it loads a model
t0 = time.perf_counter()
load(sys.argv[1])
print(json.dumps(time.perf_counter() - t0))
"""


def load_seconds(package, device: str, with_isa_probe: bool) -> dict[str, float]:
    """Seconds each consumer takes to load `package`, each in a fresh process, after one read of the
    file so the page cache is warm (as on a service's second start)."""
    with open(package, "rb") as f:
        while f.read(1 << 26):
            pass
    src = str(Path(__file__).resolve().parents[2])  # this checkout's library (src/) for the first loader
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [src, os.environ.get("PYTHONPATH")]))}
    loaders = {**LOADERS, **(ISA_PROBE_LOADERS if with_isa_probe else {})}
    times = {}
    with tempfile.TemporaryDirectory(dir=process_folder()) as cache:  # an empty record of checked packages
        env["SAM3_AOTI_CACHE"] = cache
        for name, (loader, extra_env) in loaders.items():
            seconds = _load_in_fresh_process(name, loader, package, device, {**env, **extra_env})
            if seconds is not None:
                times[name] = round(seconds, 2)
    return times


def next_start_seconds(src: str | Path, package, device: str, cache: str | Path) -> float | None:
    """Seconds `load_package` of the library under `src` (a checkout's src/ folder) takes to load `package` in a
    fresh process, with `cache` (SAM3_AOTI_CACHE) holding what that library remembers of earlier checks: a
    service's next start. None if it cannot load it (logged)."""
    env = {**os.environ, "PYTHONPATH": str(src), "SAM3_AOTI_CACHE": str(cache)}
    return _load_in_fresh_process(f"load_package of {src}", OURS, package, device, env)


def _load_in_fresh_process(name, loader, package, device, env) -> float | None:
    proc = subprocess.run([sys.executable, "-c", LOAD_SCRIPT.format(loader=loader), str(package), device],
                          capture_output=True, text=True, env=env)
    if proc.returncode != 0:
        log.warning("%s could not load the package: %s", name, (proc.stderr.strip().splitlines() or ["?"])[-1])
        return None
    seconds = json.loads(proc.stdout.strip().splitlines()[-1])
    log.info("load: %s %.3f s", name, seconds)
    return seconds
