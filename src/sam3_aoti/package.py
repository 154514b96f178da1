"""The PT2 archive: stage `package` writes it, `load_package` loads it with nothing but torch.

`sam3.pt2` holds the AOTI models `model` and `transforms` (compiled code; the weights once, in the blob
AOTInductor's own loader reads), `metadata.json` and the tokenizer's merges, and finds every consumer
(`load_pt2`, torch's `load_package`, the C++ `AOTIModelPackageLoader`) its models by name. The exported
programs, the fallback where the AOTI part cannot load, sit beside it in `sam3.exported.pt2`: inside,
`load_pt2` would deserialize them (and a second copy of the weights) on every load.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
import zipfile
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from .artifacts import atomic_output, check_free_space, human_size, mark, record, sha256
from .cuda_graphs import DEFAULT_MAX_GRAPHS, SWITCH, CudaGraphRunner, graphs_wanted
from .errors import InputError, PackageError, first_line
from .integrity import check_package, digest_file, write_digest
from .paths import ProfilePaths, archive_entries, fallback_of
from .weights_blob import write_weights_blob

METADATA_FILE = "metadata.json"
VOCAB_FILE = "tokenizer/bpe_simple_vocab_16e6.txt"
MODEL_NAMES = ("model", "transforms")

log = logging.getLogger("sam3_aoti")


def build_metadata(settings, paths: ProfilePaths, index: dict, program: dict, parts: dict) -> dict:
    from .config import package_version
    from . import contract
    from .tokenizer import CONTEXT_LENGTH, END, PAD, SPECIAL_TOKENS, START

    model_io, transforms_io = program["programs"]["model"], program["programs"]["transforms"]
    images, _ = model_io["example_inputs"]
    side = images["shape"][2:]
    return {
        "format": contract.METADATA_FORMAT,
        "profile": settings.profile,
        "variant": settings.variant,
        "weights": settings.weights,
        "random_weights": settings.weights == "random",
        "precision": settings.precision,
        "fp32_parts": list(contract.FP32_IN_BF16) if settings.precision != "fp32" else [],
        "fp8_parts": list(contract.FP8_PARTS) if settings.precision == "fp8" else [],
        "device": settings.device,
        "models": {
            "model": {
                "inputs": {
                    "images": {"shape": ["batch", 3, *side], "dtype": "float32"},
                    "token_ids": {"shape": ["num_prompts", CONTEXT_LENGTH], "dtype": "int64"},
                },
                "outputs": {name: {"shape": ["batch*num_prompts", *o["shape"][1:]], "dtype": o["dtype"]}
                            for name, o in zip(contract.OUTPUT_NAMES, model_io["outputs"])},
                "output_order": list(contract.OUTPUT_NAMES),  # the runner returns a tuple; json sorts the dict above
                "dynamic_dims": {"batch": {"min": 1}, "num_prompts": {"min": 1}},
                "pairing": contract.PAIRING,
            },
            "transforms": {
                "inputs": {"images": {"shape": ["batch", 3, "height", "width"], "dtype": "float32",
                                      "range": list(contract.IMAGE_RANGE)}},
                "outputs": {"images": {"shape": ["batch", 3, *side], "dtype": transforms_io["outputs"][0]["dtype"]}},
                "dynamic_dims": {"batch": {"min": 1}, "height": {"min": 2}, "width": {"min": 2}},
                "normalize": {"mean": contract.IMAGE_MEAN, "std": contract.IMAGE_STD, "after_scale": 1 / 255},
                "resize": contract.RESIZE,
            },
        },
        "box_format": contract.BOX_FORMAT,
        "mask_format": contract.MASK_FORMAT,
        "score": contract.SCORE,
        "tokenizer": {"start": START, "end": END, "pad": PAD, "context_length": CONTEXT_LENGTH,
                      "vocab_file": VOCAB_FILE, "attention_mask": "token_ids != 0",
                      "special_tokens": list(SPECIAL_TOKENS),
                      "clean": "ftfy.fix_text, html.unescape twice, whitespace runs to one space, strip, lower case",
                      "reference": "Meta's sam3/model/tokenizer_ve.py SimpleTokenizer (open_clip's)"},
        "versions": {**index["platform"], "transformers": package_version("transformers")},
        "inductor_options": index["inductor_options"],
        "toolchain": index["toolchain"],
        "fallback": fallback_of(paths.package).name,
        "inputs_sha256": {
            "checkpoint": sha256(paths.checkpoint / "model.safetensors"),
            "program": program["sha256"],
        },
        "parts_sha256": parts,  # every compiled part, checked before any of it is loaded (integrity.py)
    }


def check_aoti_loads(path: Path) -> None:
    """A package whose AOTI models do not load here, where they were built, is no package."""
    try:
        load_aoti_runners(path)
    except Exception as e:
        raise PackageError(f"the fresh package's AOTI models do not load: {first_line(e)}") from e


def link_or_copy(source: Path, target: Path) -> None:
    """The fallback is the export stage's archive as it is: a hard link where the filesystem allows."""
    try:
        os.link(source, target)
    except OSError:
        shutil.copyfile(source, target)


