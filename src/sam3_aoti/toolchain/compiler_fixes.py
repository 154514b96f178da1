"""The C++ compiler AOTInductor builds with, the probe that proves compile-load-run in a subprocess, and
the known fixes for a probe that compiles but crashes on load (seen on the H200 image)."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from ..errors import ToolchainError


def cxx_info(env: dict) -> dict:
    cxx = env.get("CXX") or "g++"
    path = shutil.which(cxx, path=env.get("PATH", "")) if not os.path.isabs(cxx) else cxx
    if not path or not os.path.exists(path):
        raise ToolchainError(f"no C++ compiler ({cxx}) found: install one (apt-get install g++) or set CXX=/path/to/g++")
    out = subprocess.run([path, "--version"], capture_output=True, text=True).stdout.splitlines()
    return {"path": path, "version": out[0] if out else "unknown"}


def run_probe(device: str, env: dict, command: list[str] | None = None, timeout: int = 900) -> dict:
    """The probe in a subprocess: ok, or how it failed (exit code, or the signal that killed it)."""
    command = command or [sys.executable, "-m", "sam3_aoti.toolchain.probe", "--device", device]
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
