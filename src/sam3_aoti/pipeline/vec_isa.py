"""Inductor's check of the CPU's vector ISAs, done once per machine instead of once per compiling process.

Before it writes C++, Inductor checks each vector ISA the CPU reports (AVX2, AVX-512, ...): it builds a test
library and loads it in a `python -c "import torch"` subprocess, about 10 s a process on 2 cores, in every process
that compiles (a compile worker per model, bench's parts, tune), CUDA builds included (the wrapper is C++). The
verdict depends only on torch, the C++ compiler and the CPU, so the first process keeps it in the user's cache
(`vec-isa/KEY.json`) and later ones tell Inductor (`cpp.vec_isa_ok`): where every ISA the CPU reports built,
the check is skipped; where one did not, Inductor checks again as it always does. Processes that start together
(a build's compile workers, two builds side by side) wait for the one that checks, under a lock, instead of each
checking: on 2 cores each check took its 10 s from the others.
"""

from __future__ import annotations

import hashlib
import json
import os
import platform
import sys
from pathlib import Path

from ..runtime.files import write_text_atomic
from ..runtime.scratch import cache_dir


def compiler_identity() -> str:
    """The C++ compiler Inductor will run ($CXX, else g++): its path, size and mtime (a new compiler is a new
    file)."""
    import shutil

    cxx = os.environ.get("CXX") or "g++"
    compiler = shutil.which(cxx) or cxx
    try:
        st = os.stat(compiler)
        compiler += f" {st.st_size} {st.st_mtime_ns}"
    except OSError:
        pass
    return compiler


def _key() -> str:
    """torch, the interpreter, the C++ compiler and the CPU's flags."""
    import torch

    compiler = compiler_identity()
    flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "") \
        if Path("/proc/cpuinfo").exists() else platform.processor()
    text = f"{torch.__version__} {sys.executable} {compiler} {flags}"
    return hashlib.sha256(text.encode()).hexdigest()[:24]


def all_isas_build() -> bool:
    """Whether every vector ISA the CPU reports builds and loads here (Inductor's own check, on an x86 CPU)."""
    from torch._inductor import cpu_vec_isa

    reported = [isa for isa in cpu_vec_isa.supported_vec_isa_list
                if all(flag in cpu_vec_isa.x86_isa_checker() for flag in str(isa).split())]
    return [str(isa) for isa in cpu_vec_isa.valid_vec_isa_list()] == [str(isa) for isa in reported]


def skip_known_isa_check() -> bool:
    """Tell Inductor the ISAs build where this machine found so before; else check them now (Inductor's way) and
    keep the verdict. Returns whether the check was skipped. x86 only: elsewhere Inductor checks nothing costly."""
    if platform.machine() not in ("x86_64", "AMD64"):
        return False
    import torch._inductor.config as config

    record = cache_dir() / "vec-isa" / f"{_key()}.json"
    if _verdict(record) is None and not _check_once(record):
        return False  # checked here, now (Inductor keeps the result for this process)
    if _verdict(record) is True:
        config.cpp.vec_isa_ok = True
        return True
    return False


def _verdict(record: Path) -> bool | None:
    try:
        return json.loads(record.read_text()).get("all_build")
    except (OSError, ValueError, AttributeError):
        return None


def _check_once(record: Path) -> bool:
    """Check and keep the verdict, unless another process did while this one waited for the lock; returns whether
    the verdict came from another process. A cache it cannot write: every process checks, as Inductor does."""
    import fcntl

    try:
        record.parent.mkdir(parents=True, exist_ok=True)
        with open(record.with_suffix(".lock"), "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            if _verdict(record) is not None:
                return True
            write_text_atomic(record, json.dumps({"all_build": all_isas_build()}) + "\n")
    except OSError:
        pass
    return False
