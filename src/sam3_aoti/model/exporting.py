"""torch.export of the grounding wrapper (dynamic batch and prompt counts), of its parts for encode once /
decode many, and of the image transforms (any batch, height and width); their archives and digests."""

from __future__ import annotations

import hashlib
import json
import zipfile
from pathlib import Path

from ..errors import ExportError, first_line
from ..runtime.archive import archive_entries
from ..runtime.files import write_text_atomic


def check_against_eager(name: str, run, eager, args, atol: float) -> float:
    """Run an exported program (`run`: its module) at new shapes; it must run and agree with eager."""
    import torch

    with torch.no_grad():
        try:
            got = run(*args)
        except Exception as e:
            shapes = [tuple(a.shape) for a in args]
            raise ExportError(f"exported {name} fails at input shapes {shapes}: {first_line(e)}") from e
        want = eager(*args)
    got, want = (got,) if torch.is_tensor(got) else got, (want,) if torch.is_tensor(want) else want
    worst = max((g.float() - w.float()).abs().max().item() for g, w in zip(got, want))
    if not worst <= atol:
        raise ExportError(f"exported {name} drifts from eager by {worst:.3g} (> {atol}) at shapes "
                          f"{[tuple(a.shape) for a in args]}: the export changed the model's behaviour")
    return worst


def export_model(wrapper, example_args, batch_name="batch", prompts_name="num_prompts"):
    import torch
    from torch.export import Dim

    dynamic = {"images": {0: Dim(batch_name, min=1)}, "token_ids": {0: Dim(prompts_name, min=1)}}
    with torch.no_grad():
        return torch.export.export(wrapper, example_args, dynamic_shapes=dynamic)


def export_transforms(module, example_image):
    import torch
    from torch.export import Dim

    dynamic = {"images": {0: Dim("batch", min=1), 2: Dim("height", min=2), 3: Dim("width", min=2)}}
    with torch.no_grad():
        return torch.export.export(module, (example_image,), dynamic_shapes=dynamic)


def example_boxes(batch: int, count: int, seed: int = 0, device="cpu"):
    """Seeded exemplar boxes `[batch, count, 4]` (normalized cx, cy, w, h, inside the image) and labels
    (positive and negative; the last box of the first image padding when there are two or more)."""
    import torch

    g = torch.Generator().manual_seed(seed)
    size = torch.rand(batch, count, 2, generator=g) * 0.5 + 0.05
    center = size / 2 + torch.rand(batch, count, 2, generator=g) * (1 - size)
    labels = torch.randint(0, 2, (batch, count), generator=g)
    if count > 1:
        labels[0, -1] = -10
    return torch.cat([center, size], -1).to(device), labels.to(device)


def export_parts(wrapper, example) -> dict:
    """`[export] split`: the image encoder, the text encoder, the exemplar encoder (`encode_boxes`) and the heads
    (`decode`) as programs of their own, traced at the model's example (the heads with exemplar boxes, so the
    geometry prompt's length is a dynamic dim), with dynamic batch, prompt and box counts."""
    import torch
    from torch.export import Dim

    from ..model.grounding import DECODE_IMAGE_INPUTS, Part
    from ..runtime.contract import MAX_BOXES

    images, token_ids = example
    boxes, labels = example_boxes(images.shape[0], 3, device=images.device)
    with torch.no_grad():  # contiguous, as the runners pass every input: AOTInductor compiles for the example's strides
        features, text = ([t.contiguous() for t in part(x)] for part, x in
                          ((wrapper.encode_image, images), (wrapper.encode_text, token_ids)))
        level2, position = features[-1], features[3]
        geometry = [t.contiguous() for t in wrapper.encode_boxes(level2, position, boxes, labels)]
    batch, prompts = Dim("batch", min=1), Dim("num_prompts", min=1)
    count, tokens = Dim("boxes", min=1, max=MAX_BOXES), Dim("geometry_tokens", min=1, max=MAX_BOXES + 1)
    image_inputs = features[:DECODE_IMAGE_INPUTS - 2]
    specs = {"encode_image": ((images,), ({0: batch},)),
             "encode_text": ((token_ids,), ({0: prompts},)),
             "encode_boxes": ((level2, position, boxes, labels), ({0: batch}, {0: batch}, {0: batch, 1: count},
                                                                   {0: batch, 1: count})),
             "decode": ((*image_inputs, *geometry, *text), (*[{0: batch}] * len(image_inputs),
                                                            *[{0: batch, 1: tokens}] * 2,
                                                            *[{0: prompts}] * len(text)))}
    programs = {}
    for name, (args, dims) in specs.items():
        try:
            with torch.no_grad():
                programs[name] = torch.export.export(Part(wrapper, name), args, dynamic_shapes={"args": dims})
        except Exception as e:
            raise ExportError(f"torch.export of {name} failed: {first_line(e)}") from e
    return programs


