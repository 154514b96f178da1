"""Which CUDA toolkit AOTInductor builds with, and why.

By default the pinned pip wheels (env/toolchain.toml names the dependency group for torch's CUDA line;
`uv sync` installs them): the same nvcc, headers and CCCL on every machine. The machine's own toolkit
(`CUDA_HOME`, else `nvcc` on `PATH`) only when asked (`toolkit=machine`) or when torch's CUDA line has no
pins. Nothing here installs anything: a build never changes its own environment.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import sysconfig
from dataclasses import dataclass, field
from pathlib import Path

import tomllib

from ..errors import ToolchainError
from ..pipeline.paths import PIN_TABLE

PREFERENCES = ("pinned", "machine")
PIP = "pip wheels"


@dataclass
class Toolkit:
    source: str  # CUDA_HOME | PATH | pip wheels
    home: Path
    version: str | None  # nvcc's "release X.Y"
    missing: list[str] = field(default_factory=list)

    @property
    def nvcc(self) -> Path:
        return self.home / "bin" / "nvcc"


@dataclass
class Choice:
    toolkit: Toolkit | None
    why: str  # why this source was the one looked for
    notes: list[str]  # toolkits passed over, and why
    found: list[Toolkit]  # every toolkit seen, for the doctor


def nvcc_version(nvcc: Path, full: bool = False) -> str | None:
    """nvcc's "release X.Y" (what torch's CUDA must match), or with `full` its build "X.Y.Z"."""
    try:
        out = subprocess.run([str(nvcc), "--version"], capture_output=True, text=True, timeout=60).stdout
    except (OSError, subprocess.TimeoutExpired):
        return None
    m = re.search(r", V(\d+\.\d+\.\d+)" if full else r"release (\d+\.\d+)", out)
    return m.group(1) if m else None


def header_versions(home: Path) -> dict:
    """The CUDA and CCCL versions the toolkit's headers declare (what the compiled wrapper was built against)."""
    def define(rel: str, name: str) -> int | None:
        path = home / "include" / rel
        m = re.search(rf"#define {name} (\d+)", path.read_text(errors="replace")) if path.exists() else None
        return int(m.group(1)) if m else None

    cuda = define("cuda.h", "CUDA_VERSION")
    cccl = define("cccl/cuda/std/__cccl/version.h", "CCCL_VERSION") or define("cuda/std/__cccl/version.h", "CCCL_VERSION")
    return {"CUDA headers": f"{cuda // 1000}.{cuda % 1000 // 10}" if cuda else "-",
            "CCCL": f"{cccl // 1000000}.{cccl // 1000 % 1000}.{cccl % 1000}" if cccl else "-"}


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


def wheel_roots() -> list[Path]:
    """Where installed wheels live, in import order: sys.path's folders (a venv's site-packages, or a
    `pip install --target` folder on PYTHONPATH), then this interpreter's site-packages."""
    roots = [Path(p) for p in sys.path if p and Path(p).is_dir()] + [Path(sysconfig.get_paths()["purelib"])]
    return list(dict.fromkeys(roots))


def wheel_folder(name: str, roots: list[Path]) -> Path | None:
    """site-packages/nvidia/<name>, preferring a copy with nvcc: torch's own runtime wheels share the cu13
    folder name without the compiler."""
    folders = [root / "nvidia" / name for root in roots if (root / "nvidia" / name).is_dir()]
    with_nvcc = [f for f in folders if (f / "bin" / "nvcc").exists()]
    return (with_nvcc or folders or [None])[0]


def pip_toolkit_home(pins: dict, dest: Path, roots: list[Path] | None = None) -> Path | None:
    """The CUDA_HOME the pip wheels make: the cu13 folder as it is, or CUDA 12's components assembled."""
    roots = wheel_roots() if roots is None else roots
    if pins["layout"] == "cu13":
        return wheel_folder("cu13", roots)
    components = [wheel_folder(c, roots) for c in pins["components"]]
    if None in components:
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


def inspect(source: str, home: Path) -> Toolkit:
    return Toolkit(source, home, nvcc_version(home / "bin" / "nvcc"), missing_parts(home))


