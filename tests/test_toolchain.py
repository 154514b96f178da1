"""CUDA toolkit from pip wheels and the doctor's probe, on a machine without a GPU."""

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from sam3_aoti.stages import toolchain
from sam3_aoti.toolchain import compiler_fixes, cuda_env, cuda_toolkit, facts
from sam3_aoti.errors import ToolchainError

from helpers import REPO, TINY, run_doit

needs_cuda_torch = pytest.mark.skipif(torch.version.cuda is None, reason="CPU-only torch: no CUDA toolkit to set up")


def torch_cuda() -> str:
    return ".".join(torch.version.cuda.split(".")[:2])


def fake_nvcc(folder: Path, release: str) -> Path:
    nvcc = folder / "bin" / "nvcc"
    nvcc.parent.mkdir(parents=True, exist_ok=True)
    nvcc.write_text(f"#!/bin/sh\necho 'Cuda compilation tools, release {release}, V{release}.1'\n")
    nvcc.chmod(0o755)
    return nvcc


def fake_toolkit(home: Path, release: str) -> Path:
    """A complete toolkit as `missing_parts` sees it (nvcc answers `release`), with versioned headers."""
    fake_nvcc(home, release)
    major, minor = release.split(".")
    files = {"include/cuda_runtime.h": "", "include/cuda.h": f"#define CUDA_VERSION {int(major) * 1000 + int(minor) * 10}\n",
             "include/cccl/cuda/std/version": "", "include/cccl/cuda/std/__cccl/version.h": "#define CCCL_VERSION 3000001\n",
             f"lib/libcudart.so.{major}": ""}
    for rel, text in files.items():
        (home / rel).parent.mkdir(parents=True, exist_ok=True)
        (home / rel).write_text(text)
    return home


CU13 = {"group": "cuda13", "layout": "cu13"}