def export_subject(settings, stage: str):
    """What both export stages trace: (wrapper, example inputs, device), the checkpoint loaded in the build's
    precision on its device, and room checked for an archive that holds the weights once more."""
    import torch

    from ..pipeline.artifacts import check_free_space
    from ..pipeline.paths import ProfilePaths
    from .checkpoints import load_model
    from .configs import example_inputs
    from .grounding import Sam3Grounding

    paths, opts = ProfilePaths.of(settings), settings.stage("export")
    checkpoint = paths.checkpoint / "model.safetensors"
    if checkpoint.is_file():  # the archive holds the weights once more, in the build's dtype at most fp32
        check_free_space({paths.exported.parent: int(1.1 * checkpoint.stat().st_size) + (64 << 20)}, stage)
    device = torch.device(settings.device)
    if settings.spec.fp8_parts:
        from .fp8 import check_fp8_device

        if reason := check_fp8_device(device):
            raise ExportError(f"precision={settings.precision}: {reason}; build precision=bf16 on this machine")
    wrapper = Sam3Grounding.built_as(load_model(settings).to(device), settings)
    example = example_inputs(wrapper.model.config, opts["example_batch"], opts["example_prompts"], device=device)
    return wrapper, example, device


def transforms_example(opts: dict, device):
    """The image transforms' trace example, seeded: the archive stores it, so the same build gives the same bytes."""
    import torch

    seeded = torch.Generator().manual_seed(0)
    return (torch.rand(*opts["transforms_example_size"], generator=seeded) * 255).to(device)


def export_programs(wrapper, example, split: bool, transforms, example_image) -> tuple[dict, dict]:
    """The programs in their order (model; encode_image, encode_text, encode_boxes and decode where `split`, as the
    fallback's archive holds them; transforms), and the seconds each export took."""
    import time

    t0 = time.perf_counter()
    try:
        programs = {"model": export_model(wrapper, example)}
    except Exception as e:
        raise ExportError(f"torch.export of the SAM3 wrapper failed: {first_line(e)}") from e
    seconds = {"model": time.perf_counter() - t0}
    if split:
        t0 = time.perf_counter()
        programs.update(export_parts(wrapper, example))
        seconds["parts"] = time.perf_counter() - t0
    try:
        programs["transforms"] = export_transforms(transforms, example_image)
    except Exception as e:
        raise ExportError(f"torch.export of the image transforms failed: {first_line(e)}") from e
    return programs, seconds


def custom_ops_in(program) -> set[str]:
    """The project's own ops (`sam3_aoti::...`) a program calls: what a loader without this project lacks."""
    return {str(node.target) for node in program.graph.nodes
            if node.op == "call_function" and str(node.target).startswith("sam3_aoti.")}


def composed(programs: dict):
    """`decode(*encode_image(images), *encode_text(token_ids))` through the exported parts."""
    from ..model.grounding import DECODE_IMAGE_INPUTS

    image, text, decode = (programs[name].module() for name in ("encode_image", "encode_text", "decode"))
    return lambda images, token_ids: decode(*image(images)[:DECODE_IMAGE_INPUTS], *text(token_ids))


def composed_with_boxes(programs: dict):
    """`decode` of images, exemplar boxes and prompts through the exported parts (the grounding's own
    `with_boxes` is the eager side)."""
    from ..model.grounding import DECODE_IMAGE_INPUTS

    image, text, boxes, decode = (programs[name].module()
                                  for name in ("encode_image", "encode_text", "encode_boxes", "decode"))

    def run(images, token_ids, box_coordinates, labels):
        features = image(images)
        geometry = boxes(features[-1], features[3], box_coordinates, labels)
        return decode(*features[:DECODE_IMAGE_INPUTS - 2], *geometry, *text(token_ids))

    return run


def save_programs(programs: dict, path) -> None:
    """One PT2 archive, the same bytes for the same programs: each node's stack trace (absolute source paths
    and line numbers: another checkout, or a comment that moves a line, would change the bytes and the
    program digest) and its provenance (`from_node`: the passes that made it, naming graphs by their address
    in memory, different in every process; `run_decompositions` writes it) are left out. Each tensor's bytes are stored once (`shared_tensor_writer`): the split
    models hold model's own tensors, which torch's `package_pt2` writes again for every program."""
    from torch.export.pt2_archive._package import _package_exported_programs
    from torch.fx import GraphModule

    from ..runtime.torch_private import writes_without_self_check

    for program in programs.values():
        for module in program.graph_module.modules():
            if isinstance(module, GraphModule):
                for node in module.graph.nodes:
                    node.meta.pop("stack_trace", None)
                    node.meta.pop("from_node", None)
    with shared_tensor_writer(str(path)) as writer, writes_without_self_check():
        _package_exported_programs(writer, programs)


TENSOR_FILES = ("data/weights/weight_", "data/constants/tensor_")  # a program's tensors' bytes, one per file


