"""`load_package`: a sam3-aoti package loaded with nothing but torch.

Integrity first (`integrity`), then the AOTI models with torch's model runner (their code unpacked into this
process's own folder, `scratch`), CUDA graphs around the model on a GPU (`cuda_graphs`), and the exported
programs beside the package as the fallback where the AOTI part cannot load. Every call checks its inputs and
fails with one line before native code runs.
"""

from __future__ import annotations

import logging
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from ..errors import InputError, PackageError, first_line
from .archive import MODEL_NAMES, PART_NAMES, SHARED_WEIGHT_PARTS, SPLIT_CALLS, VOCAB_FILE, fallback_of
from .checked import checked
from .contract import FP8_CAPABILITY, FP8_NEEDS
from .cuda_graphs import DEFAULT_MAX_GRAPHS, SWITCH, CudaGraphRunner, graphs_wanted
from .integrity import PackageChanged, PackageFile, check_package, read_consistently
from .split_call import SplitCall, split_call_wanted
from .torch_private import AotiRunner, before_loading, exported_programs

log = logging.getLogger(__name__)


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
    split_call: bool = False  # model and model_with_boxes as one call of the parts (`split_call`)

    @property
    def graph_runner(self):
        """The CudaGraphRunner behind `model` (`.graphs`: the shapes captured), or None."""
        return getattr(self.model, "graph_runner", None)

    def exported_only(self, exported: dict | None = None) -> "Sam3Package":
        """The same package through its exported programs (the fallback beside it; `exported`: them, loaded
        already by `load_exported`)."""
        exported = exported or self.exported or load_exported(self.path)
        return programs_package(exported, self.metadata, self.merges_text, self.path, self.fallback_reason)

    def __getitem__(self, name: str) -> Callable:
        return self.runners[name]

    @property
    def model(self) -> Callable:
        """`model(images, token_ids)`: the whole compiled model, or with `split_call` on, one call of the parts
        (the prompts' encoder beside the image encoder on a GPU); `package["model"]` is always the whole."""
        if self.split_call:
            return self.runners["model_from_parts"]
        return self.runners["model"]

    @property
    def transforms(self) -> Callable:
        return self.runners["transforms"]

    @property
    def parts(self) -> tuple[str, ...]:
        """The split models this package holds: encode_image, encode_text, encode_boxes, decode, or none."""
        return tuple(name for name in PART_NAMES if name in self.runners)

    def _part(self, name: str) -> Callable:
        if name not in self.runners:
            raise InputError(f"{self.path.name} has no {name} (exemplar boxes and encode once / decode many need the "
                             f"model's parts): add its profile ({self.metadata.get('profile')}) to `[export] split` in "
                             "pipeline.toml and build again, or call model(images, token_ids)")
        return self.runners[name]

    def encode_image(self, images):
        """`images` (the output of transforms) -> their features, a tuple `decode` takes: encode an image once,
        then decode any number of prompts against it."""
        return self._part("encode_image")(images)

    def encode_text(self, token_ids):
        """`token_ids` (encode_prompts) -> the prompts' features, a tuple `decode` takes (keep a class list's)."""
        return self._part("encode_text")(token_ids)

    def encode_boxes(self, features, boxes, labels=None):
        """Exemplar boxes on encoded images -> `exemplars`, the geometry prompt `decode` takes in place of the
        images' own no-box one. `features`: `encode_image(images)`; `boxes [B, K, 4]` float32, normalized
        (cx, cy, w, h) per image (`exemplars.normalized_boxes` turns pixel corners into them); `labels [B, K]`
        int64, 1 positive, 0 negative, -10 padding (images with fewer boxes), all positive when left out."""
        import torch

        from .contract import IMAGE_FEATURES
        from .exemplars import check_boxes

        if not isinstance(features, (tuple, list)) or len(features) != len(IMAGE_FEATURES):
            got = f"{len(features)} values" if isinstance(features, (tuple, list)) else type(features).__name__
            raise InputError(f"features must be what encode_image returned ({len(IMAGE_FEATURES)} tensors: "
                             f"{', '.join(IMAGE_FEATURES)}), got {got}")
        if labels is None and isinstance(boxes, torch.Tensor):
            labels = torch.ones(boxes.shape[:2], dtype=torch.long, device=boxes.device)
        check_boxes(boxes, labels, features[0].shape[0], self.metadata.get("device", "cpu"))
        return self._part("encode_boxes")(features[6], features[3], boxes, labels)

    def decode(self, features, text, exemplars=None):
        """The outputs of `model(images, token_ids)` from `encode_image(images)` and `encode_text(token_ids)`,
        in its pairing: pair i = (image i // num_prompts, prompt i % num_prompts). With `exemplars`
        (`encode_boxes`), the images are searched with those boxes beside the prompts; exemplars of one image
        search every image of `features` (one exemplar set, many tiles: a use no reference model defines)."""
        image, geometry = tuple(features[:4]), tuple(features[4:6])  # contract.IMAGE_FEATURES: no fpn_level2
        if exemplars is not None:
            batch, geometry = image[0].shape[0], tuple(exemplars)
            if geometry[0].shape[0] == 1 and batch > 1:
                geometry = tuple(t.expand(batch, *t.shape[1:]) for t in geometry)
            elif geometry[0].shape[0] != batch:
                raise InputError(f"exemplars are for {geometry[0].shape[0]} images, features for {batch}: "
                                 "encode boxes on these images, or on one image to search them all")
        return self._part("decode")(image, geometry, text)

    def model_with_boxes(self, images, token_ids, boxes, labels=None):
        """`model(images, token_ids)` with exemplar boxes on every image (`encode_boxes` says what they are):
        encode_image, encode_text, encode_boxes and decode, each replaying a CUDA graph of its own, or with
        `split_call` on, in one call (one graph, the prompts' encoder beside the image encoder on a GPU)."""
        import torch

        self._part("encode_boxes")
        if labels is None and isinstance(boxes, torch.Tensor):
            labels = torch.ones(boxes.shape[:2], dtype=torch.long, device=boxes.device)
        if self.split_call:
            return self.runners["model_with_boxes"](images, token_ids, boxes, labels)
        return self.parts_one_by_one(images, token_ids, boxes, labels)

    def parts_one_by_one(self, images, token_ids, boxes, labels):
        """`model_with_boxes` as the graphed parts called one after another, whatever `split_call` says."""
        features = self.encode_image(images)
        return self.decode(features, self.encode_text(token_ids), self.encode_boxes(features, boxes, labels))

    def decode_chunked(self, features, texts: list, exemplars=None):
        """`model(images, token_ids)`'s outputs from encoded images and the prompts encoded in chunks (`texts`:
        `encode_text` of each chunk, in order): decoded a chunk at a time and put back in model's pairing."""
        import torch

        batch = features[0].shape[0]
        chunks = [self.decode(features, text, exemplars) for text in texts]
        return tuple(torch.cat([o.unflatten(0, (batch, -1)) for o in outputs], dim=1).flatten(0, 1)
                     for outputs in zip(*chunks))

    def encode_prompts(self, prompts: list[str]):
        from .tokenizer import encode_prompts

        return encode_prompts(prompts, self.merges_text)


