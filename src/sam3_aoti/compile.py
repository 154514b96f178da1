"""Stage `compile`: AOTInductor-compile both exported programs into code that holds no weights.

The compiled files depend on the program digest (graphs, signatures, weight layouts), never on the
weights' values: every tensor stays a constant of the model (none is inlined into a kernel) and the
constants live in a separate blob, which the `package` stage rebuilds from whatever weights the exported
programs hold. A new seed or checkpoint of the same architecture so re-packages in seconds, without
running AOTInductor again.
"""

from __future__ import annotations

import json
import logging
import os
import platform
import re
import shutil
import time
from pathlib import Path
from typing import NamedTuple

from .artifacts import atomic_output, check_free_space, human_size, record, sha256
from .config import Settings
from .cuda_env import FIX_VARIABLE, env_file, read_build_facts
from .errors import CompileError, first_line
from .paths import ProfilePaths

log = logging.getLogger("sam3_aoti")

# Weights outside the shared object, in the blob AOTInductor's own package loader reads (C++ and Python
# alike); no tensor constant folded into generated code, so the code is independent of weight values.
AOTI_OPTIONS = {
    "aot_inductor.package": True,
    "aot_inductor.package_constants_in_so": False,
    "aot_inductor.package_constants_on_disk_format": "binary_blob",
    "always_keep_tensor_constants": True,
}
BLOB_SUFFIX = "_weights.blob"


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


def aoti_compile(program, options: dict, sdpa_backends: list[str] | None = None) -> Compiled:
    """AOTInductor's files for one exported program, with how long it took and where the time went."""
    import contextlib

    import torch
    from torch._dynamo.utils import compilation_time_metrics

    compilation_time_metrics.clear()  # the phases of this compile only
    t0 = time.perf_counter()
    try:
        gm = program.module(check_guards=False)
    except TypeError:  # torch 2.10 has no check_guards
        gm = program.module()
    args, kwargs = program.example_inputs
    with sdpa_priority(sdpa_backends) if sdpa_backends else contextlib.nullcontext():
        files = torch._inductor.aot_compile(gm, args, kwargs, options={**options, **AOTI_OPTIONS})
    return Compiled(files, round(time.perf_counter() - t0, 1), _phases(compilation_time_metrics))


def _phases(metrics: dict, least_seconds: float = 1.0) -> dict[str, float]:
    """Seconds of each of Inductor's `dynamo_timed` regions (nested: lowering in `GraphLowering.run`, Triton
    kernels awaited in `async_compile.wait`, the C++ build in `AotCodeCompiler.compile`), longest first;
    passes and phases under `least_seconds` left out."""
    phases = {k: round(sum(v), 1) for k, v in metrics.items() if not k.startswith("pass.") and sum(v) >= least_seconds}
    return dict(sorted(phases.items(), key=lambda kv: -kv[1]))


_CONSTANT_FIELD = re.compile(r"constants_info_\[(\d+)\]\.(name|original_fqn|data_size|from_folded|device_type) = (.+);")


def constants_table(wrapper_cpp: str) -> list[dict]:
    """The blob's layout as the generated wrapper declares it: constants in order, each with the exported
    program's name for it (`original_fqn`), its byte size and device."""
    table: dict[int, dict] = {}
    for index, key, value in _CONSTANT_FIELD.findall(wrapper_cpp):
        table.setdefault(int(index), {})[key] = value.strip('"')
    rows = [table[i] for i in sorted(table)]
    return [{"name": r["name"], "fqn": r.get("original_fqn", ""), "bytes": int(r["data_size"]),
             "folded": r["from_folded"] == "true", "cuda": r["device_type"].endswith("_cuda")} for r in rows]


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
    from .weights_blob import write_weights_blob

    paths, blob, constants = compiled_outputs(name, files)
    check_constants_are_weights(name, constants, exported)
    dest.mkdir(parents=True)
    for p in paths:
        if p != blob:
            shutil.copy2(p, dest / p.name)
    entry = {"files": sorted(p.name for p in paths if p != blob), "blob": blob.name,
             "constants": constants, "blob_bytes": blob.stat().st_size}
    rebuilt = dest.parent / f".{name}.check.blob"
    try:
        write_weights_blob(exported, name, entry, rebuilt)
        if sha256(rebuilt) != sha256(blob):
            raise CompileError(f"the weights blob rebuilt for {name} differs from AOTInductor's: re-packaging new "
                               "weights would be wrong with this torch version")
    finally:
        rebuilt.unlink(missing_ok=True)
    return entry


