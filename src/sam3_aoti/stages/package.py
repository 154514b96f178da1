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
from ..pipeline.package_metadata import exported_signatures, interface_metadata
from ..pipeline.paths import ProfilePaths
from ..runtime.archive import METADATA_FILE, MODEL_NAMES, PART_NAMES, SHARED_WEIGHT_PARTS, VOCAB_FILE, fallback_of
from ..runtime.files import atomic_output, human_size, sha256
from ..runtime.integrity import digest_file, write_digest
from ..runtime.loader import load_aoti_runners

log = logging.getLogger(__spec__.name)  # not __name__: run by `python -m`, a stage is "__main__"


def build_metadata(settings, paths: ProfilePaths, index: dict, program: dict, parts: dict) -> dict:
    """`program`: the exported programs' signatures and digests (`exported_signatures`)."""
    from ..pipeline.settings import package_version

    return {
        **interface_metadata(settings, program, [name for name in PART_NAMES if name in index["models"]]),
        "variant": settings.variant,
        "weights": settings.weights,
        "random_weights": settings.weights == "random",
        "precision": settings.precision,
        "fp32_parts": list(settings.spec.fp32_parts),
        "fp8_parts": list(settings.spec.fp8_parts),
        "versions": {**index["platform"], "transformers": package_version("transformers")},
        "inductor_options": index["inductor_options"],
        "toolchain": index["toolchain"],
        "fallback": fallback_of(paths.package).name,
        "inputs_sha256": {
            "checkpoint": recorded_sha256(paths.manifest, paths.checkpoint / "model.safetensors"),
            **program["sha256"],
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


def compiled_programs(paths: ProfilePaths, split: bool) -> tuple[dict, dict, dict]:
    """Both compiles' indexes as one (model's and transforms', and the parts'), each checked to be for the
    exported programs here; which archive holds each program, and which folder its compiled files."""
    index, archives, folders = None, {}, {}
    for stage in ("compile", "compile_parts") if split else ("compile",):
        archive, _, digest_path, folder = paths.compiled_archive(stage)
        compiled = json.loads((folder / "index.json").read_text())
        if compiled["program_sha256"] != json.loads(digest_path.read_text())["sha256"]:
            raise PackageError(f"the compiled code is for another exported program: run `uv run doit {stage}`")
        index = compiled if index is None else {**index, "models": {**index["models"], **compiled["models"]}}
        archives.update(dict.fromkeys(compiled["models"], archive))
        folders.update(dict.fromkeys(compiled["models"], folder))
    index["models"] = {n: index["models"][n] for n in ("model", *PART_NAMES, "transforms") if n in index["models"]}
    return index, archives, folders


def check_shares_weights(archives: dict[str, Path], index: dict, parts: list[str]) -> None:
    """The parts read `model`'s tensors at load time: each of their constants must be one of model's, of the
    same size and, in the exported archives, the same bytes (CRC-32 and size of the entries)."""
    import zipfile

    from ..aoti.weights_blob import tensor_entries

    model = {c["fqn"]: c for c in index["models"]["model"]["constants"] if not c["folded"]}

    def stored(name: str) -> dict[str, tuple[int, int]]:
        with zipfile.ZipFile(archives[name]) as archive:
            return {fqn: (archive.getinfo(entry).CRC, archive.getinfo(entry).file_size)
                    for fqn, entry in tensor_entries(archive, name).items()}

    models = stored("model")
    for name in parts:
        theirs_stored = stored(name)
        for c in index["models"][name]["constants"]:
            if c["folded"]:
                continue
            theirs = model.get(c["fqn"])
            if theirs is None or theirs["bytes"] != c["bytes"] or models[c["fqn"]] != theirs_stored[c["fqn"]]:
                raise PackageError(f"{name} reads the tensor {c['fqn']!r}, which model holds "
                                   f"{'otherwise' if theirs else 'not'}: the parts cannot share model's weights; "
                                   "run `uv run doit export export_parts compile compile_parts` again")


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
    index, archives, folders = compiled_programs(paths, settings.split)
    program = exported_signatures(paths, settings.split)
    weights = sum(index["models"][n]["blob_bytes"] for n in MODEL_NAMES)
    check_free_space({paths.package.parent: 2 * weights + (10 << 20)}, "package")  # the blob, then the archive
    t0 = time.perf_counter()
    with atomic_output(paths.fallback_package) as tmp:
        link_or_copy(paths.exported_portable, tmp)
    write_digest(paths.fallback_package)
    check_shares_weights(archives, index, [n for n in SHARED_WEIGHT_PARTS if n in index["models"]])
    with atomic_output(paths.package) as tmp:
        aoti_files, parts = {}, {}
        for name in index["models"]:
            compiled = index["models"][name]
            files = [folders[name] / name / f for f in compiled["files"]]
            blob = tmp.parent / compiled["blob"]
            if name not in SHARED_WEIGHT_PARTS and write_weights_blob(archives[name], name, compiled, blob):
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
        "weights_bytes": weights, "program_sha256": program["sha256"]["program"], **settings.fingerprint("package"),
    })
    mark(paths.manifest, "verify", verified=False)  # a new package is unverified until verify passes


if __name__ == "__main__":
    from ..pipeline.runner import main

    main("package", run, __doc__.splitlines()[0])