def unpack_model(package: PackageFile, name: str, skip: str | None = None) -> Path:
    """The files of the model `name` (names checked by `integrity.check_entries`), unpacked from the package's
    open file into a folder of this process's own: its shared object, its kernels, its weights blob (unless it is
    `skip`, the entry of weights read in place)."""
    import tempfile

    from .scratch import process_folder

    prefix = f"data/aotinductor/{name}/"
    folder = Path(tempfile.mkdtemp(prefix=f"{name}-", dir=process_folder()))
    try:
        for inner in package.entries:
            if inner.startswith(prefix) and inner != skip:
                with open(folder / inner.removeprefix(prefix), "wb") as dst:
                    package.copy_entry(inner, dst)
        shared = sorted(folder.glob("*.wrapper.so")) or sorted(folder.glob("*.so"))
        if len(shared) != 1:
            raise PackageError(f"{package.path} holds {len(shared)} shared objects for {name}, a package one: "
                               "rebuild it")
    except BaseException:
        shutil.rmtree(folder, ignore_errors=True)
        raise
    return folder


def device_problem(built: dict[str, dict], precision: str | None = None) -> str | None:
    """Why the AOTI part cannot run here (None if it can): torch's runners accept a CUDA package on a machine
    without a GPU, or built for another GPU generation, and fail only at the first call."""
    import torch

    for record in built.values():
        if record.get("AOTI_DEVICE_KEY") != "cuda":
            continue
        if not torch.cuda.is_available():
            return "its AOTI part is built for CUDA and no GPU is usable here"
        capability = torch.cuda.get_device_capability()
        if precision == "fp8" and capability < FP8_CAPABILITY:
            return (f"it is a precision=fp8 package, whose fp8 GEMMs need {FP8_NEEDS}; this GPU has "
                    f"{capability[0]}.{capability[1]}: build it with precision=bf16")
        want = record.get("AOTI_COMPUTE_CAPABILITY", "")
        have = "".join(map(str, capability))
        if want and want.replace(".", "") != have:
            return f"its AOTI part is built for compute capability {want}, this GPU has {have}"
    return None


