"""The toolchain as facts, gathered in about a second and without importing torch: the toolkit AOTInductor
builds with, the C++ compiler (and the fix a compiler that links libstdc++ statically needs), the GPU, and
the versions that shape compiled code. The `toolchain` stage writes them to cuda.env; the binary cache's
keys are made of them before any stage runs. Proving that the compiler works (the AOTI probe, a minute on
a GPU) is left to `probe`, run only before a compile that really runs."""

from __future__ import annotations

import os
import platform
import re
import shutil
import subprocess
import sys
from dataclasses import asdict
from importlib import metadata, util
from pathlib import Path

from ..errors import ToolchainError
from .compiler_fixes import cxx_info, links_libstdcxx_statically, shared_libstdcxx_compilers
from .cuda_env import FIX_VARIABLE
from .cuda_toolkit import choose_toolkit, header_versions, libcuda_link_dir, load_pins, nvcc_version


def torch_build() -> tuple[str, str | None]:
    """torch's version and CUDA line, read from its installed version.py (importing torch takes seconds)."""
    spec = util.find_spec("torch")
    text = (Path(spec.submodule_search_locations[0]) / "version.py").read_text() if spec else ""
    version = re.search(r"__version__\s*=\s*'([^']+)'", text)
    cuda = re.search(r"^cuda[^=]*=\s*'([^']+)'", text, re.M)
    return (version.group(1) if version else "absent"), (cuda.group(1) if cuda else None)


def gpu_info() -> dict:
    """The driver, the first GPU's model and compute capability, from nvidia-smi."""
    smi = shutil.which("nvidia-smi")
    if not smi:
        return {}
    try:
        q = subprocess.run([smi, "--query-gpu=driver_version,name,compute_cap", "--format=csv,noheader"],
                           capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired):
        return {}
    if q.returncode != 0 or not q.stdout.strip():
        return {}
    driver, name, cc = [s.strip() for s in q.stdout.splitlines()[0].split(",")]
    return {"driver": driver, "gpu": name, "compute_capability": cc}


def cpu_isa() -> str:
    """The widest vector ISA Inductor's CPU code can use here (what a CPU build's kernels are compiled for)."""
    try:
        flags = set(re.search(r"^flags\s*:(.*)$", Path("/proc/cpuinfo").read_text(), re.M).group(1).split())
    except (OSError, AttributeError):
        flags = set()
    if {"avx512f", "avx512bw", "avx512vl", "avx512dq"} <= flags:
        isa = "avx512"
    elif "avx2" in flags:
        isa = "avx2"
    else:
        isa = "none"
    return f"{platform.machine()} {isa}"


def machine_env(environ) -> dict:
    """The environment without what a sourced cuda.env adds for its fix (the marker and its CXX): the
    facts must be the machine's own, or the next env file would lose the fix."""
    env = {k: v for k, v in environ.items() if k != FIX_VARIABLE}
    if FIX_VARIABLE in environ:
        env.pop("CXX", None)
    return env


def gather(device: str, preference: str, environ, scratch: Path) -> tuple[dict, dict]:
    """(report, env values): what the doctor reports and what cuda.env sets. A compiler that links libstdc++
    statically (its AOTI wrappers crash on load beside torch's shared one) is replaced by one of the
    machine's that links it shared, without probing the known-bad one first."""
    base_env = machine_env(environ)
    torch_version, torch_cuda = torch_build()
    report: dict = {"device": device, "torch": torch_version, "torch_cuda": torch_cuda,
                    "python": sys.version.split()[0], "toolkit_preference": preference, "notes": []}
    env_values: dict[str, str] = {}
    cxx = report["cxx"] = cxx_info(base_env)
    cxx["links_libstdcxx_statically"] = links_libstdcxx_statically(cxx["path"], scratch)
    if cxx["links_libstdcxx_statically"]:
        report["notes"].append(f"{cxx['path']} links libstdc++ statically into shared objects: AOTI wrappers then "
                               "carry a private C++ runtime that clashes with torch's")
        shared = shared_libstdcxx_compilers(cxx["path"], scratch)
        if shared:
            report["fix"] = f"compiler linking libstdc++ shared: {shared[0]}"
            env_values.update({"CXX": shared[0], FIX_VARIABLE: report["fix"]})
            report["cxx_used"] = cxx_info({**base_env, "CXX": shared[0]})
    if torch_cuda is None:
        if device == "cuda":
            raise ToolchainError("device=cuda but this torch is a CPU-only build: install a CUDA torch or use device=cpu")
        report["notes"].append("CPU-only torch: no CUDA toolkit needed, none set up")
    else:
        report["gpu"] = gpu_info()
        if device == "cuda" and not report["gpu"]:
            raise ToolchainError("device=cuda but nvidia-smi sees no GPU (no driver or no device): use device=cpu, "
                                 "or check nvidia-smi")
        want = ".".join(torch_cuda.split(".")[:2])
        choice = choose_toolkit(want, base_env, scratch, device == "cuda", load_pins(want), preference)
        report["notes"] += choice.notes
        report["toolkits"] = [{**asdict(t), "home": str(t.home)} for t in choice.found]
        toolkit = choice.toolkit
        if toolkit:
            report["toolkit"] = {"source": toolkit.source, "why": choice.why, "home": str(toolkit.home),
                                 "nvcc": str(toolkit.nvcc), "version": toolkit.version,
                                 "release": nvcc_version(toolkit.nvcc, full=True), **header_versions(toolkit.home)}
            env_values.update({"CUDA_HOME": str(toolkit.home), "PATH": str(toolkit.home / "bin")})
            link = libcuda_link_dir(report.get("cxx_used", cxx)["path"], scratch) if device == "cuda" else None
            if link:
                env_values["LIBRARY_PATH"] = str(link)
                report["notes"].append(f"the compiler finds no libcuda.so (AOTI links -lcuda): {link} links the "
                                       "driver's, on LIBRARY_PATH")
    return report, env_values


def build_facts(report: dict) -> dict:
    """What can change the code AOTInductor writes, besides the graph: no paths, no timings."""
    gpu, toolkit = report.get("gpu", {}), report.get("toolkit", {})
    facts = {"torch": report["torch"], "triton": _version("triton"),
             "C++ compiler": report.get("cxx_used", report["cxx"])["version"],
             "toolkit": toolkit.get("source", "-"), "nvcc": toolkit.get("release", toolkit.get("version", "-")),
             "CUDA headers": toolkit.get("CUDA headers", "-"), "CCCL": toolkit.get("CCCL", "-"),
             "GPU": f"{gpu.get('gpu', '-')} (cc {gpu.get('compute_capability', '-')})"}
    if report["device"] == "cpu":  # CPU kernels are compiled for the vector ISA Inductor finds
        facts["CPU"] = cpu_isa()
    return facts


def _version(name: str) -> str:
    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return "absent"


def with_env(values: dict, base: dict) -> dict:
    """What the env file would set, without writing it (PATH prepends included)."""
    return {k: (f"{v}{os.pathsep}{base.get('PATH', '')}" if k == "PATH" else v) for k, v in values.items()}