def machine_toolkits(env: dict) -> list[Toolkit]:
    homes = []
    if env.get("CUDA_HOME"):
        homes.append(("CUDA_HOME", Path(env["CUDA_HOME"])))
    nvcc = shutil.which("nvcc", path=env.get("PATH", ""))
    if nvcc:
        homes.append(("PATH", Path(nvcc).resolve().parent.parent))
    found, seen = [], set()
    for source, home in homes:  # CUDA_HOME first; the PATH nvcc only if it is another toolkit
        if home.resolve() not in seen:
            seen.add(home.resolve())
            found.append(inspect(source, home))
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
                   preference: str = "pinned", roots: list[Path] | None = None) -> Choice:
    """A toolkit for torch's CUDA `want`, by `preference` (see the module doc). Raises when none is found and
    one is `required` (device=cuda); otherwise says why in the notes."""
    machine = machine_toolkits(env)
    home = pip_toolkit_home(pins, scratch / "cuda_home", roots) if pins else None
    pip = [inspect(PIP, home)] if home else []
    if preference == "machine":
        why, candidates = "toolkit=machine: the machine's own toolkit (CUDA_HOME, else nvcc on PATH)", machine
        message = (f"no complete CUDA {want} toolkit (torch's version): set CUDA_HOME to one"
                   + (", or drop toolkit=machine to use the pinned wheels" if pins else ""))
    elif pins:
        why, candidates = (f"pinned wheels (group {pins['group']}) exist for torch's CUDA {want} in env/toolchain.toml; "
                           "toolkit=machine uses the machine's own instead"), pip
        state = "are incomplete or of another version" if pip else "are not installed"
        message = (f"the pinned CUDA {want} toolkit wheels {state}: install them with `uv sync --group "
                   f"{pins['group']}`, or pass toolkit=machine to use the machine's own")
    else:
        why, candidates = f"no pinned wheels for torch's CUDA {want} in env/toolchain.toml: the machine's own toolkit", machine
        message = (f"no complete CUDA {want} toolkit (torch's version): add CUDA {want} to env/toolchain.toml and "
                   "pyproject.toml's dependency groups, or set CUDA_HOME to one")
    toolkit, notes = pick_toolkit(candidates, want)
    if toolkit is None:
        if notes:
            message += f" [{notes[0]}]"
        if required:
            raise ToolchainError(message)
        notes.append(message + " (not needed for device=cpu)")
    return Choice(toolkit, why, notes, pip + machine)


def load_pins(torch_cuda: str) -> dict | None:
    table = tomllib.loads(PIN_TABLE.read_text()).get("cuda", {})
    return table.get(torch_cuda)


def machine_toolkit_matters(preference: str, torch_version: str) -> bool:
    """Whether the machine's CUDA_HOME and nvcc can change the toolchain's result, told without importing torch
    (doit's fingerprint): with toolkit=machine, or when torch's CUDA line (its "+cuXYZ" tag) has no pins or
    cannot be read from the version."""
    if preference == "machine":
        return True
    m = re.search(r"\+cu(\d+)(\d)$", torch_version)
    return m is None or load_pins(f"{m.group(1)}.{m.group(2)}") is None


def loaded_library(prefix: str) -> Path | None:
    """The file of a shared library this process has loaded (e.g. the driver's libcuda.so.1)."""
    try:
        maps = Path("/proc/self/maps").read_text().splitlines()
    except OSError:
        return None
    paths = {line.split()[-1] for line in maps if "/" in line}
    return next((Path(p) for p in sorted(paths) if Path(p).name.startswith(prefix)), None)


def libcuda_link_dir(cxx: str, scratch: Path) -> Path | None:
    """AOTInductor links `-lcuda`; the pip wheels ship no libcuda.so stub, and a driver install often has only
    libcuda.so.1. When the compiler finds no libcuda.so, a folder holding libcuda.so -> the driver's loaded
    library (for LIBRARY_PATH); None when the compiler finds one, or no driver is loaded."""
    found = subprocess.run([cxx, "-print-file-name=libcuda.so"], capture_output=True, text=True).stdout.strip()
    if os.path.isabs(found):
        return None
    driver = loaded_library("libcuda.so")
    if driver is None:
        return None
    link = scratch / "link" / "libcuda.so"
    link.parent.mkdir(parents=True, exist_ok=True)
    link.unlink(missing_ok=True)
    link.symlink_to(driver)
    return link.parent