def load_aoti_runners(package: Path | PackageFile) -> dict:
    """The AOTI models, loaded with torch's model runner (`torch_private.AotiRunner`), their weights read in place
    from the package where it records their layout (`constants`).
    torch's Python loaders (`load_pt2`, `torch._inductor.package.load_package`) first probe the CPU's vector ISA
    for a device-mismatch warning, compiling and loading test libraries in `python -c "import torch"`
    subprocesses: tens of seconds, for CUDA packages too. This takes under a second, and a failed load
    leaves nothing behind (its folder is this process's). Every model is unpacked from the package's open file,
    and the file checked unchanged since it was opened (`PackageFile.check_unchanged`), before any of its native
    code is loaded."""
    if not isinstance(package, PackageFile):
        with PackageFile(package) as opened:
            return load_aoti_runners(opened)
    from .constants import read_constants, readable_layout

    built = package.built_for
    problem = device_problem(built, package.metadata.get("precision"))
    if problem:
        raise PackageError(problem)
    folders, runners, weights = {}, {}, {}
    device = {name: record.get("AOTI_DEVICE_KEY") or "cpu" for name, record in built.items()}
    try:
        for name in models_in(package.path, built):
            in_place = readable_layout(package, name, device[name])
            folders[name] = unpack_model(package, name, skip=in_place.entry if in_place else None)
            if in_place:
                weights[name] = read_constants(package, in_place, device[name])
        package.check_unchanged()  # what was unpacked and read is what was checked
        for name, folder in folders.items():  # each runner owns its folder from here
            runners[name] = AotiRunner(folder, device[name], weights.get(name))
    except BaseException:
        for name, folder in folders.items():
            if name not in runners:
                shutil.rmtree(folder, ignore_errors=True)
        raise
    for name in SHARED_WEIGHT_PARTS:
        if name in runners:
            runners[name].read_weights_of(runners["model"])
    return runners


def models_in(path: Path, names) -> tuple[str, ...]:
    """The package's models: `model` and `transforms`, and the parts of the split, all or none."""
    parts = [n for n in PART_NAMES if n in names]
    if parts and len(parts) != len(PART_NAMES) or not set(MODEL_NAMES) <= set(names):
        raise PackageError(f"{path} holds the models {sorted(names)}; a package holds {', '.join(MODEL_NAMES)} "
                           f"and all or none of {', '.join(PART_NAMES)}: rebuild it with `uv run doit package`")
    return MODEL_NAMES + tuple(parts)


def models_of(metadata: dict) -> tuple[str, ...]:
    return MODEL_NAMES + tuple(n for n in PART_NAMES if n in metadata.get("models", {}))


def programs_package(exported: dict, metadata: dict, merges_text: str, path: Path,
                     fallback_reason: str | None = None) -> Sam3Package:
    """Exported programs behind the package's interface (`metadata`'s models, checked calls, the tokenizer): the
    fallback of a package, or the fallback stage's programs before any package exists."""
    names = models_of(metadata)
    runners = checked(with_split_call({name: exported[name].module() for name in names},
                                      metadata.get("device", "cpu")), metadata)
    return Sam3Package(runners, dict.fromkeys(names, "exported"), metadata, merges_text, path,
                       fallback_reason, exported, "off: exported programs")


def load_exported(path: Path, trust: bool = False, built_for: str = "") -> dict:
    """The exported programs from the fallback archive beside the package (`built_for`: where the package was
    built, for the error line when they do not load here either)."""
    from . import attention, box_bias, fp8_linear  # noqa: F401  (the sam3_aoti ops programs may call)

    fallback = fallback_of(path)
    if not fallback.is_file():
        raise PackageError(f"no exported-program fallback {fallback.name} beside {path}: "
                           "rebuild it with `uv run doit package`")

    def read(opened: PackageFile) -> dict:
        opened.file.seek(0)
        try:
            return exported_programs(opened.file)
        except Exception as e:  # exported on a GPU, its weights want one too
            raise PackageError(f"the fallback {fallback.name} does not load here either ({first_line(e)}): "
                               f"use {path.name} where it was built ({built_for or '?'})") from None

    with PackageFile(fallback) as opened:  # what is checked is what loads
        check_package(opened, trust=trust)
        programs = read_consistently(opened, read)
    missing = [n for n in MODEL_NAMES if n not in programs]  # the parts, where its metadata names them: load_package
    if missing:
        raise PackageError(f"{fallback} holds no {', '.join(missing)} program: rebuild it with `uv run doit package`")
    return programs


