"""CUDA toolkit from pip wheels and the doctor's probe, on a machine without a GPU."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sam3_aoti import toolchain
from sam3_aoti.errors import ToolchainError

from conftest import TINY, run_doit

needs_cuda_torch = pytest.mark.skipif(torch.version.cuda is None, reason="CPU-only torch: no CUDA toolkit to set up")


def torch_cuda() -> str:
    return ".".join(torch.version.cuda.split(".")[:2])


def fake_nvcc(folder: Path, release: str) -> Path:
    nvcc = folder / "bin" / "nvcc"
    nvcc.parent.mkdir(parents=True, exist_ok=True)
    nvcc.write_text(f"#!/bin/sh\necho 'Cuda compilation tools, release {release}, V{release}.1'\n")
    nvcc.chmod(0o755)
    return nvcc


@needs_cuda_torch
def test_pip_toolkit_is_complete_and_compiles_a_cu_file(tmp_path):
    pins = toolchain.load_pins(torch_cuda())
    toolkit, notes, _ = toolchain.choose_toolkit(torch_cuda(), {"PATH": "/usr/bin:/bin"}, tmp_path,
                                                 required=True, pins=pins, install=False)
    assert toolkit.source == "pip wheels" and toolkit.missing == [] and toolkit.version == torch_cuda()
    source = tmp_path / "kernel.cu"
    source.write_text("#include <cuda_runtime.h>\n#include <cuda/std/limits>\n"
                      "__global__ void twice(float* x) { x[threadIdx.x] *= 2.f; }\n")
    env = {"PATH": f"{toolkit.home}/bin:/usr/bin:/bin", "CUDA_HOME": str(toolkit.home)}
    proc = subprocess.run([str(toolkit.nvcc), "-c", str(source), "-o", str(tmp_path / "kernel.o")],
                          env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "kernel.o").stat().st_size > 1000


def test_cuda12_components_assemble_into_one_home(tmp_path):
    site = tmp_path / "nvidia"
    fake_nvcc(site / "cuda_nvcc", "12.8")
    for rel in ["cuda_runtime/include/cuda_runtime.h", "cuda_runtime/lib/libcudart.so.12",
                "cuda_cccl/include/cuda/std/version"]:
        (site / rel).parent.mkdir(parents=True, exist_ok=True)
        (site / rel).write_text("")
    home = toolchain.assemble_home([site / "cuda_nvcc", site / "cuda_cccl", site / "cuda_runtime"], tmp_path / "home")
    assert toolchain.missing_parts(home) == []
    assert toolchain.nvcc_version(home / "bin" / "nvcc") == "12.8"


def test_a_toolkit_of_another_cuda_version_is_reported_not_used(tmp_path):
    fake_nvcc(tmp_path / "other", "12.4")
    env = {"PATH": f"{tmp_path / 'other' / 'bin'}:/usr/bin:/bin"}
    with pytest.raises(ToolchainError, match="no complete CUDA 13.0 toolkit") as err:
        toolchain.choose_toolkit("13.0", env, tmp_path, required=True, pins=None, install=False)
    assert "is CUDA 12.4, torch needs 13.0: not used" in str(err.value)
    assert "\n" not in str(err.value)


def test_an_incomplete_toolkit_names_what_it_lacks(tmp_path):
    fake_nvcc(tmp_path / "bare", "13.0")
    toolkits = toolchain.find_toolkits({"CUDA_HOME": str(tmp_path / "bare"), "PATH": "/bin"}, None, tmp_path)
    toolkit, notes = toolchain.pick_toolkit(toolkits, "13.0")
    assert toolkit is None
    assert "include/cuda_runtime.h" in notes[0] and "CCCL" in notes[0]


def test_no_toolkit_is_only_a_note_for_the_cpu(tmp_path):
    toolkit, notes, _ = toolchain.choose_toolkit("13.0", {"PATH": "/nonexistent"}, tmp_path, required=False,
                                                 pins=None, install=False)
    assert toolkit is None and "not needed for device=cpu" in notes[-1]


def test_missing_compiler_is_one_line():
    with pytest.raises(ToolchainError, match="no C\\+\\+ compiler"):
        toolchain.cxx_info({"CXX": "/nonexistent/g++", "PATH": "/bin"})


def test_probe_reports_a_crash_with_its_signal():
    crash = [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"]
    result = toolchain.run_probe("cpu", {"PATH": "/usr/bin:/bin"}, command=crash)
    assert result == {"ok": False, "seconds": result["seconds"], "failure": "crashed with SIGSEGV"}


def test_probe_runs_aoti_on_the_cpu():
    import os

    result = toolchain.run_probe("cpu", dict(os.environ))
    assert result["ok"], result
    assert result["max_abs_diff"] < 1e-4


def test_env_file_round_trip_prepends_path(tmp_path):
    path = tmp_path / "cuda.env"
    fix = "regex-free parse_device_str"
    toolchain.write_env_file(path, {"CUDA_HOME": "/opt/cuda", "PATH": "/opt/cuda/bin", "CXX": "/x/g++",
                                    toolchain.FIX_VARIABLE: fix})
    values = toolchain.read_env_file(path, {"PATH": "/usr/bin"})
    assert values == {"CUDA_HOME": "/opt/cuda", "PATH": "/opt/cuda/bin:/usr/bin", "CXX": "/x/g++",
                      toolchain.FIX_VARIABLE: fix}
    script = f". {path}; echo $CUDA_HOME; echo $PATH; echo ${toolchain.FIX_VARIABLE}"
    shell = subprocess.run(["sh", "-c", script], env={"PATH": "/usr/bin"}, capture_output=True, text=True).stdout
    assert shell.splitlines() == ["/opt/cuda", "/opt/cuda/bin:/usr/bin", fix]


def test_toolchain_stage_probes_the_machine_without_an_earlier_fix(tmp_path, monkeypatch):
    """A rerun of `toolchain` must not inherit the CXX its last run recorded: the probe would pass with it,
    the new env file would leave it out, and compile would use the crashing compiler again (seen on the H200)."""
    import tasks

    env_file = tmp_path / "cuda.env"
    toolchain.write_env_file(env_file, {"CUDA_HOME": "/opt/cuda", "PATH": "/opt/cuda/bin", "CXX": "/fix/g++",
                                        toolchain.FIX_VARIABLE: "compiler linking libstdc++ shared: /fix/g++"})
    monkeypatch.setenv("CXX", "/machine/g++")
    assert tasks.stage_env("compile", env_file)["CXX"] == "/fix/g++"
    assert tasks.stage_env("toolchain", env_file)["CXX"] == "/machine/g++"
    sourced = toolchain.read_env_file(env_file, {"PATH": "/usr/bin"})  # a user who sourced the file
    assert toolchain.machine_env({"PATH": "/usr/bin", **sourced}) == {"CUDA_HOME": "/opt/cuda",
                                                                     "PATH": "/opt/cuda/bin:/usr/bin"}
    assert toolchain.machine_env({"CXX": "/machine/g++"}) == {"CXX": "/machine/g++"}


def test_regex_free_overlay_keeps_the_header_whole(tmp_path):
    overlay = toolchain.regex_free_overlay(tmp_path)
    text = (overlay / "torch/csrc/inductor/aoti_runtime/model_base.h").read_text()
    body = text[text.index("inline void parse_device_str("):text.index("class AOTInductorModelBase")]
    assert "std::regex" not in body and "device_idx = std::stoi(index)" in body
    assert text.count("inline void parse_device_str(") == 1


def test_env_file_reaches_the_compile_stage(built_repo):
    """The compile process ran with the toolchain's cuda.env applied: its metadata records the CUDA_HOME it
    saw. The file also names the versions that shape compiled code, and no timing: compile depends on it."""
    from sam3_aoti.package import load_package

    env_file = built_repo / "artifacts" / "toolchain" / "cuda.env"
    env = toolchain.read_env_file(env_file, {"PATH": ""})
    facts = dict(line[2:].split(": ", 1) for line in env_file.read_text().splitlines() if ": " in line[2:])
    assert {"torch", "triton", "C++ compiler", "nvcc", "GPU"} <= set(facts)
    metadata = load_package(built_repo / TINY / "package" / "sam3.pt2", prefer_aoti=False).metadata
    assert metadata["toolchain"]["CUDA_HOME"] == env.get("CUDA_HOME")
    doctor = json.loads((built_repo / "artifacts" / "toolchain" / "doctor.json").read_text())
    assert doctor["probe"]["ok"] and doctor["verdict"] == "ok"


def test_another_compiler_version_makes_compile_stale(built_repo):
    """Compile depends on cuda.env as a file: a new toolkit, compiler or GPU there reruns it (doit then
    reruns what follows, if compile's output changes), and nothing before it."""
    env_file = built_repo / "artifacts" / "toolchain" / "cuda.env"
    text = env_file.read_text()
    env_file.write_text(text.replace("# C++ compiler: ", "# C++ compiler: another "))
    try:
        listing = run_doit(built_repo, "list", "--status", "device=cpu").stdout
    finally:
        env_file.write_text(text)
    stale = {line.split()[1] for line in listing.splitlines() if line.startswith("R ")}
    assert "compile" in stale and not {"weights", "export"} & stale


def test_every_known_fix_still_compiles_and_runs_the_probe(tmp_path):
    """A fix that breaks the build would turn a crash into a compile error: each must pass on a sound machine."""
    import os

    for name, extra in toolchain.candidate_fixes(tmp_path, "g++"):
        result = toolchain.run_probe("cpu", {**os.environ, **extra})
        assert result["ok"], (name, result)


def test_a_compiler_that_links_libstdcxx_statically_is_detected(tmp_path):
    assert not toolchain.links_libstdcxx_statically("g++", tmp_path)
    static = toolchain.compiler_wrapper(tmp_path / "g++-static", shutil.which("g++"), ["-static-libstdc++"])
    assert toolchain.links_libstdcxx_statically(str(static), tmp_path)
    fixes = [name for name, _ in toolchain.candidate_fixes(tmp_path, str(static))]
    assert fixes[0].startswith("compiler linking libstdc++ shared: ") and fixes[-1] == "regex-free parse_device_str"
