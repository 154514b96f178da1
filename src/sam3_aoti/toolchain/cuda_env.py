"""`artifacts/toolchain/cuda.env`: the toolkit, a fix if one was needed, and the versions that shape compiled
code. Every later stage process starts with it, compile depends on it as a file, and a user can source it to
compile by hand with the same toolkit. Imports no torch (doit reads it)."""

from __future__ import annotations

import os
import re
import shlex
from pathlib import Path

from ..pipeline.paths import ROOT_VARIABLE, portable, resolve_portable
from ..runtime.files import write_text_atomic

FIX_VARIABLE = "SAM3_AOTI_TOOLCHAIN_FIX"
FACTS_HEADER = "# Source it to compile by hand with the same toolkit (. cuda.env). Build facts:"


def read_env_file(path: Path, base: dict | None = None) -> dict:
    """The `export KEY='VALUE'` lines `write_env_file` makes; `$PATH` expands against `base`."""
    base = dict(os.environ if base is None else base)
    values: dict[str, str] = {}
    if not Path(path).exists():
        return values
    for line in Path(path).read_text().splitlines():
        m = re.match(r"\s*export\s+([A-Za-z_][A-Za-z0-9_]*)=(.*)$", line)
        if m:
            value = resolve_portable("".join(shlex.split(m.group(2))))
            values[m.group(1)] = value.replace("$PATH", base.get("PATH", ""))
    return values


def read_build_facts(path: Path) -> dict:
    """The `# key: value` build facts `write_env_file` put in (what the package metadata records)."""
    if not Path(path).exists():
        return {}
    lines = Path(path).read_text().splitlines()
    start = lines.index(FACTS_HEADER) + 1 if FACTS_HEADER in lines else len(lines)
    facts = {}
    for line in lines[start:]:
        if not line.startswith("# "):
            break
        key, _, value = line[2:].partition(": ")
        facts[key] = value
    return facts


def compiler_setup(env_file: Path) -> dict:
    """The compiler setup a compile runs with (this process's variables, the toolchain's facts), as its index
    records it."""
    return {**{k: portable(os.environ.get(k)) for k in ("CUDA_HOME", "CXX", FIX_VARIABLE)},
            "build": read_build_facts(env_file)}


def _shell(value: str) -> str:
    """The value quoted for a shell, with the checkout's prefix left to `$SAM3_AOTI_ROOT`."""
    portable_value = portable(value)
    if portable_value == value:
        return shlex.quote(value)
    rest = portable_value[len(ROOT_VARIABLE) + 1:]
    return f'"${ROOT_VARIABLE}"' + (shlex.quote(rest) if rest else "")


def write_env_file(path: Path, values: dict[str, str], facts: dict | None = None) -> None:
    """`facts` (versions that change compiled code) go in as comments: compile depends on this file."""
    lines = ["# Written by `uv run doit toolchain` (sam3_aoti.stages.toolchain); every later stage starts with it.",
             FACTS_HEADER]
    lines += [f"# {key}: {value}" for key, value in (facts or {}).items()]
    # Paths in the checkout are written relative to it: a copied checkout's file names its own toolkit.
    lines.append(f': "${{{ROOT_VARIABLE}:=$(cd "$(dirname "${{BASH_SOURCE[0]:-$0}}")/../.." && pwd)}}"')
    for key, value in values.items():
        suffix = '":$PATH"' if key == "PATH" else ""
        lines.append(f"export {key}={_shell(value)}{suffix}")
    write_text_atomic(path, "\n".join(lines) + "\n")