def load_package(path: str | Path, prefer_aoti: bool = True, trust: bool = False, cuda_graphs: bool | None = None,
                 max_graphs: int | None = None, sha256: str | None = None,
                 split_call: bool | None = None) -> Sam3Package:
    """Callables by name: the AOTI runners where they load, the exported programs beside them otherwise.
    Before torch sees the archive, its entry names are checked and its sha256 compared with `sha256` (a digest
    you got beside or before the package), else with the `.sha256` file beside it (`integrity`); `trust` loads
    a package that has neither. On CUDA the AOTI model replays a CUDA graph per input shape (`cuda_graphs`; at most
    `max_graphs` shapes kept): `cuda_graphs=False`, or SAM3_AOTI_CUDA_GRAPHS=0 in the environment, turns
    that off. A split CUDA package's `model` and `model_with_boxes` are one call of its parts, the prompts' encoder
    beside the image encoder (`split_call`); `split_call=False`, or SAM3_AOTI_SPLIT_CALL=0, runs the whole
    compiled model instead."""
    before_loading()
    path = Path(path)
    if not path.is_file():
        raise PackageError(f"no package at {path}: build it with `uv run doit package`")

    def read(package: PackageFile) -> tuple[dict, str | None]:
        """The AOTI runners, or none and why not."""
        if not prefer_aoti:
            return {}, None
        try:
            return load_aoti_runners(package), None
        except PackageChanged:
            raise
        except Exception as e:  # a package built for another device/ABI: use the exported programs
            return {}, first_line(e)

    with PackageFile(path) as package:  # checked, then read through the same open file
        check_package(package, trust=trust, digest=sha256)
        aoti, fallback_reason = read_consistently(package, read)
        metadata, vocab = package.metadata, package.extra_files.get(VOCAB_FILE, "")
    graphs = graphs_wanted(cuda_graphs) and metadata.get("device") == "cuda"
    exported = {}
    if fallback_reason:
        log.warning("AOTI models of %s did not load (%s); using the exported programs", path.name, fallback_reason)
    if not aoti:
        versions = metadata.get("versions", {})
        exported = load_exported(path, trust, f"{metadata.get('device', '?')}, {versions.get('gpu') or 'any GPU'}")
    names = models_of(metadata)
    missing = [n for n in names if n not in aoti and n not in exported]
    if missing:
        raise PackageError(f"{path} lacks the models {', '.join(missing)} its metadata names: rebuild it with "
                           "`uv run doit package`")
    runners = {name: aoti[name] if name in aoti else exported[name].module() for name in names}
    backends = {name: "aoti" if name in aoti else "exported" for name in names}
    state, device = graphs_state(graphs, cuda_graphs, metadata, bool(aoti)), metadata.get("device", "cpu")
    runners = with_split_call(runners, device)  # of the parts' own runners, not their graphs
    if state == "on":
        for name in ("model", *PART_NAMES, *SPLIT_CALLS):
            if name in runners:
                runners[name] = CudaGraphRunner(runners[name], max_graphs or DEFAULT_MAX_GRAPHS)
    return Sam3Package(checked(runners, metadata), backends, metadata, vocab, path, fallback_reason, exported,
                       state, bool(aoti) and "model_from_parts" in runners and split_call_wanted(split_call, device))


def with_split_call(runners: dict, device: str) -> dict:
    """`runners` with, where they hold the parts, `model_from_parts` and `model_with_boxes`: one `SplitCall` of
    them each (each gets a CUDA graph runner of its own, so text-only and box calls keep their own shapes)."""
    if not set(PART_NAMES) <= set(runners):
        return runners
    call = SplitCall({name: runners[name] for name in PART_NAMES}, device)
    return {**runners, **dict.fromkeys(SPLIT_CALLS, call)}


def graphs_state(graphs: bool, requested: bool | None, metadata: dict, aoti: bool) -> str:
    """"on", or why the model runs without CUDA graphs."""
    if not graphs:
        if metadata.get("device") != "cuda":
            return f"off: a {metadata.get('device', '?')} package"
        return "off: cuda_graphs=False" if requested is False else f"off: {SWITCH}=0"
    return "on" if aoti else "off: exported programs"
