"""The PT2 archive: write it, and load it with nothing but torch.

One archive holds the AOTI models `model` and `transforms`, the same two as exported programs (the
fallback), `metadata.json` and the tokenizer's merges. `load_package` returns callables by name, AOTI
runners first, exported programs second.
"""

from __future__ import annotations

import json
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

import torch

from .errors import PackageError, first_line

METADATA_FILE = "metadata.json"
VOCAB_FILE = "tokenizer/bpe_simple_vocab_16e6.txt"
MODEL_NAMES = ("model", "transforms")

log = logging.getLogger("sam3_aoti")


def write_package(path: Path, exported: dict, aoti_files: dict, metadata: dict, merges_text: str) -> None:
    from torch.export.pt2_archive._package import package_pt2

    package_pt2(
        str(path),
        exported_programs=exported,
        aoti_files=aoti_files,
        extra_files={METADATA_FILE: json.dumps(metadata, indent=2, sort_keys=True), VOCAB_FILE: merges_text},
    )


@dataclass
class Sam3Package:
    runners: dict[str, Callable]
    backends: dict[str, str]  # name -> "aoti" | "exported"
    metadata: dict
    merges_text: str
    fallback_reason: str | None = None
    exported: dict = field(default_factory=dict, repr=False)

    def exported_only(self) -> "Sam3Package":
        """The same package through its exported programs (the fallback path), without reloading it."""
        runners = {name: program.module() for name, program in self.exported.items()}
        return Sam3Package(runners, {name: "exported" for name in runners}, self.metadata, self.merges_text,
                           self.fallback_reason, self.exported)

    def __getitem__(self, name: str) -> Callable:
        return self.runners[name]

    @property
    def model(self) -> Callable:
        return self.runners["model"]

    @property
    def transforms(self) -> Callable:
        return self.runners["transforms"]

    def encode_prompts(self, prompts: list[str]) -> torch.Tensor:
        from .tokenizer import encode_prompts

        return encode_prompts(prompts, self.merges_text)


class _ContiguousInputs:
    """AOTI runners read inputs as dense row-major memory; a permuted view (an HWC image turned CHW)
    would be read wrongly without a word. Exported programs need no such care."""

    def __init__(self, runner: Callable):
        self.runner = runner

    def __call__(self, *args):
        return self.runner(*(a.contiguous() for a in args))


def _read_exported_programs(path: Path) -> tuple[dict, dict]:
    """Exported programs and extra files only: the fallback when the AOTI part cannot load."""
    from torch.export.pt2_archive._package import (
        PT2ArchiveReader,
        _load_exported_programs,
        _load_extra_files,
    )

    with PT2ArchiveReader(str(path)) as reader:
        names = reader.get_file_names()
        return _load_exported_programs(reader, names, None), _load_extra_files(reader, names)


def load_package(path: str | Path, prefer_aoti: bool = True) -> Sam3Package:
    """Callables by name: AOTI runners where they load, the exported programs otherwise."""
    import torch._inductor.codecache  # noqa: F401  (torch 2.10 needs it before loading AOTI packages)
    from torch.export.pt2_archive._package import load_pt2

    path = Path(path)
    if not path.is_file():
        raise PackageError(f"no package at {path}: build it with `uv run doit compile`")
    fallback_reason = None
    aoti: dict = {}
    if prefer_aoti:
        try:
            contents = load_pt2(str(path))
            aoti, exported, extra = contents.aoti_runners, contents.exported_programs, contents.extra_files
        except Exception as e:  # a package built for another device/ABI: use the exported programs
            fallback_reason = first_line(e)
            log.warning("AOTI models of %s did not load (%s); using exported programs", path.name, fallback_reason)
    if not aoti:
        exported, extra = _read_exported_programs(path)
    runners, backends = {}, {}
    for name in MODEL_NAMES:
        if name in aoti:
            runners[name], backends[name] = _ContiguousInputs(aoti[name]), "aoti"
        elif name in exported:
            runners[name], backends[name] = exported[name].module(), "exported"
    missing = [n for n in MODEL_NAMES if n not in runners]
    if missing:
        raise PackageError(f"{path} holds no {', '.join(missing)} model: rebuild it with `uv run doit compile`")
    return Sam3Package(runners, backends, json.loads(extra.get(METADATA_FILE, "{}")), extra.get(VOCAB_FILE, ""),
                       fallback_reason, {n: exported[n] for n in MODEL_NAMES if n in exported})
