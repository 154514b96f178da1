"""Stage `toolchain`: the CUDA toolkit and C++ compiler AOTInductor builds with, in seconds.

The toolkit is chosen by `cuda_toolkit` (the pinned pip wheels unless toolkit=machine), the compiler checked
by `toolchain.facts` (one that links libstdc++ statically is replaced by the machine's shared-linking one,
without probing it first). The result is `artifacts/toolchain/cuda.env` (see `cuda_env`) and
`artifacts/toolchain/doctor.json`. The AOTI probe, which proves compile-load-run, is `stages.probe`: the
compile task runs it before a compile that really runs, not here.
"""

from __future__ import annotations

import json
import logging
import os

from ..pipeline.paths import ToolchainPaths, portable
from ..pipeline.settings import Settings
from ..runtime.files import bytecode_advice, write_text_atomic
from ..toolchain.cuda_env import write_env_file
from ..toolchain.facts import build_facts, gather

log = logging.getLogger(__spec__.name)  # not __name__: run by `python -m`, a stage is "__main__"


def run(settings: Settings) -> dict:
    paths = ToolchainPaths.of(settings)
    paths.root.mkdir(parents=True, exist_ok=True)
    report, env_values = gather(settings.device, settings.toolkit, os.environ, paths.root)
    toolkit = report.get("toolkit")
    if toolkit:
        log.info("CUDA %s toolkit from %s: %s (%s)", toolkit["version"], toolkit["source"], toolkit["home"],
                 toolkit["why"])
    if report.get("fix"):
        log.info("fix '%s' (recorded in %s)", report["fix"], paths.env_file)
    advice = bytecode_advice("torch")
    if advice:  # every stage's process would pay it
        log.warning("%s", advice)
    report["torch_bytecode"] = advice or "present, or written by the first import"
    report["verdict"] = "facts gathered; the AOTI probe runs before the first compile (artifacts/toolchain/probe.json)"
    write_env_file(paths.env_file, env_values, build_facts(report))
    write_report(settings, report)
    return report


def _portable(value):
    """The report with every path in the checkout written relative to it (`$SAM3_AOTI_ROOT/...`)."""
    if isinstance(value, dict):
        return {k: _portable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_portable(v) for v in value]
    return portable(value) if isinstance(value, str) else value


def write_report(settings: Settings, report: dict) -> None:
    write_text_atomic(ToolchainPaths.of(settings).doctor, json.dumps(_portable(report), indent=2) + "\n")
    gpu, tk = report.get("gpu", {}), report.get("toolkit", {})
    cxx = report.get("cxx_used", report["cxx"])
    rows = [
        ("driver", gpu.get("driver", "-")),
        ("GPU", f"{gpu.get('gpu', '-')} (cc {gpu.get('compute_capability', '-')})"),
        ("torch", f"{report['torch']} (CUDA {report['torch_cuda']})"),
        ("toolkit", f"{tk.get('source', '-')}: {tk.get('why', '-')}"),
        ("nvcc", f"{tk.get('nvcc', '-')} ({tk.get('release', '-')})"),
        ("headers", f"CUDA {tk.get('CUDA headers', '-')}, CCCL {tk.get('CCCL', '-')}"),
        ("C++ compiler", f"{cxx['path']}: {cxx['version']}"),
    ]
    for note in report["notes"]:
        log.info("note: %s", note)
    for key, value in rows:
        log.info("%-13s %s", key, value)


if __name__ == "__main__":
    from ..pipeline.runner import main

    main("toolchain", run, __doc__.splitlines()[0])
