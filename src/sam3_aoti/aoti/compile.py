"""AOTInductor compiles that hold no weights: the options, the compile itself with its phase timings, and the
checks that the package stage can rebuild the weights blob from any checkpoint of the same architecture."""

from __future__ import annotations

import platform
import re
import shutil
import time
from pathlib import Path
from typing import NamedTuple

from ..errors import CompileError, first_line
from ..pipeline.vec_isa import skip_known_isa_check
from ..runtime.archive import BLOB_SUFFIX, PART_NAMES, archive_entries

# Weights outside the shared object, in the blob AOTInductor's own package loader reads (C++ and Python
# alike); no tensor constant folded into generated code, so the code is independent of weight values.
AOTI_OPTIONS = {
    "aot_inductor.package": True,
    "aot_inductor.package_constants_in_so": False,
    "aot_inductor.package_constants_on_disk_format": "binary_blob",
    "always_keep_tensor_constants": True,
}



SDPA_BACKENDS = {"cudnn": "CUDNN_ATTENTION", "flash": "FLASH_ATTENTION", "efficient": "EFFICIENT_ATTENTION",
                 "math": "MATH"}


def sdpa_priority(names: list[str]):
    """A context in which SDPA tries the kernels in `names`' order. The exported program keeps SDPA as one
    op; AOTInductor picks its kernel while it compiles, so this order is what the package runs."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    return sdpa_kernel([getattr(SDPBackend, SDPA_BACKENDS[n]) for n in names], set_priority=True)


class Compiled(NamedTuple):
    files: list[str]  # AOTInductor's files (the weights blob among them)
    seconds: float
    phases: dict[str, float]  # Inductor's own phase timers (`_phases`)


def check_inductor_options(options: dict, where: str) -> None:
    """Every key of an `inductor` table is a torch._inductor.config name (dotted for nested ones): a misspelt one
    would be ignored by Inductor, silently."""
    import difflib

    import torch._inductor.config as inductor_config

    from ..errors import ConfigError

    known = inductor_config.get_config_copy()
    for key in options:
        if key not in known:
            close = difflib.get_close_matches(key, list(known), n=1, cutoff=0.6)
            hint = f"did you mean `{close[0]}`?" if close else "see torch._inductor.config"
            raise ConfigError(f"pipeline.toml {where}: `{key}` is no torch._inductor.config option of torch "
                              f"{__import__('torch').__version__}: {hint}")


def aoti_compile(program, options: dict, sdpa_backends: list[str] | None = None) -> Compiled:
    """AOTInductor's files for one exported program, with how long it took and where the time went."""
    import contextlib

    import torch
    from torch._dynamo.utils import compilation_time_metrics

    compilation_time_metrics.clear()  # the phases of this compile only
    t0 = time.perf_counter()
    skip_known_isa_check()
    try:
        gm = program.module(check_guards=False)
    except TypeError:  # torch 2.10 has no check_guards
        gm = program.module()
    args, kwargs = program.example_inputs
    with sdpa_priority(sdpa_backends) if sdpa_backends else contextlib.nullcontext():
        files = torch._inductor.aot_compile(gm, args, kwargs, options={**options, **AOTI_OPTIONS})
    return Compiled(files, round(time.perf_counter() - t0, 1), _phases(compilation_time_metrics))


def program_sizes(archive: Path) -> dict[str, int]:
    """Each exported program's name in the archive and the bytes of its serialized graph, from the listing alone."""
    import zipfile

    with zipfile.ZipFile(archive) as zf:
        return {inner.removeprefix("models/").removesuffix(".json"): zf.getinfo(name).file_size
                for inner, name in archive_entries(zf).items() if inner.startswith("models/") and inner.endswith(".json")}


def program_names(archive: Path) -> list[str]:
    """The exported programs' names in the archive, from its listing alone."""
    return list(program_sizes(archive))


def submission_order(names: list[str], sizes: dict[str, int]) -> list[str]:
    """The order compile workers take the programs in: `model` first (the longest compile), then the largest
    graphs first, so that no long compile starts last while the other workers idle (in the listing's order the
    tiny build's decode, its second longest, started last on 2 cores)."""
    rest = sorted((n for n in names if n != "model"), key=lambda n: -sizes.get(n, 0))
    return ["model", *rest] if "model" in names else rest


def compiled_names(programs, expected: tuple[str, ...]) -> list[str]:
    """The exported programs of an archive to compile, `model` first: exactly the `expected` ones (`MODEL_NAMES` in
    the export's archive, `PART_NAMES` in the parts')."""
    names = [n for n in ("model", *PART_NAMES, "transforms") if n in programs]
    if set(programs) != set(expected):
        stage = "export_parts" if set(expected) == set(PART_NAMES) else "export"
        raise CompileError(f"the exported programs are {sorted(programs)}, not {sorted(expected)}: run `uv run doit "
                           f"{stage}` again")
    return names


def load_program(archive: Path, name: str):
    """One exported program of a PT2 archive (20 s for the tiny model's five on a CPU if all were read), with the
    project's ops registered first: the programs call them."""
    from ..runtime import attention, box_bias, fp8_linear  # noqa: F401  (the sam3_aoti ops programs call)
    from ..runtime.torch_private import exported_program

    return exported_program(archive, name)