def run(settings) -> None:
    """Stage `package`: compiled code + the exported programs' current weights -> sam3.pt2 (seconds)."""
    from torch.export.pt2_archive._package import package_pt2

    paths = ProfilePaths.of(settings)
    index = json.loads(paths.compiled_index.read_text())
    program = json.loads(paths.program_digest.read_text())
    if index["program_sha256"] != program["sha256"]:
        raise PackageError("the compiled code is for another exported program: run `uv run doit compile`")
    weights = sum(index["models"][n]["blob_bytes"] for n in MODEL_NAMES)
    check_free_space({paths.package.parent: 2 * weights + (10 << 20)}, "package")  # the blob, then the archive
    t0 = time.perf_counter()
    with atomic_output(paths.fallback_package) as tmp:
        link_or_copy(paths.exported, tmp)
    write_digest(paths.fallback_package)
    with atomic_output(paths.package) as tmp:
        aoti_files, parts = {}, {}
        for name in MODEL_NAMES:
            compiled = index["models"][name]
            files = [paths.compiled / name / f for f in compiled["files"]]
            blob = tmp.parent / compiled["blob"]
            if write_weights_blob(paths.exported, name, compiled, blob):
                log.info("%s: weights blob written (%s)", name, human_size(blob.stat().st_size))
                files.append(blob)  # a model without constants gets none: torch's loader fails to mmap an empty one
            aoti_files[name] = [str(f) for f in files]
            parts.update({f"data/aotinductor/{name}/{f.name}": sha256(f) for f in files})
        metadata = build_metadata(settings, paths, index, program, parts)
        package_pt2(str(tmp), aoti_files=aoti_files,
                    extra_files={METADATA_FILE: json.dumps(metadata, indent=2, sort_keys=True),
                                 VOCAB_FILE: paths.tokenizer_merges.read_text()})
        log.info("archive written; checking that its AOTI models load")
        check_aoti_loads(tmp)
    write_digest(paths.package)
    log.info("package %s (%s: weights %s once, code and metadata %s) in %.1f s; fallback %s", paths.package,
             human_size(paths.package.stat().st_size), human_size(weights),
             human_size(paths.package.stat().st_size - weights), time.perf_counter() - t0, paths.fallback_package.name)
    record(paths.manifest, "package", [paths.package, paths.fallback_package, digest_file(paths.package),
                                       digest_file(paths.fallback_package)], {
        "weights_bytes": weights, "program_sha256": program["sha256"], **settings.fingerprint("package"),
    })
    mark(paths.manifest, "verify", verified=False)  # a new package is unverified until verify passes