@pytest.mark.slow  # nvcc compiles
@needs_cuda_torch
def test_pip_toolkit_is_complete_and_compiles_a_cu_file(tmp_path):
    pins = cuda_toolkit.load_pins(torch_cuda())
    choice = cuda_toolkit.choose_toolkit(torch_cuda(), {"PATH": "/usr/bin:/bin"}, tmp_path, required=True, pins=pins)
    toolkit = choice.toolkit
    assert toolkit.source == "pip wheels" and toolkit.missing == [] and toolkit.version == torch_cuda()
    assert cuda_toolkit.header_versions(toolkit.home)["CUDA headers"] == torch_cuda()
    source = tmp_path / "kernel.cu"
    source.write_text("#include <cuda_runtime.h>\n#include <cuda/std/limits>\n"
                      "__global__ void twice(float* x) { x[threadIdx.x] *= 2.f; }\n")
    env = {"PATH": f"{toolkit.home}/bin:/usr/bin:/bin", "CUDA_HOME": str(toolkit.home)}
    proc = subprocess.run([str(toolkit.nvcc), "-c", str(source), "-o", str(tmp_path / "kernel.o")],
                          env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert (tmp_path / "kernel.o").stat().st_size > 1000


def test_pinned_wheels_win_over_a_complete_machine_toolkit_unless_asked(tmp_path):
    """Hermetic by default: the machine's own toolkit of the right version is used only with toolkit=machine.
    torch's runtime-only cu13 folder, earlier on the path, is passed over for the one with nvcc."""
    machine = fake_toolkit(tmp_path / "usr-local-cuda", "13.0")
    (tmp_path / "torch-site" / "nvidia" / "cu13" / "lib").mkdir(parents=True)
    wheels = fake_toolkit(tmp_path / "venv-site" / "nvidia" / "cu13", "13.0")
    roots = [tmp_path / "torch-site", tmp_path / "venv-site"]
    env = {"CUDA_HOME": str(machine), "PATH": f"{machine}/bin:/usr/bin"}
    pinned = cuda_toolkit.choose_toolkit("13.0", env, tmp_path, True, CU13, "pinned", roots)
    assert (pinned.toolkit.source, pinned.toolkit.home) == ("pip wheels", wheels)
    assert "pinned wheels (group cuda13)" in pinned.why and {t.home for t in pinned.found} == {wheels, machine}
    asked = cuda_toolkit.choose_toolkit("13.0", env, tmp_path, True, CU13, "machine", roots)
    assert (asked.toolkit.source, asked.toolkit.home) == ("CUDA_HOME", machine) and "toolkit=machine" in asked.why
    unpinned = cuda_toolkit.choose_toolkit("13.0", env, tmp_path, True, None, "pinned", roots)
    assert unpinned.toolkit.home == machine and "no pinned wheels" in unpinned.why


def test_pinned_wheels_not_installed_is_one_line_naming_both_ways_out(tmp_path):
    machine = fake_toolkit(tmp_path / "usr-local-cuda", "13.0")
    with pytest.raises(ToolchainError) as err:
        cuda_toolkit.choose_toolkit("13.0", {"CUDA_HOME": str(machine)}, tmp_path, True, CU13, "pinned", [tmp_path])
    message = str(err.value)
    assert "pinned CUDA 13.0 toolkit wheels are not installed" in message and "\n" not in message
    assert "uv sync --group cuda13" in message and "toolkit=machine" in message


def test_the_machines_toolkit_paths_key_the_toolchain_only_where_they_can_matter():
    assert not cuda_toolkit.machine_toolkit_matters("pinned", "2.11.0+cu130")  # pins for 13.0
    assert cuda_toolkit.machine_toolkit_matters("machine", "2.11.0+cu130")
    assert cuda_toolkit.machine_toolkit_matters("pinned", "2.11.0+cu126")  # no pins for 12.6
    assert cuda_toolkit.machine_toolkit_matters("pinned", "2.11.0")  # CUDA line unknown without torch


def test_header_versions_are_read_from_the_headers(tmp_path):
    home = fake_toolkit(tmp_path / "cuda", "12.8")
    assert cuda_toolkit.header_versions(home) == {"CUDA headers": "12.8", "CCCL": "3.0.1"}
    assert cuda_toolkit.header_versions(tmp_path / "nowhere") == {"CUDA headers": "-", "CCCL": "-"}


def test_cuda12_components_assemble_into_one_home(tmp_path):
    site = tmp_path / "nvidia"
    fake_nvcc(site / "cuda_nvcc", "12.8")
    for rel in ["cuda_runtime/include/cuda_runtime.h", "cuda_runtime/lib/libcudart.so.12",
                "cuda_cccl/include/cuda/std/version"]:
        (site / rel).parent.mkdir(parents=True, exist_ok=True)
        (site / rel).write_text("")
    pins = {"group": "cuda12", "layout": "per-component", "components": ["cuda_nvcc", "cuda_cccl", "cuda_runtime"]}
    home = cuda_toolkit.pip_toolkit_home(pins, tmp_path / "home", roots=[tmp_path])
    assert cuda_toolkit.missing_parts(home) == []
    assert cuda_toolkit.nvcc_version(home / "bin" / "nvcc") == "12.8"


def test_a_toolkit_of_another_cuda_version_is_reported_not_used(tmp_path):
    fake_toolkit(tmp_path / "other", "12.4")
    env = {"PATH": f"{tmp_path / 'other' / 'bin'}:/usr/bin:/bin"}
    with pytest.raises(ToolchainError, match="no complete CUDA 13.0 toolkit") as err:
        cuda_toolkit.choose_toolkit("13.0", env, tmp_path, required=True, pins=None)
    assert "is CUDA 12.4, torch needs 13.0: not used" in str(err.value)
    assert "\n" not in str(err.value)


def test_an_incomplete_toolkit_names_what_it_lacks(tmp_path):
    fake_nvcc(tmp_path / "bare", "13.0")
    toolkits = cuda_toolkit.machine_toolkits({"CUDA_HOME": str(tmp_path / "bare"), "PATH": "/bin"})
    toolkit, notes = cuda_toolkit.pick_toolkit(toolkits, "13.0")
    assert toolkit is None
    assert "include/cuda_runtime.h" in notes[0] and "CCCL" in notes[0]


def test_no_toolkit_is_only_a_note_for_the_cpu(tmp_path):
    choice = cuda_toolkit.choose_toolkit("13.0", {"PATH": "/nonexistent"}, tmp_path, required=False, pins=None)
    assert choice.toolkit is None and "not needed for device=cpu" in choice.notes[-1]


def test_unknown_toolkit_choice_is_a_config_error():
    from sam3_aoti.pipeline.settings import load_settings
    from sam3_aoti.errors import ConfigError

    assert load_settings(device="cpu").toolkit == "pinned"
    assert load_settings(device="cpu", toolkit="machine").toolkit == "machine"
    with pytest.raises(ConfigError, match="unknown toolkit='conda': use pinned"):
        load_settings(device="cpu", toolkit="conda")


def test_a_missing_libcuda_so_is_linked_to_the_drivers(tmp_path, monkeypatch):
    """The pip wheels ship no libcuda.so stub, and AOTI links -lcuda: the driver's loaded library is linked."""
    assert cuda_toolkit.loaded_library("libc.so").is_file()  # the real lookup reads /proc/self/maps
    driver = tmp_path / "driver" / "libcuda.so.1"
    driver.parent.mkdir()
    driver.write_text("")
    monkeypatch.setattr(cuda_toolkit, "loaded_library", lambda prefix: driver)
    link = cuda_toolkit.libcuda_link_dir("g++", tmp_path)
    assert (link / "libcuda.so").resolve() == driver
    monkeypatch.setattr(cuda_toolkit, "loaded_library", lambda prefix: None)
    assert cuda_toolkit.libcuda_link_dir("g++", tmp_path) is None  # no driver: nothing to link (CPU)


def test_missing_compiler_is_one_line():
    with pytest.raises(ToolchainError, match="no C\\+\\+ compiler"):
        compiler_fixes.cxx_info({"CXX": "/nonexistent/g++", "PATH": "/bin"})


def test_probe_reports_a_crash_with_its_signal():
    crash = [sys.executable, "-c", "import os, signal; os.kill(os.getpid(), signal.SIGSEGV)"]
    result = compiler_fixes.run_probe("cpu", {"PATH": "/usr/bin:/bin"}, command=crash)
    assert result == {"ok": False, "seconds": result["seconds"], "failure": "crashed with SIGSEGV"}


def test_env_file_round_trip_prepends_path(tmp_path):
    path = tmp_path / "cuda.env"
    fix = "regex-free parse_device_str"
    facts = {"nvcc": "13.0.88", "C++ compiler": "g++ (Debian 12.2.0-14) 12.2.0"}
    cuda_env.write_env_file(path, {"CUDA_HOME": "/opt/cuda", "PATH": "/opt/cuda/bin", "CXX": "/x/g++",
                                    cuda_env.FIX_VARIABLE: fix}, facts)
    assert cuda_env.read_build_facts(path) == facts
    values = cuda_env.read_env_file(path, {"PATH": "/usr/bin"})
    assert values == {"CUDA_HOME": "/opt/cuda", "PATH": "/opt/cuda/bin:/usr/bin", "CXX": "/x/g++",
                      cuda_env.FIX_VARIABLE: fix}
    script = f". {path}; echo $CUDA_HOME; echo $PATH; echo ${cuda_env.FIX_VARIABLE}"
    shell = subprocess.run(["sh", "-c", script], env={"PATH": "/usr/bin"}, capture_output=True, text=True).stdout
    assert shell.splitlines() == ["/opt/cuda", "/opt/cuda/bin:/usr/bin", fix]


def test_toolchain_stage_probes_the_machine_without_an_earlier_fix(tmp_path, monkeypatch):
    """A rerun of `toolchain` must not inherit the CXX its last run recorded: the probe would pass with it,
    the new env file would leave it out, and compile would use the crashing compiler again (seen on the H200)."""
    import tasks

    env_file = tmp_path / "cuda.env"
    cuda_env.write_env_file(env_file, {"CUDA_HOME": "/opt/cuda", "PATH": "/opt/cuda/bin", "CXX": "/fix/g++",
                                        cuda_env.FIX_VARIABLE: "compiler linking libstdc++ shared: /fix/g++"})
    monkeypatch.setenv("CXX", "/machine/g++")
    assert tasks.stage_env("compile", env_file)["CXX"] == "/fix/g++"
    assert tasks.stage_env("toolchain", env_file)["CXX"] == "/machine/g++"
    sourced = cuda_env.read_env_file(env_file, {"PATH": "/usr/bin"})  # a user who sourced the file
    assert facts.machine_env({"PATH": "/usr/bin", **sourced}) == {"CUDA_HOME": "/opt/cuda",
                                                                     "PATH": "/opt/cuda/bin:/usr/bin"}
    assert facts.machine_env({"CXX": "/machine/g++"}) == {"CXX": "/machine/g++"}


def test_a_cpu_stage_starts_no_pool_of_compile_processes(tmp_path, monkeypatch):
    """On the CPU a model's kernels are one C++ file, so Inductor's pool of compile processes would only cost
    its start (a torch import per core in every stage process); on a GPU it compiles Triton kernels side by
    side. A value the user set is kept."""
    from dataclasses import replace

    import tasks

    monkeypatch.delenv("TORCHINDUCTOR_COMPILE_THREADS", raising=False)
    for device, threads in (("cpu", "1"), ("cuda", None)):
        monkeypatch.setattr(tasks, "SETTINGS", replace(tasks.SETTINGS, device=device))
        assert tasks.stage_env("compile", tmp_path / "cuda.env").get("TORCHINDUCTOR_COMPILE_THREADS") == threads
    monkeypatch.setenv("TORCHINDUCTOR_COMPILE_THREADS", "8")
    assert tasks.stage_env("compile", tmp_path / "cuda.env")["TORCHINDUCTOR_COMPILE_THREADS"] == "8"


def test_the_stages_only_verify_waits_for_let_their_openmp_threads_wait_passively(tmp_path, monkeypatch):
    """Beside the compiles, a spinning OpenMP thread of the fallback's measurement takes a core the compiles want;
    the stages on the package's own path keep OpenMP's default, and a value the user set is kept."""
    import tasks

    monkeypatch.delenv("OMP_WAIT_POLICY", raising=False)
    assert {name: tasks.stage_env(name, tmp_path / "cuda.env").get("OMP_WAIT_POLICY")
            for name in ("reference", "fallback", "fallback_drift", "export", "compile", "compile_parts")} == {
        "reference": "PASSIVE", "fallback": "PASSIVE", "fallback_drift": "PASSIVE", "export": None, "compile": None,
        "compile_parts": None}
    monkeypatch.setenv("OMP_WAIT_POLICY", "ACTIVE")
    assert tasks.stage_env("fallback_drift", tmp_path / "cuda.env")["OMP_WAIT_POLICY"] == "ACTIVE"


def test_regex_free_overlay_keeps_the_header_whole(tmp_path):
    overlay = compiler_fixes.regex_free_overlay(tmp_path)
    text = (overlay / "torch/csrc/inductor/aoti_runtime/model_base.h").read_text()
    body = text[text.index("inline void parse_device_str("):text.index("class AOTInductorModelBase")]
    assert "std::regex" not in body and "device_idx = std::stoi(index)" in body
    assert text.count("inline void parse_device_str(") == 1


def test_env_file_reaches_the_compile_stage(built_repo):
    """The compile process ran with the toolchain's cuda.env applied: its metadata records the CUDA_HOME it
    saw. The file also names the versions that shape compiled code, and no timing: compile depends on it."""
    from sam3_aoti.runtime.loader import load_package

    env_file = built_repo / "artifacts" / "toolchain" / "cuda.env"
    env = cuda_env.read_env_file(env_file, {"PATH": ""})
    facts = cuda_env.read_build_facts(env_file)
    assert {"torch", "triton", "C++ compiler", "toolkit", "nvcc", "CUDA headers", "CCCL", "GPU"} <= set(facts)
    metadata = load_package(built_repo / TINY / "package" / "sam3.pt2", prefer_aoti=False).metadata
    assert metadata["toolchain"]["CUDA_HOME"] == env.get("CUDA_HOME")
    assert metadata["toolchain"]["build"] == facts  # nvcc, header and compiler versions travel with the package
    probe = json.loads((built_repo / "artifacts" / "toolchain" / "probe.json").read_text())
    assert probe["ok"] and probe["probe"]["max_abs_diff"] < 1e-4  # the probe ran AOTI on the CPU, correctly
    assert probe["cuda_env_sha256"] == hashlib.sha256(env_file.read_bytes()).hexdigest()  # for this toolchain


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


@pytest.mark.slow  # two AOTI compiles of the probe
def test_every_known_fix_still_compiles_and_runs_the_probe(tmp_path):
    """A fix that breaks the build would turn a crash into a compile error: each must pass on a sound machine."""
    import os

    for name, extra in compiler_fixes.candidate_fixes(tmp_path, "g++"):
        result = compiler_fixes.run_probe("cpu", {**os.environ, **extra})
        assert result["ok"], (name, result)


@pytest.mark.slow  # g++ compiles and links
def test_a_compiler_that_links_libstdcxx_statically_is_detected(tmp_path):
    assert not compiler_fixes.links_libstdcxx_statically("g++", tmp_path)
    static = compiler_fixes.compiler_wrapper(tmp_path / "g++-static", shutil.which("g++"), ["-static-libstdc++"])
    assert compiler_fixes.links_libstdcxx_statically(str(static), tmp_path)
    fixes = [name for name, _ in compiler_fixes.candidate_fixes(tmp_path, str(static))]
    assert fixes[0].startswith("compiler linking libstdc++ shared: ") and fixes[-1] == "regex-free parse_device_str"


def test_env_file_names_the_checkout_relative_to_itself(tmp_path):
    """A toolkit inside the checkout (the pip wheels in .venv) is written as $SAM3_AOTI_ROOT/...: read back here
    it is this checkout's, and sourced from a copy of artifacts/ it is the copy's."""
    from sam3_aoti.pipeline.paths import REPO_ROOT

    inside = str(REPO_ROOT / ".venv" / "lib" / "nvidia" / "cu 13")
    env_file = tmp_path / "copy" / "artifacts" / "toolchain" / "cuda.env"
    cuda_env.write_env_file(env_file, {"CUDA_HOME": inside, "PATH": inside + "/bin", "CXX": "/usr/bin/g++"})
    text = env_file.read_text()
    assert str(REPO_ROOT) not in text and '"$SAM3_AOTI_ROOT"' in text
    assert cuda_env.read_env_file(env_file, {"PATH": "/bin"})["CUDA_HOME"] == inside
    sourced = subprocess.run(["bash", "-c", f'source "{env_file}"; echo "$CUDA_HOME"'], capture_output=True, text=True,
                             env={"PATH": "/usr/bin:/bin"})
    assert sourced.stdout.strip() == str(tmp_path / "copy" / ".venv" / "lib" / "nvidia" / "cu 13")


@pytest.mark.slow  # g++ compiles and links
def test_a_statically_linking_compiler_is_replaced_without_a_probe(tmp_path):
    """The H200's /opt/gcc g++ links libstdc++ statically (its AOTI wrappers crash on load): the facts take the
    machine's shared-linking g++ at once, in about a second, and record why; nothing is probed."""
    import time

    static = compiler_fixes.compiler_wrapper(tmp_path / "g++-static", shutil.which("g++"), ["-static-libstdc++"])
    t0 = time.perf_counter()
    report, env = facts.gather("cpu", "pinned", {"PATH": "/usr/bin:/bin", "CXX": str(static)}, tmp_path)
    assert time.perf_counter() - t0 < 30
    assert report["fix"].startswith("compiler linking libstdc++ shared: ") and "probe" not in report
    assert env["CXX"] != str(static) and not compiler_fixes.links_libstdcxx_statically(env["CXX"], tmp_path)
    assert facts.build_facts(report)["C++ compiler"] == report["cxx_used"]["version"]


def test_the_probe_runs_once_per_toolchain(tmp_path):
    from sam3_aoti.pipeline.paths import ToolchainPaths
    from sam3_aoti.stages.probe import passed_before

    paths = ToolchainPaths(tmp_path)
    paths.env_file.write_text("export CXX=/usr/bin/g++\n")
    digest = hashlib.sha256(paths.env_file.read_bytes()).hexdigest()
    paths.probe_report.write_text(json.dumps({"cuda_env_sha256": digest, "ok": True}))
    assert passed_before(paths, digest)
    assert not passed_before(paths, hashlib.sha256(b"another toolchain").hexdigest())


def test_a_second_checkout_on_the_machine_takes_the_probes_pass_and_a_new_compiler_probes_again(monkeypatch,
                                                                                                  tmp_path):
    """The probe's pass for a toolchain is kept in the user's cache: another checkout with the same cuda.env,
    torch and compiler reads it instead of probing; another compiler probes."""
    from types import SimpleNamespace

    from sam3_aoti.pipeline.paths import ToolchainPaths
    from sam3_aoti.stages import probe

    monkeypatch.setenv("SAM3_AOTI_CACHE", str(tmp_path / "cache"))
    probed = []

    def fake_probe(device, env):
        probed.append(env.get("CXX"))
        return {"ok": True, "seconds": 0.1, "max_abs_diff": 0.0}

    monkeypatch.setattr(probe, "run_probe", fake_probe)

    def build_in(checkout: str) -> dict:
        paths = ToolchainPaths(tmp_path / checkout / "toolchain")
        paths.root.mkdir(parents=True)
        paths.env_file.write_text("export CUDA_HOME=/opt/cuda\n")
        monkeypatch.setattr(probe.ToolchainPaths, "of", classmethod(lambda cls, settings: paths))
        verdict = probe.run(SimpleNamespace(device="cpu"))
        assert json.loads(paths.probe_report.read_text())["ok"] and verdict["ok"]
        return verdict

    build_in("first")
    build_in("second")
    assert len(probed) == 1  # the second checkout read the first one's pass
    monkeypatch.setenv("CXX", "/usr/bin/true")  # another compiler: another key
    build_in("third")
    assert len(probed) == 2


def test_a_fix_the_probe_finds_beside_the_compiles_has_them_compiled_again(monkeypatch, tmp_path):
    """The probe runs once, beside the compiles (model's and the parts', each in a thread as doit runs them);
    when it finds the toolchain broken and a fix (probe.env), each compile that ran without the fix is done
    again with it."""
    import threading

    import tasks

    calls = []
    fix = tasks.ToolchainPaths.of(tasks.SETTINGS).probe_env
    saved = fix.read_text() if fix.exists() else None

    both_started = threading.Event()  # the probe ends after both compiles started without its fix

    def fake_run_stage(name):
        calls.append(name)
        if name == "probe":
            both_started.wait(10)
            fix.parent.mkdir(parents=True, exist_ok=True)
            fix.write_text(f"export CXX=/fixed/g++ # {len(calls)}\n")
        elif {"compile", "compile_parts"} <= set(calls):
            both_started.set()
        return None

    monkeypatch.setattr(tasks, "run_stage", fake_run_stage)
    monkeypatch.setattr(tasks, "PROBED", [])
    results = []
    try:
        compiles = [threading.Thread(target=lambda name=name: results.append(tasks.compile_with_probe(name)))
                    for name in ("compile", "compile_parts")]
        for thread in compiles:
            thread.start()
        for thread in compiles:
            thread.join()
    finally:
        fix.unlink(missing_ok=True)
        if saved is not None:
            fix.write_text(saved)
    assert results == [None, None]
    assert sorted(calls) == ["compile", "compile", "compile_parts", "compile_parts", "probe"]
    assert calls[-1] != "probe"


def test_the_vector_isa_verdict_is_kept_per_machine_and_told_to_inductor(tmp_path, monkeypatch):
    """The first compiling process checks (Inductor's own check, here stubbed) and keeps the verdict; later ones
    skip the check only where every ISA built, and a failed verdict is never turned into a skip."""
    import torch._inductor.config as config

    from sam3_aoti.pipeline import vec_isa

    monkeypatch.setenv("SAM3_AOTI_CACHE", str(tmp_path))
    monkeypatch.setattr(config.cpp, "vec_isa_ok", None)
    monkeypatch.setattr(vec_isa.platform, "machine", lambda: "x86_64")
    checks = []
    for verdict in (False, True):
        monkeypatch.setattr(vec_isa, "_key", lambda: f"machine-{verdict}")
        monkeypatch.setattr(vec_isa, "all_isas_build", lambda: checks.append(verdict) or verdict)
        assert vec_isa.skip_known_isa_check() is False  # checked now, kept
        assert config.cpp.vec_isa_ok is None
        assert vec_isa.skip_known_isa_check() is verdict  # kept: not checked again
        assert config.cpp.vec_isa_ok is (True if verdict else None)
    assert checks == [False, True]
    assert sorted(p.name for p in (tmp_path / "vec-isa").glob("*.json")) == ["machine-False.json", "machine-True.json"]


def test_processes_that_start_together_check_the_vector_isas_once(tmp_path, monkeypatch):
    """Two compiles that start at once (two threads here, each opening the lock as a process would): one checks,
    the other waits for its verdict and skips the check."""
    import threading
    import time

    import torch._inductor.config as config

    from sam3_aoti.pipeline import vec_isa

    monkeypatch.setenv("SAM3_AOTI_CACHE", str(tmp_path))
    monkeypatch.setattr(config.cpp, "vec_isa_ok", None)
    monkeypatch.setattr(vec_isa.platform, "machine", lambda: "x86_64")
    monkeypatch.setattr(vec_isa, "_key", lambda: "machine")
    checks = []
    monkeypatch.setattr(vec_isa, "all_isas_build", lambda: checks.append(1) or time.sleep(0.5) or True)
    skipped = []
    threads = [threading.Thread(target=lambda: skipped.append(vec_isa.skip_known_isa_check())) for _ in range(2)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert checks == [1] and sorted(skipped) == [False, True]


@pytest.mark.slow  # Inductor builds and loads its ISA test libraries
def test_a_skipped_isa_check_picks_the_isa_inductor_would(tmp_path):
    probe = ("import json; import torch._inductor.config as c; from torch._inductor.cpu_vec_isa import pick_vec_isa; "
             "from sam3_aoti.pipeline.vec_isa import skip_known_isa_check; skipped = skip_known_isa_check(); "
             "print(json.dumps([skipped, str(pick_vec_isa()), c.cpp.vec_isa_ok]))")
    env = {**os.environ, "SAM3_AOTI_CACHE": str(tmp_path), "TORCHINDUCTOR_CACHE_DIR": str(tmp_path / "inductor"),
           "PYTHONPATH": str(REPO / "src")}
    first, second = (json.loads(subprocess.run([sys.executable, "-c", probe], env=env, capture_output=True,
                                               text=True, check=True).stdout.splitlines()[-1]) for _ in range(2))
    assert first[0] is False and first[2] is None  # checked the usual way, and kept
    [record] = (tmp_path / "vec-isa").glob("*.json")
    all_build = json.loads(record.read_text())["all_build"]
    assert second[0] is all_build  # skipped only where every ISA the CPU reports built
    assert second[1] == first[1]  # and the same ISA picked
