"""Stage `toolchain`: a CUDA toolkit AOTInductor can build with, from pip wheels when the machine has none,
and a doctor that proves the whole compile-load-run path with a probe model.

Order of preference: a toolkit already on the machine (`CUDA_HOME`, else `nvcc` on `PATH`) whose
major.minor equals torch's CUDA; else the pinned pip wheels (env/toolchain.toml names the dependency group).
The result is `artifacts/toolchain/cuda.env` (shell-sourceable; every later stage process starts with it,
and compile depends on it: it also names the versions that shape compiled code) and
`artifacts/toolchain/doctor.json`. When the probe fails, known fixes are tried in order and the first
that works goes into `cuda.env` (and from there into the package metadata).
"""

from __future__ import annotations

import json
import logging
import os
import re
import shlex
import shutil
import signal
import subprocess
import sys
import sysconfig
import time
import tomllib
from dataclasses import asdict, dataclass, field
from pathlib import Path

from .artifacts import write_text_atomic
from .config import REPO_ROOT, Settings
from .errors import ToolchainError

log = logging.getLogger("sam3_aoti")

PIN_TABLE = REPO_ROOT / "env" / "toolchain.toml"
FIX_VARIABLE = "SAM3_AOTI_TOOLCHAIN_FIX"


def toolchain_dir(settings: Settings) -> Path:
    return settings.artifacts_root / "toolchain"


def doctor_path(settings: Settings) -> Path:
    return toolchain_dir(settings) / "doctor.json"


def env_file(settings: Settings) -> Path:
    return toolchain_dir(settings) / "cuda.env"


# ---- the env file ---------------------------------------------------------------------------------

def read_env_file(path: Path, base: dict | None = None) -> dict:
    """The `export KEY='VALUE'` lines `write_env_file` makes; `$PATH` expands against `base`."""
    base = dict(os.environ if base is None else base)
    values: dict[str, str] = {}
    if not Path(path).exists():
        return values
    for line in Path(path).read_text().splitlines():
        m = re.match(r"\s*export\s+([A-Za-z_][A-Za-z0-9_]*)=(.*)$", line)
        if m:
            value = "".join(shlex.split(m.group(2)))
            values[m.group(1)] = value.replace("$PATH", base.get("PATH", ""))
    return values


def write_env_file(path: Path, values: dict[str, str], facts: dict | None = None) -> None:
    """`facts` (versions that change compiled code) go in as comments: compile depends on this file."""
    lines = ["# Written by `uv run doit toolchain` (sam3_aoti.toolchain); every later stage starts with it.",
             "# Source it to compile by hand with the same toolkit (. cuda.env). Build facts:"]
    lines += [f"# {key}: {value}" for key, value in (facts or {}).items()]
    for key, value in values.items():
        suffix = '":$PATH"' if key == "PATH" else ""
        lines.append(f"export {key}={shlex.quote(value)}{suffix}")
    write_text_atomic(path, "\n".join(lines) + "\n")


# ---- finding a toolkit ----------------------------------------------------------------------------

@dataclass
class Toolkit:
    source: str  # CUDA_HOME | PATH | pip wheels
    home: Path
    version: str | None  # nvcc's "release X.Y"
    missing: list[str] = field(default_factory=list)

    @property
    def nvcc(self) -> Path:
        return self.home / "bin" / "nvcc"