@dataclass
class Sam3Package:
    runners: dict[str, Callable]
    backends: dict[str, str]  # name -> "aoti" | "exported"
    metadata: dict
    merges_text: str
    path: Path
    fallback_reason: str | None = None
    exported: dict = field(default_factory=dict, repr=False)
    cuda_graphs: str = "off"  # "on" (the model replays CUDA graphs) or why not

    @property
    def graph_runner(self):
        """The model's CudaGraphRunner (`.graphs`: the shapes captured), or None."""
        return getattr(self.runners["model"], "graph_runner", None)

    def exported_only(self) -> "Sam3Package":
        """The same package through its exported programs (the fallback beside it)."""
        exported = self.exported or load_exported(self.path)
        runners = checked({name: exported[name].module() for name in MODEL_NAMES}, self.metadata)
        return Sam3Package(runners, {name: "exported" for name in runners}, self.metadata, self.merges_text,
                           self.path, self.fallback_reason, exported, "off: exported programs")

    def __getitem__(self, name: str) -> Callable:
        return self.runners[name]

    @property
    def model(self) -> Callable:
        return self.runners["model"]

    @property
    def transforms(self) -> Callable:
        return self.runners["transforms"]

    def encode_prompts(self, prompts: list[str]):
        from .tokenizer import encode_prompts

        return encode_prompts(prompts, self.merges_text)


class AotiRunner:
    """One AOTI model from torch's C++ package loader, called with tensors (what torch's `AOTICompiledModel`
    does, without importing torch.export's serializer: 3 s). Inputs are made contiguous: the runner reads
    dense row-major memory, and a permuted view (an HWC image turned CHW) would be read wrongly, silently."""

    def __init__(self, path: Path, name: str, single_threaded: bool = False):
        import torch
        from torch.utils import _pytree

        # (path, model name, run_single_threaded, number of runners, device index): single-threaded for graphs
        self.loader = torch._C._aoti.AOTIModelPackageLoader(str(path), name, single_threaded, 1, -1)
        self.out_spec = _pytree.treespec_loads(self.loader.get_call_spec()[1])

    def __call__(self, *args):
        from torch.utils import _pytree

        return _pytree.tree_unflatten(self.loader.boxed_run([a.contiguous() for a in args]), self.out_spec)


def _describe(t) -> str:
    import torch

    if not isinstance(t, torch.Tensor):
        return type(t).__name__
    return f"{str(t.dtype).removeprefix('torch.')} {list(t.shape)} on {t.device.type}"


def check_images(images, device: str, side: int | None = None) -> None:
    """float32 [B, 3, H, W] (H = W = side for the model) on the package's device, B >= 1."""
    import torch

    want = f"float32 [batch, 3, {side or 'height'}, {side or 'width'}] on {device}"
    ok = (isinstance(images, torch.Tensor) and images.dtype == torch.float32 and images.dim() == 4
          and images.shape[1] == 3 and images.device.type == device
          and (images.shape[2:] == (side, side) if side else min(images.shape[2:]) >= 2))
    if not ok:
        hint = "the output of transforms" if side else "RGB pixels in [0, 255], channels first"
        raise InputError(f"images must be {want}, got {_describe(images)}: pass {hint}")
    if images.shape[0] == 0:
        raise InputError("images holds no image (batch 0): pass at least one")


def check_token_ids(token_ids, device: str, context: int, vocab: int) -> None:
    """int64 [P, context] on the package's device, P >= 1, every id a token of the vocabulary."""
    import torch

    if not (isinstance(token_ids, torch.Tensor) and token_ids.dtype == torch.int64 and token_ids.dim() == 2
            and token_ids.shape[1] == context and token_ids.device.type == device):
        raise InputError(f"token_ids must be int64 [num_prompts, {context}] on {device}, got {_describe(token_ids)}: "
                         "use encode_prompts")
    if token_ids.shape[0] == 0:
        raise InputError("token_ids holds no prompt (num_prompts 0): pass at least one")
    if bool(((token_ids < 0) | (token_ids >= vocab)).any()):
        raise InputError(f"token_ids holds ids outside [0, {vocab}): use encode_prompts or a CLIP BPE tokenizer")


