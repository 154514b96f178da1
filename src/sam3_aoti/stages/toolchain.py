"""Stage `toolchain`: the CUDA toolkit and C++ compiler AOTInductor builds with, proven by a doctor whose
probe AOT-compiles, loads and runs a small model in a subprocess.

The toolkit is chosen by `cuda_toolkit` (the pinned pip wheels unless toolkit=machine); a probe that fails
gets the known fixes of `compiler_fixes`, the first that works recorded. The result is
`artifacts/toolchain/cuda.env` (see `cuda_env`) and `artifacts/toolchain/doctor.json`.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import subprocess
import sys
from dataclasses import asdict

from ..errors import ToolchainError
from ..pipeline.paths import ToolchainPaths, portable
from ..pipeline.settings import Settings
from ..runtime.files import write_text_atomic
from ..toolchain.compiler_fixes import candidate_fixes, cxx_info, links_libstdcxx_statically, run_probe
from ..toolchain.cuda_env import FIX_VARIABLE, write_env_file
from ..toolchain.cuda_toolkit import choose_toolkit, header_versions, libcuda_link_dir, load_pins, nvcc_version

log = logging.getLogger(__spec__.name)  # not __name__: run by `python -m`, a stage is "__main__"


def machine_env(environ) -> dict:
    """The environment without what a sourced cuda.env adds for its fix (the marker and its CXX): the
    probe must judge the machine's own compiler, or the next env file would lose the fix."""
    env = {k: v for k, v in environ.items() if k != FIX_VARIABLE}
    if FIX_VARIABLE in environ:
        env.pop("CXX", None)
    return env


def gpu_info() -> dict:
    import torch

    info: dict = {"cuda_available": torch.cuda.is_available()}
    smi = shutil.which("nvidia-smi")
    if smi:
        q = subprocess.run([smi, "--query-gpu=driver_version,name,compute_cap", "--format=csv,noheader"],
                           capture_output=True, text=True)
        if q.returncode == 0 and q.stdout.strip():
            driver, name, cc = [s.strip() for s in q.stdout.splitlines()[0].split(",")]
            info.update(driver=driver, gpu=name, compute_capability=cc)
    if info["cuda_available"]:
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, compute_capability=f"{props.major}.{props.minor}")
    return info


def run(settings: Settings) -> dict:
    import torch

    paths = ToolchainPaths.of(settings)
    scratch = paths.root
    scratch.mkdir(parents=True, exist_ok=True)
    base_env = machine_env(os.environ)
    report: dict = {"device": settings.device, "torch": torch.__version__, "torch_cuda": torch.version.cuda,
                    "python": sys.version.split()[0], "toolkit_preference": settings.toolkit, "notes": []}
    report["cxx"] = cxx_info(base_env)
    report["cxx"]["links_libstdcxx_statically"] = links_libstdcxx_statically(report["cxx"]["path"], scratch)
    if report["cxx"]["links_libstdcxx_statically"]:
        report["notes"].append(f"{report['cxx']['path']} links libstdc++ statically into shared objects: AOTI "
                               "wrappers then carry a private C++ runtime that clashes with torch's")
    env_values: dict[str, str] = {}

    if torch.version.cuda is None:
        if settings.device == "cuda":
            raise ToolchainError("device=cuda but this torch is a CPU-only build: install a CUDA torch or use device=cpu")
        report["notes"].append("CPU-only torch: no CUDA toolkit needed, none set up")
    else:
        report["gpu"] = gpu_info()
        if settings.device == "cuda" and not report["gpu"]["cuda_available"]:
            raise ToolchainError("device=cuda but torch sees no GPU (no driver or no device): use device=cpu, "
                                 "or check nvidia-smi")
        want = ".".join(torch.version.cuda.split(".")[:2])
        choice = choose_toolkit(want, base_env, scratch, settings.device == "cuda", load_pins(want), settings.toolkit)
        report["notes"] += choice.notes
        report["toolkits"] = [{**asdict(t), "home": str(t.home)} for t in choice.found]
        toolkit = choice.toolkit
        if toolkit:
            report["toolkit"] = {"source": toolkit.source, "why": choice.why, "home": str(toolkit.home),
                                 "nvcc": str(toolkit.nvcc), "version": toolkit.version,
                                 "release": nvcc_version(toolkit.nvcc, full=True), **header_versions(toolkit.home)}
            env_values = {"CUDA_HOME": str(toolkit.home), "PATH": str(toolkit.home / "bin")}
            log.info("CUDA %s toolkit from %s: %s (%s)", toolkit.version, toolkit.source, toolkit.home, choice.why)
            link = libcuda_link_dir(report["cxx"]["path"], scratch) if settings.device == "cuda" else None
            if link:
                env_values["LIBRARY_PATH"] = str(link)
                report["notes"].append(f"the compiler finds no libcuda.so (AOTI links -lcuda): {link} links the "
                                       "driver's, on LIBRARY_PATH")

    probe_env = {**base_env, **read_env_from(env_values, base_env)}
    log.info("probe: AOT-compiling and loading a two-layer model on %s", settings.device)
    probe = run_probe(settings.device, probe_env)
    report["probe"] = probe
    if not probe["ok"]:
        log.warning("probe failed (%s); trying known fixes", probe["failure"])
        for name, extra in candidate_fixes(scratch, report["cxx"]["path"]):
            attempt = run_probe(settings.device, {**probe_env, **extra})
            report.setdefault("fix_attempts", []).append({"fix": name, **attempt})
            if attempt["ok"]:
                log.info("fix '%s' works: recorded in %s", name, paths.env_file)
                env_values.update(extra, **{FIX_VARIABLE: name})
                report["fix"] = name
                break
        else:
            report["verdict"] = "broken"
            write_report(settings, report)
            raise ToolchainError(f"the AOTI probe {probe['failure']} on {settings.device} and no known fix helps; "
                                 f"see {paths.doctor}")
    report["verdict"] = "ok" if not report.get("fix") else f"ok with fix: {report['fix']}"
    write_env_file(paths.env_file, env_values, build_facts(report))
    write_report(settings, report)
    return report