def is_tensor_config(inner: str) -> bool:
    """A program's weights or constants config: each tensor's layout and the file holding its bytes."""
    return inner.startswith(("data/weights/", "data/constants/")) and inner.endswith("_config.json")


def shared_tensor_writer(path: str):
    """torch's PT2 archive writer, storing equal tensor files once: a file whose bytes an earlier one holds is
    not written, and the weights and constants configs written after it name the earlier file instead (each
    program still loads its own tensors from them). torch numbers the files by counting those written, so
    the ones left out count too."""
    from torch.export.pt2_archive._package import PT2ArchiveWriter

    class SharedTensorWriter(PT2ArchiveWriter):
        def __init__(self, target):
            super().__init__(target)
            self.first: dict[tuple[str, bytes], str] = {}  # (kind, sha256) -> the file holding those bytes
            self.same_as: dict[str, str] = {}  # a file left out -> the file holding its bytes

        def count_prefix(self, prefix: str) -> int:
            return super().count_prefix(prefix) + sum(name.startswith(prefix) for name in self.same_as)

        def write_bytes(self, name: str, data: bytes) -> None:
            kind = next((k for k in TENSOR_FILES if name.startswith(k)), None)
            if kind:
                key = (kind, hashlib.sha256(data).digest())
                if key in self.first:
                    self.same_as[name] = self.first[key]
                    return
                self.first[key] = name
            elif is_tensor_config(name):
                data = self.repointed(name.rsplit("/", 1)[0] + "/", data)
            super().write_bytes(name, data)

        def repointed(self, folder: str, config: bytes) -> bytes:
            payload = json.loads(config)
            for meta in payload["config"].values():
                stored = folder + meta["path_name"]
                meta["path_name"] = self.same_as.get(stored, stored)[len(folder):]
            return json.dumps(payload).encode()

    return SharedTensorWriter(path)


# Archive entries that hold values (weights, lifted constants, sample inputs) or a random id: the
# compiled code does not depend on them, so the program digest leaves them out.
VALUE_ENTRIES = (*TENSOR_FILES, "data/sample_inputs/", ".data/serialization_id")


def program_digest(archive: Path, programs: dict) -> dict:
    """Everything AOTInductor's output depends on, and nothing it does not: the serialized graphs,
    signatures, dynamic ranges and weight layouts (dtype, shape, stride, offset), plus the example shapes
    it tunes for. A new seed or checkpoint of the same architecture gives the same digest."""
    h = hashlib.sha256()
    with zipfile.ZipFile(archive) as zf:
        for inner, name in sorted(archive_entries(zf).items()):
            if not inner.startswith(VALUE_ENTRIES):
                h.update(inner.encode() + b"\0" + layout_only(inner, zf.read(name)) + b"\0")
    signature = {name: io_signature(program) for name, program in programs.items()}
    h.update(json.dumps(signature, sort_keys=True).encode())
    return {"sha256": h.hexdigest(), "programs": signature}


def layout_only(inner: str, data: bytes) -> bytes:
    """A tensor config without its files' names: which file holds a tensor's bytes depends on the values
    (equal tensors share one, `shared_tensor_writer`), its layout does not."""
    if not is_tensor_config(inner):
        return data
    payload = json.loads(data)
    for meta in payload["config"].values():
        meta.pop("path_name", None)
    return json.dumps(payload, sort_keys=True).encode()


def io_signature(program) -> dict:
    """Input and output shapes and dtypes at the trace example (the metadata of the package)."""
    import torch

    args, _ = program.example_inputs
    with torch.no_grad():
        outputs = program.module()(*args)
    outputs = (outputs,) if torch.is_tensor(outputs) else outputs
    described = [{"shape": list(t.shape), "dtype": str(t.dtype).removeprefix("torch.")} for t in outputs]
    return {"example_inputs": [{"shape": list(a.shape), "dtype": str(a.dtype).removeprefix("torch.")} for a in args],
            "outputs": described}


def write_if_changed(path: Path, text: str) -> bool:
    """Leave an equal file untouched, so its consumers see no change at all (early cutoff)."""
    if path.exists() and path.read_text() == text:
        return False
    write_text_atomic(path, text)
    return True


def save_with_digest(programs: dict, archive: Path, digest_path: Path, log) -> dict:
    """Save the programs (a temp file renamed at the end) and write their digest where it changed: an equal
    digest leaves the compile that reads it up to date."""
    from ..runtime.files import atomic_output, human_size

    with atomic_output(archive) as tmp:
        save_programs(programs, tmp)
    log.info("saved %s (%s)", archive, human_size(archive.stat().st_size))
    digest = program_digest(archive, programs)
    changed = write_if_changed(digest_path, json.dumps(digest, indent=2, sort_keys=True) + "\n")
    log.info("program digest %s (%s)", digest["sha256"][:12],
             "changed: compile reruns" if changed else "unchanged: the compiled code is reused")
    return digest