class CheckedModel:
    """`model(images, token_ids)` with one-line errors for inputs it cannot take, before native code runs."""

    def __init__(self, runner: Callable, metadata: dict):
        model = metadata.get("models", {}).get("model", {})
        tokenizer = metadata.get("tokenizer", {})
        self.runner, self.device = runner, metadata.get("device", "cpu")
        self.graph_runner = runner if isinstance(runner, CudaGraphRunner) else None
        self.side = model.get("inputs", {}).get("images", {}).get("shape", [0, 0, 0])[2]
        self.context, self.vocab = tokenizer.get("context_length", 32), tokenizer.get("end", 49407) + 1

    def __call__(self, images, token_ids):
        check_images(images, self.device, self.side)
        check_token_ids(token_ids, self.device, self.context, self.vocab)
        return self.runner(images, token_ids)


class CheckedTransforms:
    """`transforms(images)` with one-line errors for inputs it cannot take."""

    def __init__(self, runner: Callable, metadata: dict):
        self.runner, self.device = runner, metadata.get("device", "cpu")

    def __call__(self, images):
        check_images(images, self.device)
        return self.runner(images)


def _read_extra_files(path: Path) -> dict:
    try:
        with zipfile.ZipFile(path) as archive:
            entries = archive_entries(archive)
            if f"extra/{METADATA_FILE}" not in entries:
                raise KeyError(METADATA_FILE)
            return {name: archive.read(entries[f"extra/{name}"]).decode() for name in (METADATA_FILE, VOCAB_FILE)
                    if f"extra/{name}" in entries}
    except (zipfile.BadZipFile, KeyError, OSError, EOFError, UnicodeDecodeError):
        raise PackageError(f"{path} is truncated or not a sam3-aoti package: rebuild it with `uv run doit package`") from None


def device_problem(path: Path) -> str | None:
    """Why the AOTI part cannot run here (None if it can): torch's loader accepts a CUDA package on a machine
    without a GPU, or built for another GPU generation, and fails only at the first call."""
    import torch

    with zipfile.ZipFile(path) as archive:
        built = [json.loads(archive.read(n)) for n in archive.namelist()
                 if "/data/aotinductor/" in n and n.endswith(".wrapper_metadata.json")]
    for meta in built:
        if meta.get("AOTI_DEVICE_KEY") != "cuda":
            continue
        if not torch.cuda.is_available():
            return "its AOTI part is built for CUDA and no GPU is usable here"
        want = meta.get("AOTI_COMPUTE_CAPABILITY", "")
        have = "".join(map(str, torch.cuda.get_device_capability()))
        if want and want.replace(".", "") != have:
            return f"its AOTI part is built for compute capability {want}, this GPU has {have}"
    return None


def _extraction_folders() -> set[Path]:
    """torch's C++ loader unpacks a package into /tmp/XXXXXX and removes it only when a load succeeds."""
    return {p for p in Path("/tmp").iterdir() if len(p.name) == 6 and p.is_dir()} if Path("/tmp").is_dir() else set()


def load_aoti_runners(path: Path, graphed: tuple = ()) -> dict:
    """The AOTI models straight from torch's C++ package loader (those in `graphed` single-threaded, for
    CUDA graphs). torch's Python loaders (`load_pt2`, `torch._inductor.package.load_package`) first probe
    the CPU's vector ISA for a device-mismatch warning, compiling and loading test libraries in
    `python -c "import torch"` subprocesses: 20-40 s on the H200, for CUDA packages too. The loader itself
    takes under a second. A failed load leaves no folder behind."""
    problem = device_problem(path)
    if problem:
        raise PackageError(problem)
    before = _extraction_folders()
    try:
        return {name: AotiRunner(path, name, single_threaded=name in graphed) for name in MODEL_NAMES}
    except Exception:
        for folder in _extraction_folders() - before:
            if any(folder.glob("*/data/aotinductor")):  # the unpacked package
                shutil.rmtree(folder, ignore_errors=True)
        raise