def run(settings: Settings) -> None:
    from torch.export.pt2_archive._package import load_pt2

    from torch._inductor.runtime.cache_dir_utils import cache_dir

    paths = ProfilePaths.of(settings)
    weights = paths.exported.stat().st_size  # about the weights' size: the exported programs are mostly that
    # AOTInductor writes its blob and code in its cache; `keep_compiled` rebuilds the blob here to check it.
    cache = Path(cache_dir())
    check_free_space({cache: int(1.2 * weights), paths.root: int(1.1 * weights)}, "compile")
    inductor = dict(settings.stage("compile").get("inductor", {}))
    sdpa_backends = settings.stage("compile")["sdpa_backends"] if settings.device == "cuda" else None
    digest = json.loads(paths.program_digest.read_text())
    platform = platform_info(settings.device)
    tuning = None
    if settings.tuned:  # the tune stage's decisions into this compile's cache: it benchmarks nothing
        from .tune import count_decisions, read_tuning, seed, tuning_key, tuning_options

        inductor = tuning_options(settings)
        tuned = read_tuning(paths, tuning_key(settings, digest["sha256"], platform))
        seeded = seed(paths.tuning / "results", cache)
        before = count_decisions(cache)
        log.info("tuned compile: %d tuning files from %s (%d GEMM layouts, %d kernel configs)", seeded,
                 paths.tuning, tuned["gemm_layouts"], tuned["kernel_configs"])
    programs = load_pt2(str(paths.exported)).exported_programs
    index = {"program_sha256": digest["sha256"], "inductor_options": inductor, "sdpa_backends": sdpa_backends,
             "platform": platform, "models": {}, "compile_seconds": {}, "compile_phases": {},
             "toolchain": {**{k: os.environ.get(k) for k in ("CUDA_HOME", "CXX", FIX_VARIABLE)},
                           "build": read_build_facts(env_file(settings))}}
    with atomic_output(paths.compiled) as tmp:
        for name in ("model", "transforms"):
            log.info("AOTInductor compiling %s on %s (this is the slow part)", name, settings.device)
            try:
                compiled = aoti_compile(programs[name], inductor, sdpa_backends)
            except Exception as e:
                raise CompileError(f"AOTInductor failed on {name}: {first_line(e)} "
                                   "(run `uv run doit toolchain` to check the compiler setup)") from e
            index["compile_seconds"][name], index["compile_phases"][name] = compiled.seconds, compiled.phases
            log.info("compiled %s in %.1f s (%s)", name, compiled.seconds,
                     ", ".join(f"{k} {v} s" for k, v in list(compiled.phases.items())[:6]))
            index["models"][name] = keep_compiled(name, compiled.files, paths.exported, tmp / name)
            code = sum((tmp / name / f).stat().st_size for f in index["models"][name]["files"])
            log.info("%s: code %s, weights blob %s (rebuilt from the exported archive: identical)", name,
                     human_size(code), human_size(index["models"][name]["blob_bytes"]))
        if settings.tuned:
            after = count_decisions(cache)
            tuning = {"tuning_index": str(paths.tuning_index.relative_to(paths.root)),
                      "benchmarked_now": {k: after[k] - before[k] for k in after}}
            index["tuning"] = tuning
            if any(tuning["benchmarked_now"].values()):
                log.warning("the tuning results lacked %s: this compile benchmarked them (`uv run doit tune` "
                            "again keeps them)", tuning["benchmarked_now"])
        (tmp / "index.json").write_text(json.dumps(index, indent=2, sort_keys=True) + "\n")
    record(paths.manifest, "compile", [paths.compiled_index], {
        "compile_seconds": index["compile_seconds"], "program_sha256": digest["sha256"], "tuning": tuning,
        **settings.fingerprint("compile"),
    })


if __name__ == "__main__":
    from .stage import main

    main("compile", run, __doc__.splitlines()[0])