def build_facts(report: dict) -> dict:
    """What can change the code AOTInductor writes, besides the graph: no paths, no timings."""
    from ..pipeline.settings import package_version

    gpu, toolkit = report.get("gpu", {}), report.get("toolkit", {})
    return {"torch": report["torch"], "triton": package_version("triton"), "C++ compiler": report["cxx"]["version"],
            "toolkit": toolkit.get("source", "-"), "nvcc": toolkit.get("release", toolkit.get("version", "-")),
            "CUDA headers": toolkit.get("CUDA headers", "-"), "CCCL": toolkit.get("CCCL", "-"),
            "GPU": f"{gpu.get('gpu', '-')} (cc {gpu.get('compute_capability', '-')})"}


def _portable(value):
    """The report with every path in the checkout written relative to it (`$SAM3_AOTI_ROOT/...`)."""
    if isinstance(value, dict):
        return {k: _portable(v) for k, v in value.items()}
    if isinstance(value, list):
        return [_portable(v) for v in value]
    return portable(value) if isinstance(value, str) else value


def read_env_from(values: dict, base: dict) -> dict:
    """What the env file would set, without writing it (PATH prepends included)."""
    return {k: (f"{v}{os.pathsep}{base.get('PATH', '')}" if k == "PATH" else v) for k, v in values.items()}


def write_report(settings: Settings, report: dict) -> None:
    write_text_atomic(ToolchainPaths.of(settings).doctor, json.dumps(_portable(report), indent=2) + "\n")
    gpu, tk = report.get("gpu", {}), report.get("toolkit", {})
    rows = [
        ("driver", gpu.get("driver", "-")),
        ("GPU", f"{gpu.get('gpu', '-')} (cc {gpu.get('compute_capability', '-')})"),
        ("torch", f"{report['torch']} (CUDA {report['torch_cuda']})"),
        ("toolkit", f"{tk.get('source', '-')}: {tk.get('why', '-')}"),
        ("nvcc", f"{tk.get('nvcc', '-')} ({tk.get('release', '-')})"),
        ("headers", f"CUDA {tk.get('CUDA headers', '-')}, CCCL {tk.get('CCCL', '-')}"),
        ("C++ compiler", f"{report['cxx']['path']}: {report['cxx']['version']}"),
        ("probe", "ok" if report["probe"]["ok"] else report["probe"]["failure"]),
        ("verdict", report["verdict"]),
    ]
    for note in report["notes"]:
        log.info("note: %s", note)
    for key, value in rows:
        log.info("%-13s %s", key, value)


if __name__ == "__main__":
    from ..pipeline.runner import main

    main("toolchain", run, __doc__.splitlines()[0])