def load_exported(path: Path, trust: bool = False) -> dict:
    """The exported programs from the fallback archive beside the package."""
    from torch.export.pt2_archive._package import load_pt2

    fallback = fallback_of(path)
    if not fallback.is_file():
        raise PackageError(f"no exported-program fallback {fallback.name} beside {path}: "
                           "rebuild it with `uv run doit package`")
    check_package(fallback, trust=trust)
    try:
        programs = load_pt2(str(fallback)).exported_programs
    except Exception as e:  # exported on a GPU, its weights want one too
        raise PackageError(f"the fallback {fallback.name} does not load here either ({first_line(e)}): "
                           f"use {path.name} where it was built ({_built_for(path)})") from None
    missing = [n for n in MODEL_NAMES if n not in programs]
    if missing:
        raise PackageError(f"{fallback} holds no {', '.join(missing)} program: rebuild it with `uv run doit package`")
    return programs


def _built_for(path: Path) -> str:
    metadata = json.loads(_read_extra_files(path).get(METADATA_FILE, "{}"))
    return f"{metadata.get('device', '?')}, {metadata.get('versions', {}).get('gpu') or 'any GPU'}"


def load_package(path: str | Path, prefer_aoti: bool = True, trust: bool = False, cuda_graphs: bool | None = None,
                 max_graphs: int | None = None) -> Sam3Package:
    """Callables by name: the AOTI runners where they load, the exported programs beside them otherwise.
    The archive is checked against its recorded digests first (integrity.py); `trust` accepts a package
    that has none. On CUDA the AOTI model replays a CUDA graph per input shape (`cuda_graphs.py`; at most
    `max_graphs` shapes kept): `cuda_graphs=False`, or SAM3_AOTI_CUDA_GRAPHS=0 in the environment, turns
    that off."""
    import torch

    if torch.__version__ < "2.11":
        import torch._inductor.codecache  # noqa: F401  (torch 2.10 needs it before loading AOTI packages; 3 s)

    path = Path(path)
    if not path.is_file():
        raise PackageError(f"no package at {path}: build it with `uv run doit package`")
    fallback_reason, aoti, exported = None, {}, {}
    extra = _read_extra_files(path)
    metadata = json.loads(extra.get(METADATA_FILE, "{}"))
    check_package(path, trust=trust)
    graphs = graphs_wanted(cuda_graphs) and metadata.get("device") == "cuda"
    if prefer_aoti:
        try:
            aoti = load_aoti_runners(path, graphed=("model",) if graphs else ())
        except Exception as e:  # a package built for another device/ABI: use the exported programs
            fallback_reason = first_line(e)
            log.warning("AOTI models of %s did not load (%s); using the exported programs", path.name, fallback_reason)
    if not aoti:
        exported = load_exported(path, trust)
    runners = {name: aoti[name] if name in aoti else exported[name].module() for name in MODEL_NAMES}
    backends = {name: "aoti" if name in aoti else "exported" for name in MODEL_NAMES}
    state = graphs_state(graphs, cuda_graphs, metadata, bool(aoti))
    if state == "on":
        runners["model"] = CudaGraphRunner(runners["model"], max_graphs or DEFAULT_MAX_GRAPHS)
    return Sam3Package(checked(runners, metadata), backends, metadata, extra.get(VOCAB_FILE, ""), path,
                       fallback_reason, exported, state)


def graphs_state(graphs: bool, requested: bool | None, metadata: dict, aoti: bool) -> str:
    """"on", or why the model runs without CUDA graphs."""
    if not graphs:
        if metadata.get("device") != "cuda":
            return f"off: a {metadata.get('device', '?')} package"
        return "off: cuda_graphs=False" if requested is False else f"off: {SWITCH}=0"
    return "on" if aoti else "off: exported programs"


def checked(runners: dict, metadata: dict) -> dict:
    return {"model": CheckedModel(runners["model"], metadata), "transforms": CheckedTransforms(runners["transforms"], metadata)}