def compile_program(exported: str, name: str, options: dict, sdpa_backends: list[str] | None, dest: str):
    """A worker of the `compile` stage (its own process): AOT-compile one program of the exported archive
    and keep its files in `dest`. Returns (its entry of the compile index, seconds, phases). The options are
    checked here, not in the parent, which so starts every worker before it imports torch."""
    check_inductor_options(options, "[compile] inductor")
    program = load_program(Path(exported), name)
    try:
        compiled = aoti_compile(program, options, sdpa_backends)
    except Exception as e:
        raise CompileError(f"AOTInductor failed on {name}: {first_line(e)} "
                           "(run `uv run doit toolchain` to check the compiler setup)") from e
    return keep_compiled(name, compiled.files, Path(exported), Path(dest)), compiled.seconds, compiled.phases


def _phases(metrics: dict, least_seconds: float = 1.0) -> dict[str, float]:
    """Seconds of each of Inductor's `dynamo_timed` regions (nested: lowering in `GraphLowering.run`, Triton
    kernels awaited in `async_compile.wait`, the C++ build in `AotCodeCompiler.compile`), longest first;
    passes and phases under `least_seconds` left out."""
    phases = {k: round(sum(v), 1) for k, v in metrics.items() if not k.startswith("pass.") and sum(v) >= least_seconds}
    return dict(sorted(phases.items(), key=lambda kv: -kv[1]))


_CONSTANT_FIELD = re.compile(r"constants_info_\[(\d+)\]\.(name|original_fqn|data_size|from_folded|device_type|dtype|"
                             r"offset|shape|stride|layout) = (.+);")


def constants_table(wrapper_cpp: str) -> list[dict]:
    """The blob's layout as the generated wrapper declares it: constants in order, each with the exported
    program's name for it (`original_fqn`), its byte size and device, and the tensor its bytes make (dtype, shape,
    stride, storage offset; `strided` false for another layout), which the loader builds from the package's
    bytes (`runtime.constants`)."""
    table: dict[int, dict] = {}
    for index, key, value in _CONSTANT_FIELD.findall(wrapper_cpp):
        table.setdefault(int(index), {})[key] = value.strip('"')
    rows = [table[i] for i in sorted(table)]

    def numbers(braced: str) -> list[int]:
        return [int(n) for n in braced.strip("{}").replace(" ", "").split(",") if n]

    return [{"name": r["name"], "fqn": r.get("original_fqn", ""), "bytes": int(r["data_size"]),
             "folded": r["from_folded"] == "true", "cuda": r["device_type"].endswith("_cuda"),
             "dtype": r.get("dtype", "").removeprefix("cached_torch_dtype_"), "shape": numbers(r.get("shape", "")),
             "stride": numbers(r.get("stride", "")), "offset": int(r.get("offset", 0)),
             "strided": "layout_strided" in r.get("layout", "")} for r in rows]


def platform_info(device: str) -> dict:
    import torch

    info = {
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "machine": platform.machine(),
    }
    try:
        import triton

        info["triton"] = triton.__version__
    except ImportError:
        info["triton"] = None
    if device == "cuda":
        props = torch.cuda.get_device_properties(0)
        info.update(gpu=props.name, compute_capability=f"{props.major}.{props.minor}")
    return info


def check_constants_are_weights(name: str, constants: list[dict], exported: Path) -> None:
    """Every constant the compiled code reads must be a tensor of the exported program: one that Inductor
    derived from the weights (a GEMM template that packs them, as max-autotune's CPU templates do) would be
    missing from a package built from new weights."""
    import zipfile

    from .weights_blob import tensor_entries

    with zipfile.ZipFile(exported) as archive:
        known = tensor_entries(archive, name)
    derived = [c["fqn"] or c["name"] for c in constants if not c["folded"] and c["fqn"] not in known]
    if derived:
        raise CompileError(f"AOTInductor's code for {name} reads {len(derived)} tensors the exported program does "
                           f"not hold ({', '.join(derived[:3])}...): they are derived from the weights, so a new "
                           "checkpoint could not be packaged without recompiling; compile without the option that "
                           "makes them ([compile] or [tune] inductor)")


def compiled_outputs(name: str, files: list[str]) -> tuple[list[Path], Path, list[dict]]:
    """One model's AOTInductor files: all of them, its weights blob, and the constants its wrapper reads."""
    paths = [Path(f) for f in files if isinstance(f, str) and f]
    blobs = [p for p in paths if p.name.endswith(BLOB_SUFFIX)]
    wrappers = [p for p in paths if p.name.endswith(".wrapper.cpp")]
    if len(blobs) != 1 or len(wrappers) != 1:
        raise CompileError(f"AOTInductor gave {name} {len(blobs)} weight blobs and {len(wrappers)} wrappers, "
                           "expected one of each: this torch version packages weights differently")
    return paths, blobs[0], constants_table(wrappers[0].read_text())


def keep_compiled(name: str, files: list[str], exported: Path, dest: Path) -> dict:
    """Copy one model's compiled files (all but the blob) to `dest`, and check that the package stage's
    blob writer reproduces AOTInductor's blob byte for byte from the exported archive."""
    from .weights_blob import blob_matches

    paths, blob, constants = compiled_outputs(name, files)
    check_constants_are_weights(name, constants, exported)
    dest.mkdir(parents=True)
    for p in paths:
        if p != blob:
            shutil.copy2(p, dest / p.name)
    entry = {"files": sorted(p.name for p in paths if p != blob), "blob": blob.name,
             "constants": constants, "blob_bytes": blob.stat().st_size}
    if not blob_matches(exported, name, entry, blob):
        raise CompileError(f"the weights blob rebuilt for {name} differs from AOTInductor's: re-packaging new "
                           "weights would be wrong with this torch version")
    return entry
