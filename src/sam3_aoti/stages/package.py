"""Stage `package`: the PT2 archive that `sam3_aoti.load_package` (runtime/loader.py) loads with nothing but torch.

`sam3.pt2` holds the AOTI models `model` and `transforms` (compiled code; the weights once, in the blob
AOTInductor's own loader reads; with `[export] split` also `encode_image`, `encode_text` and `decode`, which
read model's weights), `metadata.json` and the tokenizer's merges, and finds every consumer
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
from pathlib import Path

from ..aoti.weights_blob import write_weights_blob
from ..errors import PackageError, first_line
from ..pipeline.artifacts import check_free_space, mark, record, recorded_sha256
from ..pipeline.paths import ProfilePaths
from ..runtime.archive import METADATA_FILE, MODEL_NAMES, PART_NAMES, SHARED_WEIGHT_PARTS, VOCAB_FILE, fallback_of
from ..runtime.files import atomic_output, human_size, sha256
from ..runtime.integrity import digest_file, write_digest
from ..runtime.loader import load_aoti_runners

log = logging.getLogger(__spec__.name)  # not __name__: run by `python -m`, a stage is "__main__"


def build_metadata(settings, paths: ProfilePaths, index: dict, program: dict, parts: dict) -> dict:
    from ..pipeline.settings import package_version
    from ..runtime import contract
    from ..runtime.tokenizer import CONTEXT_LENGTH, END, PAD, SPECIAL_TOKENS, START

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
        "fp32_parts": list(settings.spec.fp32_parts),
        "fp8_parts": list(settings.spec.fp8_parts),
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
            **{name: part_metadata(program, name) for name in PART_NAMES if name in index["models"]},
        },
        "box_format": contract.BOX_FORMAT,
        "exemplars": {"model": "encode_boxes", "box_format": contract.BOX_FORMAT, "max_boxes": contract.MAX_BOXES,
                      "labels": {"positive": contract.POSITIVE, "negative": contract.NEGATIVE,
                                 "padding": contract.PADDING},
                      "prompt_without_phrase": contract.VISUAL_PROMPT} if "encode_boxes" in index["models"] else None,
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
            "checkpoint": recorded_sha256(paths.manifest, paths.checkpoint / "model.safetensors"),
            "program": program["sha256"],
        },
        "parts_sha256": parts,  # every compiled part, checked before any of it is loaded (integrity.py)
        "weights_layout": weights_layout(index),
    }


def weights_layout(index: dict) -> dict[str, list]:
    """How each weights blob is laid out, as the compiled code declares it (`aoti.compile.constants_table`): per
    model, its constants in blob order as [name, dtype, shape, stride, storage offset, bytes, on the GPU], so the
    loader builds them from the package's bytes (`runtime.constants`). Left out for a model whose compile record
    predates the fields, or holds a constant of another layout than strided."""
    layouts = {}
    for name, compiled in index["models"].items():
        constants = [c for c in compiled["constants"] if not c["folded"]]
        if name in SHARED_WEIGHT_PARTS or not constants or not all(c.get("strided") for c in constants):
            continue
        layouts[name] = [[c["name"], c["dtype"], c["shape"], c["stride"], c["offset"], c["bytes"], c["cuda"]]
                         for c in constants]
    return layouts


def part_metadata(program: dict, name: str) -> dict:
    """A split model's inputs and outputs (`contract`'s names), dim 0 named: images are `batch`, prompts
    `num_prompts`, pairs both."""
    from ..runtime import contract

    image, text, pairs = ["batch"], ["num_prompts"], ["batch*num_prompts"]
    inputs, input_dims, outputs, output_dims = {
        "encode_image": (("images",), image, contract.IMAGE_FEATURES, image * len(contract.IMAGE_FEATURES)),
        "encode_text": (("token_ids",), text, contract.TEXT_FEATURES, text * len(contract.TEXT_FEATURES)),
        "encode_boxes": (contract.BOX_INPUTS, image * len(contract.BOX_INPUTS), contract.GEOMETRY,
                         image * len(contract.GEOMETRY)),
        "decode": (contract.DECODE_INPUTS, image * 6 + text * 2, contract.OUTPUT_NAMES,
                   pairs * len(contract.OUTPUT_NAMES)),
    }[name]
    # the second dim, where it is dynamic: the boxes per image, and the geometry prompt's tokens (boxes + 1)
    second = {"encode_boxes": {"boxes": "boxes", "box_labels": "boxes", "geometry_prompt": "boxes+1",
                               "geometry_mask": "boxes+1"},
              "decode": {"geometry_prompt": "geometry_tokens", "geometry_mask": "geometry_tokens"}}.get(name, {})
    io = program["programs"][name]

    def described(labels, firsts, tensors):
        if len(tensors) != len(labels):
            raise PackageError(f"the exported {name} has {len(tensors)} tensors where {len(labels)} were expected: "
                               "run `uv run doit export` again")
        return {n: {"shape": [d, *([second[n]] if n in second else t["shape"][1:2]), *t["shape"][2:]],
                    "dtype": t["dtype"]} for n, d, t in zip(labels, firsts, tensors)}

    return {"inputs": described(inputs, input_dims, io["example_inputs"]), "input_order": list(inputs),
            "outputs": described(outputs, output_dims, io["outputs"]), "output_order": list(outputs),
            **({"weights_from": "model"} if name in SHARED_WEIGHT_PARTS else {})}  # shared: the loader hands it model's tensors


def check_shares_weights(exported: Path, index: dict, parts: list[str]) -> None:
    """The parts read `model`'s tensors at load time: each of their constants must be one of model's, of the
    same size and, in the exported archive, the same bytes (CRC-32 and size of the entries)."""
    import zipfile

    from ..aoti.weights_blob import tensor_entries

    model = {c["fqn"]: c for c in index["models"]["model"]["constants"] if not c["folded"]}
    with zipfile.ZipFile(exported) as archive:
        entries = {n: tensor_entries(archive, n) for n in ("model", *parts)}

        def stored(name: str, fqn: str) -> tuple[int, int]:
            info = archive.getinfo(entries[name][fqn])
            return info.CRC, info.file_size

        for name in parts:
            for c in index["models"][name]["constants"]:
                if c["folded"]:
                    continue
                theirs = model.get(c["fqn"])
                if theirs is None or theirs["bytes"] != c["bytes"] or stored("model", c["fqn"]) != stored(name, c["fqn"]):
                    raise PackageError(f"{name} reads the tensor {c['fqn']!r}, which model holds "
                                       f"{'otherwise' if theirs else 'not'}: the parts cannot share model's weights; "
                                       "run `uv run doit export compile` again")


def check_aoti_loads(path: Path) -> None:
    """A package whose AOTI models do not load here, where they were built, is no package."""
    try:
        load_aoti_runners(path)
    except Exception as e:
        raise PackageError(f"the fresh package's AOTI models do not load: {first_line(e)}") from e


def link_or_copy(source: Path, target: Path) -> None:
    """The fallback is the export stage's portable archive as it is: a hard link where the filesystem allows."""
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
        link_or_copy(paths.exported_portable, tmp)
    write_digest(paths.fallback_package)
    check_shares_weights(paths.exported, index, [n for n in SHARED_WEIGHT_PARTS if n in index["models"]])
    with atomic_output(paths.package) as tmp:
        aoti_files, parts = {}, {}
        for name in index["models"]:
            compiled = index["models"][name]
            files = [paths.compiled / name / f for f in compiled["files"]]
            blob = tmp.parent / compiled["blob"]
            if name not in SHARED_WEIGHT_PARTS and write_weights_blob(paths.exported, name, compiled, blob):
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


if __name__ == "__main__":
    from ..pipeline.runner import main

    main("package", run, __doc__.splitlines()[0])