def archive_info(path: str | Path, trust: bool = False) -> dict:
    """What a package holds, read from the zip alone (no torch, no native code run): models and backends,
    inputs and outputs, dynamic dims, precision, the GPU it was built for, versions, weights hash, sizes."""
    path = Path(path)
    if not path.is_file():
        raise PackageError(f"no package at {path}: pass the .pt2 file the `package` stage wrote")
    try:
        with zipfile.ZipFile(path) as archive:
            entries = {inner: archive.getinfo(name) for inner, name in archive_entries(archive).items()}
            if archive.read(entries["archive_format"]) != b"pt2":
                raise KeyError("archive_format")
            metadata = json.loads(archive.read(entries[f"extra/{METADATA_FILE}"]))
            aoti = {}
            for name, item in entries.items():
                if name.startswith("data/aotinductor/"):
                    model, file = name.split("/")[2:4]
                    part = aoti.setdefault(model, {"code_bytes": 0, "weights_bytes": 0})
                    part["weights_bytes" if file.endswith("_weights.blob") else "code_bytes"] += item.file_size
                    if file.endswith(".wrapper_metadata.json"):
                        built = json.loads(archive.read(item))
                        part.update(device=built.get("AOTI_DEVICE_KEY"),
                                    compute_capability=built.get("AOTI_COMPUTE_CAPABILITY") or None)
    except (zipfile.BadZipFile, KeyError, ValueError, OSError, EOFError) as e:
        reason = "truncated or not a zip" if isinstance(e, (zipfile.BadZipFile, EOFError)) else "not a sam3-aoti PT2 package"
        raise PackageError(f"{path} is {reason}: rebuild it with `uv run doit package` or pass another file") from None
    integrity = check_package(path, trust=trust)
    fallback = fallback_of(path)
    models = {}
    for name, described in metadata.get("models", {}).items():
        backends = (["aoti"] if name in aoti else []) + (["exported (fallback)"] if fallback.is_file() else [])
        models[name] = {**described, "backends": backends, **aoti.get(name, {})}
    versions = metadata.get("versions", {})
    return {
        "path": str(path), "bytes": path.stat().st_size, "format": metadata.get("format"), "integrity": integrity,
        "profile": metadata.get("profile"), "precision": metadata.get("precision"), "device": metadata.get("device"),
        "gpu": versions.get("gpu"), "compute_capability": versions.get("compute_capability"),
        "versions": {k: versions.get(k) for k in ("torch", "transformers", "cuda", "triton", "python")},
        "weights": metadata.get("weights"),
        "weights_sha256": {part.split("/")[2]: sha for part, sha in metadata.get("parts_sha256", {}).items()
                           if part.endswith("_weights.blob")},
        "fallback": {"path": str(fallback), "bytes": fallback.stat().st_size} if fallback.is_file() else None,
        "models": models,
    }


def format_info(info: dict) -> str:
    """`sam3-aoti info` for people."""
    built = info["gpu"] and f"{info['gpu']} (compute capability {info['compute_capability']})"
    lines = [f"{info['path']}: {human_size(info['bytes'])}, {info['format']}, profile {info['profile']}, "
             f"{info['precision']} on {info['device']}{', built on ' + built if built else ''}",
             "versions: " + ", ".join(f"{k} {v}" for k, v in info["versions"].items() if v),
             f"integrity: {info['integrity']}"]
    fallback = info["fallback"]
    lines.append(f"fallback: {Path(fallback['path']).name} ({human_size(fallback['bytes'])})" if fallback
                 else "fallback: none beside it (AOTI only)")
    lines.append(f"weights: {info['weights']}")
    for name, model in info["models"].items():
        sizes = f"code {human_size(model.get('code_bytes', 0))}, weights {human_size(model.get('weights_bytes', 0))}"
        lines.append(f"{name}: backends {', '.join(model['backends']) or 'none'}; {sizes}; "
                     f"weights sha256 {info['weights_sha256'].get(name, 'none')[:16]}")
        dims = ", ".join(f"{d} >= {r['min']}" for d, r in model.get("dynamic_dims", {}).items())
        if dims:
            lines.append(f"  dynamic: {dims}")
        for kind in ("inputs", "outputs"):
            order = model.get("output_order", []) if kind == "outputs" else []
            names = order + [n for n in model.get(kind, {}) if n not in order]
            for n in names:
                t = model[kind][n]
                lines.append(f"  {kind[:-1]:6} {n:20} {t['dtype']:9} [{', '.join(map(str, t['shape']))}]")
    return "\n".join(lines)


if __name__ == "__main__":
    from .stage import main

    main("package", run, __doc__.splitlines()[0])