def nvcc_version(nvcc: Path, full: bool = False) -> str | None:
    """nvcc's "release X.Y" (what torch's CUDA must match), or with `full` its build "X.Y.Z"."""
    try:
        out = subprocess.run([str(nvcc), "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    m = re.search(r", V(\d+\.\d+\.\d+)" if full else r"release (\d+\.\d+)", out)
    return m.group(1) if m else None


def missing_parts(home: Path) -> list[str]:
    """What AOTInductor's CUDA build needs: nvcc, the runtime headers and library, the CCCL headers."""
    checks = {
        "bin/nvcc": [home / "bin" / "nvcc"],
        "include/cuda_runtime.h": [home / "include" / "cuda_runtime.h"],
        "CCCL headers (cuda/std/version)": [home / "include" / "cuda" / "std" / "version",
                                            home / "include" / "cccl" / "cuda" / "std" / "version"],
        "libcudart": [p for d in ("lib", "lib64") for p in (home / d).glob("libcudart.so*")] or [home / "lib/libcudart.so"],
    }
    return [name for name, paths in checks.items() if not any(p.exists() for p in paths)]


def site_packages() -> Path:
    return Path(sysconfig.get_paths()["purelib"])


def pip_toolkit_home(pins: dict, dest: Path) -> Path | None:
    """The CUDA_HOME the pip wheels make: the cu13 folder as it is, or CUDA 12's components assembled."""
    nvidia = site_packages() / "nvidia"
    if pins["layout"] == "cu13":
        home = nvidia / "cu13"
        return home if home.exists() else None
    components = [nvidia / c for c in pins["components"]]
    if not all(c.exists() for c in components):
        return None
    return assemble_home(components, dest)


def assemble_home(components: list[Path], dest: Path) -> Path:
    """One CUDA_HOME from per-component wheel folders: links for headers and libraries, copies for bin/
    (nvcc finds its own tools relative to its real path)."""
    if dest.exists():
        shutil.rmtree(dest)
    for component in components:
        for sub in component.iterdir():
            if not sub.is_dir():
                continue
            target_dir = dest / sub.name
            target_dir.mkdir(parents=True, exist_ok=True)
            for item in sub.iterdir():
                target = target_dir / item.name
                if target.exists() or target.is_symlink():
                    continue
                if sub.name == "bin":
                    (shutil.copytree if item.is_dir() else shutil.copy2)(item, target)
                else:
                    target.symlink_to(item)
    return dest


def find_toolkits(env: dict, pins: dict | None, scratch: Path) -> list[Toolkit]:
    found: list[Toolkit] = []
    homes: list[tuple[str, Path]] = []
    if env.get("CUDA_HOME"):
        homes.append(("CUDA_HOME", Path(env["CUDA_HOME"])))
    nvcc = shutil.which("nvcc", path=env.get("PATH", ""))
    if nvcc:
        homes.append(("PATH", Path(nvcc).resolve().parent.parent))
    if pins:
        home = pip_toolkit_home(pins, scratch / "cuda_home")
        if home:
            homes.append(("pip wheels", home))
    seen = set()
    for source, home in homes:
        if home.resolve() in seen:
            continue
        seen.add(home.resolve())
        found.append(Toolkit(source, home, nvcc_version(home / "bin" / "nvcc"), missing_parts(home)))
    return found


def pick_toolkit(toolkits: list[Toolkit], want: str) -> tuple[Toolkit | None, list[str]]:
    """The first complete toolkit of torch's CUDA major.minor, and why each other one was passed over."""
    notes = []
    for tk in toolkits:
        if tk.version != want:
            notes.append(f"{tk.source} toolkit at {tk.home} is CUDA {tk.version}, torch needs {want}: not used")
        elif tk.missing:
            notes.append(f"{tk.source} toolkit at {tk.home} lacks {', '.join(tk.missing)}: not used")
        else:
            return tk, notes
    return None, notes


def choose_toolkit(want: str, env: dict, scratch: Path, required: bool, pins: dict | None,
                   install: bool = True) -> tuple[Toolkit | None, list[str], list[Toolkit]]:
    """A toolkit for torch's CUDA `want`: on the machine, else from the `pins` wheels (installed if absent).
    Raises when none is found and one is `required` (device=cuda); otherwise says why in the notes."""
    toolkits = find_toolkits(env, pins, scratch)
    toolkit, notes = pick_toolkit(toolkits, want)
    if toolkit is None and pins and install and install_group(pins["group"]):
        toolkits = find_toolkits(env, pins, scratch)
        toolkit, notes = pick_toolkit(toolkits, want)
    if toolkit is None:
        how = (f"`uv sync --group {pins['group']}` (or pip install {' '.join(group_requirements(pins['group']))})"
               if pins else f"add CUDA {want} to env/toolchain.toml and pyproject.toml's dependency groups")
        message = f"no complete CUDA {want} toolkit (torch's version): {how}, or set CUDA_HOME to one"
        if notes:
            message += f" [{notes[0]}]"
        if required:
            raise ToolchainError(message)
        notes.append(message + " (not needed for device=cpu)")
    return toolkit, notes, toolkits


def load_pins(torch_cuda: str) -> dict | None:
    table = tomllib.loads(PIN_TABLE.read_text()).get("cuda", {})
    return table.get(torch_cuda)


def group_requirements(group: str) -> list[str]:
    pyproject = tomllib.loads((REPO_ROOT / "pyproject.toml").read_text())
    return pyproject.get("dependency-groups", {}).get(group, [])


def install_group(group: str) -> bool:
    """Install the pinned wheels into this environment with uv; False where uv or the project is absent."""
    uv = shutil.which("uv")
    if not uv or not (REPO_ROOT / "uv.lock").exists() or sys.prefix == sys.base_prefix:
        return False
    log.info("installing CUDA toolkit wheels: uv sync --inexact --group %s", group)
    proc = subprocess.run([uv, "sync", "--inexact", "--group", group], cwd=REPO_ROOT, capture_output=True, text=True)
    if proc.returncode != 0:
        log.warning("uv sync failed: %s", proc.stderr.strip().splitlines()[-1:] or proc.returncode)
    return proc.returncode == 0


# ---- compiler, driver ------------------------------------------------------------------------------

def cxx_info(env: dict) -> dict:
    cxx = env.get("CXX") or "g++"
    path = shutil.which(cxx, path=env.get("PATH", "")) if not os.path.isabs(cxx) else cxx
    if not path or not os.path.exists(path):
        raise ToolchainError(f"no C++ compiler ({cxx}) found: install one (apt-get install g++) or set CXX=/path/to/g++")
    out = subprocess.run([path, "--version"], capture_output=True, text=True).stdout.splitlines()
    return {"path": path, "version": out[0] if out else "unknown"}


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


# ---- the probe and its fixes -------------------------------------------------------------------------

def run_probe(device: str, env: dict, command: list[str] | None = None, timeout: int = 900) -> dict:
    """The probe in a subprocess: ok, or how it failed (exit code, or the signal that killed it)."""
    command = command or [sys.executable, "-m", "sam3_aoti.probe", "--device", device]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(command, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"ok": False, "failure": f"timed out after {timeout} s", "seconds": timeout}
    result: dict = {"ok": proc.returncode == 0, "seconds": round(time.perf_counter() - t0, 1)}
    if proc.returncode < 0:
        result["failure"] = f"crashed with {signal.Signals(-proc.returncode).name}"
    elif proc.returncode > 0:
        tail = proc.stderr.strip().splitlines()[-1:] or [""]
        result["failure"] = f"exit {proc.returncode}: {tail[0][:300]}"
    else:
        result.update(json.loads(proc.stdout.strip().splitlines()[-1]))
    return result


def regex_free_overlay(dest: Path) -> Path:
    """An include folder, put first on the compiler's path, holding torch's AOTI model_base.h with
    `parse_device_str` rewritten without std::regex (the function the H200 crash was traced to)."""
    import torch

    rel = Path("torch/csrc/inductor/aoti_runtime/model_base.h")
    original = (Path(torch.__file__).parent / "include" / rel).read_text()
    start = original.index("inline void parse_device_str(")
    end = original.index("\n}\n", start) + 3
    replacement = '''inline void parse_device_str(
    const std::string& device_str,
    int32_t& device_type,
    int32_t& device_idx) {
  // sam3-aoti overlay: torch's grammar "(cpu|cuda|xpu|mps)(:([0-9]+))?", parsed by hand
  const auto colon = device_str.find(':');
  const std::string kind = device_str.substr(0, colon);
  if (kind == "cpu") {
    device_type = aoti_torch_device_type_cpu();
  } else if (kind == "cuda") {
    device_type = aoti_torch_device_type_cuda();
#ifdef USE_XPU
  } else if (kind == "xpu") {
    device_type = aoti_torch_device_type_xpu();
#endif
#ifdef USE_MPS
  } else if (kind == "mps") {
    device_type = aoti_torch_device_type_mps();
#endif
  } else {
    AOTI_RUNTIME_CHECK(false, "Invalid device: " + device_str);
  }
  device_idx = -1;
  if (colon != std::string::npos) {
    const std::string index = device_str.substr(colon + 1);
    AOTI_RUNTIME_CHECK(!index.empty() && index.find_first_not_of("0123456789") == std::string::npos,
                       "Invalid device: " + device_str);
    device_idx = std::stoi(index);
  }
}
'''
    target = dest / rel
    target.parent.mkdir(parents=True, exist_ok=True)
    target.write_text(original[:start] + replacement + original[end:])
    return dest


def compiler_wrapper(path: Path, cxx: str, extra: list[str]) -> Path:
    """A `CXX` that is the real compiler with `extra` arguments first (inductor reads CXX at import)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(f'#!/bin/sh\nexec "{cxx}" {" ".join(extra)} "$@"\n')
    path.chmod(0o755)
    return path


def links_libstdcxx_statically(cxx: str, scratch: Path) -> bool:
    """Does this compiler put a private libstdc++ into shared objects (a wrapper adding -static-libstdc++)?

    Such an AOTI wrapper.so carries its own std::locale machinery while some of std::regex's statics bind
    to torch's libraries (shared libstdc++): the mix crashes in parse_device_str's std::regex on load.
    """
    scratch.mkdir(parents=True, exist_ok=True)
    source, lib = scratch / "libstdcxx_check.cpp", scratch / "libstdcxx_check.so"
    source.write_text("#include <string>\nstd::string f(int i) { return std::to_string(i); }\n")
    built = subprocess.run([cxx, "-shared", "-fPIC", str(source), "-o", str(lib)], capture_output=True)
    if built.returncode != 0:
        return False
    needed = subprocess.run(["readelf", "-d", str(lib)], capture_output=True, text=True).stdout
    return "libstdc++" not in needed


def shared_libstdcxx_compilers(cxx: str, scratch: Path) -> list[str]:
    """Other g++ on this machine that link the shared libstdc++ (same family: system g++, g++-N)."""
    current = os.path.realpath(cxx)
    names = [shutil.which("g++", path="/usr/bin:/bin"), "/usr/bin/c++"] + sorted(map(str, Path("/usr/bin").glob("g++-[0-9]*")))
    found = []
    for name in names:
        if name and os.path.exists(name) and os.path.realpath(name) != current and name not in found:
            if not links_libstdcxx_statically(name, scratch):
                found.append(name)
    return found


def candidate_fixes(scratch: Path, cxx: str) -> list[tuple[str, dict]]:
    """Fixes for a probe that compiles but crashes on load, least invasive first: a compiler of the
    machine's that links libstdc++ shared (when the configured one links it statically), then an include
    overlay that takes std::regex out of the load path."""
    fixes = []
    if links_libstdcxx_statically(cxx, scratch):
        fixes += [(f"compiler linking libstdc++ shared: {c}", {"CXX": c}) for c in shared_libstdcxx_compilers(cxx, scratch)[:1]]
    overlay = regex_free_overlay(scratch / "include-overlay")
    overlaid = compiler_wrapper(scratch / "cxx-overlay", cxx, [f"-I{overlay}"])
    fixes.append(("regex-free parse_device_str", {"CXX": str(overlaid)}))
    return fixes


# ---- the stage ---------------------------------------------------------------------------------------

def machine_env(environ) -> dict:
    """The environment without what a sourced env/cuda.env adds for its fix (the marker and its CXX): the
    probe must judge the machine's own compiler, or the next env file would lose the fix."""
    env = {k: v for k, v in environ.items() if k != FIX_VARIABLE}
    if FIX_VARIABLE in environ:
        env.pop("CXX", None)
    return env


def run(settings: Settings) -> dict:
    import torch

    scratch = toolchain_dir(settings)
    scratch.mkdir(parents=True, exist_ok=True)
    base_env = machine_env(os.environ)
    report: dict = {"device": settings.device, "torch": torch.__version__, "torch_cuda": torch.version.cuda,
                    "python": sys.version.split()[0], "notes": []}
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
        toolkit, notes, toolkits = choose_toolkit(want, base_env, scratch, settings.device == "cuda",
                                                  load_pins(want))
        report["notes"] += notes
        report["toolkits"] = [{**asdict(t), "home": str(t.home)} for t in toolkits]
        if toolkit:
            report["toolkit"] = {"source": toolkit.source, "home": str(toolkit.home), "nvcc": str(toolkit.nvcc),
                                 "version": toolkit.version, "release": nvcc_version(toolkit.nvcc, full=True)}
            env_values = {"CUDA_HOME": str(toolkit.home), "PATH": str(toolkit.home / "bin")}
            log.info("CUDA %s toolkit from %s: %s", toolkit.version, toolkit.source, toolkit.home)

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
                log.info("fix '%s' works: recorded in %s", name, env_file(settings))
                env_values.update(extra, **{FIX_VARIABLE: name})
                report["fix"] = name
                break
        else:
            report["verdict"] = "broken"
            write_report(settings, report)
            raise ToolchainError(f"the AOTI probe {probe['failure']} on {settings.device} and no known fix helps; "
                                 f"see {doctor_path(settings)}")
    report["verdict"] = "ok" if not report.get("fix") else f"ok with fix: {report['fix']}"
    write_env_file(env_file(settings), env_values, build_facts(report))
    write_report(settings, report)
    return report


def build_facts(report: dict) -> dict:
    """What can change the code AOTInductor writes, besides the graph: no paths, no timings."""
    from .config import package_version

    gpu, toolkit = report.get("gpu", {}), report.get("toolkit", {})
    return {"torch": report["torch"], "triton": package_version("triton"), "C++ compiler": report["cxx"]["version"],
            "nvcc": toolkit.get("release", toolkit.get("version", "-")),
            "GPU": f"{gpu.get('gpu', '-')} (cc {gpu.get('compute_capability', '-')})"}


def read_env_from(values: dict, base: dict) -> dict:
    """What the env file would set, without writing it (PATH prepends included)."""
    return {k: (f"{v}{os.pathsep}{base.get('PATH', '')}" if k == "PATH" else v) for k, v in values.items()}


def write_report(settings: Settings, report: dict) -> None:
    write_text_atomic(doctor_path(settings), json.dumps(report, indent=2) + "\n")
    gpu, tk = report.get("gpu", {}), report.get("toolkit", {})
    rows = [
        ("driver", gpu.get("driver", "-")),
        ("GPU", f"{gpu.get('gpu', '-')} (cc {gpu.get('compute_capability', '-')})"),
        ("torch", f"{report['torch']} (CUDA {report['torch_cuda']})"),
        ("nvcc", f"{tk.get('nvcc', '-')} ({tk.get('version', '-')}, from {tk.get('source', '-')})"),
        ("headers", "complete" if tk else "-"),
        ("C++ compiler", f"{report['cxx']['path']}: {report['cxx']['version']}"),
        ("probe", "ok" if report["probe"]["ok"] else report["probe"]["failure"]),
        ("verdict", report["verdict"]),
    ]
    for note in report["notes"]:
        log.info("note: %s", note)
    for key, value in rows:
        log.info("%-13s %s", key, value)


if __name__ == "__main__":
    from .stage import main

    main("toolchain", run, __doc__.splitlines()[0])
