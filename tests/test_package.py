"""The package: weights once, loads without deserializing programs; the fallback beside it; atomic artifacts."""

import json
import shutil
import zipfile

import pytest
import torch

from sam3_aoti.runtime.files import atomic_output
from sam3_aoti.errors import PackageError
from sam3_aoti.model.configs import example_inputs, tiny_config
from sam3_aoti.runtime.loader import load_package
from sam3_aoti.runtime.contract import OUTPUT_NAMES
from sam3_aoti.pipeline.gates import output_limit
from sam3_aoti.pipeline.paths import fallback_of
from sam3_aoti.pipeline.settings import load_settings
from torch.export.pt2_archive._package import load_pt2

from helpers import TINY, TINY_MODELS as MODELS, rewrite_package


def test_loads_aoti_runners_with_metadata_and_vocabulary(package_path):
    package = load_package(package_path)
    assert package.backends == dict.fromkeys(MODELS, "aoti") and package.fallback_reason is None
    assert package.metadata["models"]["model"]["dynamic_dims"] == {"batch": {"min": 1}, "num_prompts": {"min": 1}}
    assert package.metadata["score"] == "sigmoid(pred_logits) * sigmoid(presence_logit_dec)"
    assert package.encode_prompts(["a dog"])[0, :4].tolist() == [49406, 320, 1929, 49407]


def test_the_package_stores_the_weights_once_and_no_exported_program(package_path, built_repo):
    """One blob per model holds the weights; the exported programs (and their copy of the weights, their
    sample inputs) live in the fallback beside the package, so no loader deserializes them."""
    with zipfile.ZipFile(package_path) as archive:
        inner = {i.filename.split("/", 1)[1]: i.file_size for i in archive.infolist()}
    assert not [n for n in inner if n.startswith(("models/", "data/weights/", "data/constants/", "data/sample_inputs/"))]
    blobs = {n: size for n, size in inner.items() if n.endswith("_weights.blob")}
    # transforms has no constants, the parts read model's; encode_boxes holds the box encoder, which model never reads
    assert sorted(n.split("/")[2] for n in blobs) == ["encode_boxes", "model"]
    with zipfile.ZipFile(built_repo / TINY / "export" / "programs.pt2") as archive:  # the tensors model's graph uses
        configs = [json.loads(archive.read(i))["config"] for i in archive.infolist()
                   if i.filename.endswith(("model_weights_config.json", "model_constants_config.json"))]
        names = {meta["path_name"] for config in configs for meta in config.values()}
        tensors = sum(i.file_size for i in archive.infolist() if i.filename.rsplit("/", 1)[-1] in names)
    assert 0.9 * tensors <= sum(blobs.values()) <= 1.05 * tensors  # once (unused tensors are dropped)
    code = sum(size for n, size in inner.items() if n.startswith("data/aotinductor/") and n not in blobs)
    extra = sum(size for n, size in inner.items() if n.startswith("extra/"))  # metadata, tokenizer vocabulary
    assert package_path.stat().st_size <= 1.05 * (sum(blobs.values()) + code + extra)


def test_weights_are_read_in_place_from_the_package_as_the_blob_file_gives_them(package_path, tmp_path, monkeypatch):
    """A package whose digest matched builds its weights straight from its own bytes, by the layout its metadata
    records (`runtime.constants`): no weights blob is written out. Its models give what the blob file gives
    them (a trusted copy with no digest loads that way), bit for bit. A layout that does not add up to its blob
    is not used: that blob is unpacked."""
    from sam3_aoti.runtime import reader
    from sam3_aoti.runtime.integrity import write_digest

    from helpers import rewrite_package

    def short_layout(name, data):
        if name.endswith("extra/metadata.json"):
            metadata = json.loads(data)
            metadata["weights_layout"]["model"].pop()
            return json.dumps(metadata).encode()
        return data

    trusted = tmp_path / "trusted" / "sam3.pt2"
    short = rewrite_package(package_path, tmp_path / "short.pt2", short_layout)
    write_digest(short)
    trusted.parent.mkdir()
    shutil.copy(package_path, trusted)
    shutil.copy(fallback_of(package_path), fallback_of(trusted))
    unpacked, real_copy = [], reader.PackageFile.copy_entry
    monkeypatch.setattr(reader.PackageFile, "copy_entry",
                        lambda self, inner, dst: unpacked.append(inner) or real_copy(self, inner, dst))

    def blobs_unpacked_by(path, **trust) -> list[str]:
        unpacked.clear()
        load_package(path, **trust)
        return sorted(name.split("/")[2] for name in unpacked if name.endswith("_weights.blob"))

    assert blobs_unpacked_by(short) == ["model"]
    in_place, from_files = load_package(package_path), load_package(trusted, trust=True)
    assert sorted(in_place.metadata["weights_layout"]) == ["encode_boxes", "model"]
    assert blobs_unpacked_by(package_path) == [] and blobs_unpacked_by(trusted, trust=True) == ["encode_boxes", "model"]
    images, token_ids = example_inputs(tiny_config(), 2, 3, seed=4)
    boxes = torch.tensor([[[0.5, 0.5, 0.2, 0.3]], [[0.3, 0.6, 0.1, 0.1]]])
    with torch.no_grad():
        for a, b in zip(in_place.model(images, token_ids), from_files.model(images, token_ids)):
            assert torch.equal(a, b)
        for a, b in zip(in_place.model_with_boxes(images, token_ids, boxes),
                        from_files.model_with_boxes(images, token_ids, boxes)):
            assert torch.equal(a, b)


def test_a_production_loader_finds_the_aoti_runners_and_nothing_to_deserialize(package_path):
    contents = load_pt2(str(package_path))
    assert set(contents.aoti_runners) == set(MODELS) and contents.exported_programs == {}


def for_another_device(package_path, target):
    """A copy of the package whose AOTI part says it was built for CUDA; its fallback beside it."""
    def to_cuda(name, data):
        if name.endswith("_metadata.json") and "/data/aotinductor/" in name:
            return data.replace(b'"AOTI_DEVICE_KEY": "cpu"', b'"AOTI_DEVICE_KEY": "cuda"')
        return data

    return rewrite_package(package_path, target, to_cuda, digest=True)  # built so, by its builder


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA package loads where CUDA is")
def test_falls_back_to_exported_programs_when_the_aoti_part_is_for_cuda(package_path, tmp_path, tiny_model):
    package = load_package(for_another_device(package_path, tmp_path / "sam3.pt2"))
    assert package.backends == dict.fromkeys(MODELS, "exported")
    assert package.fallback_reason
    reference = load_package(package_path)
    assert reference.backends == dict.fromkeys(MODELS, "aoti")
    images, token_ids = example_inputs(tiny_model.config, 2, 2, seed=3)
    raw = torch.rand(2, 3, 97, 150) * 255
    gate = load_settings(device="cpu").tables["verify"]["tolerances"]["fp32"]  # verify's own fp32 gate
    with torch.no_grad():
        torch.testing.assert_close(package.transforms(raw), reference.transforms(raw), atol=1e-4, rtol=1e-5)
        for name, got, want in zip(OUTPUT_NAMES, package.model(images, token_ids), reference.model(images, token_ids)):
            # the two backends sum in other orders (1.1e-5 apart at a mask logit of 0.013)
            torch.testing.assert_close(got, want, rtol=0, atol=output_limit(gate, want.abs().max().item(), name))


@pytest.mark.skipif(torch.cuda.is_available(), reason="a CUDA package loads where CUDA is")
def test_no_fallback_beside_an_unloadable_package_is_a_clear_error(package_path, tmp_path):
    path = for_another_device(package_path, tmp_path / "sam3.pt2")
    fallback_of(path).unlink()
    with pytest.raises(PackageError, match="no exported-program fallback sam3.exported.pt2 beside"):
        load_package(path)


def test_aoti_runner_reads_permuted_inputs_correctly(package_path):
    package = load_package(package_path)
    hwc = torch.rand(97, 150, 3) * 255
    permuted = hwc.permute(2, 0, 1)[None]  # a view: not row-major
    assert not permuted.is_contiguous()
    torch.testing.assert_close(package.transforms(permuted), package.transforms(permuted.contiguous()))


def test_missing_package_is_a_clear_error(tmp_path):
    with pytest.raises(PackageError, match="no package at .*uv run doit package"):
        load_package(tmp_path / "nothing.pt2")


def test_atomic_output_leaves_nothing_behind_when_interrupted(tmp_path):
    target = tmp_path / "out" / "model.pt2"
    with atomic_output(target) as tmp:
        tmp.write_text("first")
    with pytest.raises(KeyboardInterrupt):
        with atomic_output(target) as tmp:
            tmp.write_text("half written")
            raise KeyboardInterrupt
    assert target.read_text() == "first"
    assert [p.name for p in target.parent.iterdir()] == ["model.pt2"]


def test_atomic_output_replaces_a_folder(tmp_path):
    target = tmp_path / "render"
    for text in ("old", "new"):
        with atomic_output(target) as tmp:
            tmp.mkdir()
            (tmp / "index.md").write_text(text)
    assert (target / "index.md").read_text() == "new"
    shutil.rmtree(target)


def test_compiled_code_reading_a_tensor_derived_from_the_weights_is_refused(built_repo):
    """A constant AOTInductor made from the weights (max-autotune's CPU GEMM templates pack them: seen as
    `constant357` on the tiny model) is in no exported program, so a new checkpoint could not be packaged."""

    from sam3_aoti.aoti.compile import check_constants_are_weights
    from sam3_aoti.errors import CompileError

    exported = built_repo / TINY / "export" / "programs.pt2"
    constants = json.loads((built_repo / TINY / "compiled" / "index.json").read_text())["models"]["model"]["constants"]
    check_constants_are_weights("model", constants, exported)  # the real build's constants: all weights
    packed = {"name": "constant357", "fqn": "", "bytes": 64, "folded": False, "cuda": False}
    with pytest.raises(CompileError, match="derived from the weights"):
        check_constants_are_weights("model", [*constants, packed], exported)


def test_the_blob_check_compares_every_byte_and_the_length(built_repo, tmp_path):
    """The compile stage's check that the package stage rebuilds AOTInductor's blob: equal on the blob the writer
    makes, refused for one byte changed, a byte more or a byte less."""
    from sam3_aoti.aoti.weights_blob import blob_matches, write_weights_blob

    exported = built_repo / TINY / "export" / "programs.pt2"
    entry = json.loads((built_repo / TINY / "compiled" / "index.json").read_text())["models"]["model"]
    blob = tmp_path / "model.blob"
    size = write_weights_blob(exported, "model", entry, blob)
    assert size == entry["blob_bytes"] > 0 and blob_matches(exported, "model", entry, blob)
    data = blob.read_bytes()
    for changed in (data[:size // 2] + bytes([data[size // 2] ^ 1]) + data[size // 2 + 1:], data + b"\0", data[:-1]):
        blob.write_bytes(changed)
        assert not blob_matches(exported, "model", entry, blob)


def test_the_compile_index_says_where_each_compile_spent_its_time(built_repo):
    """compile_phases: Inductor's own phase timings of each program's compile; the C++ build of the wrapper
    is always one of them, and no phase outlasts the whole compile."""

    index = json.loads((built_repo / TINY / "compiled" / "index.json").read_text())
    for name in ("model", "transforms"):
        phases = index["compile_phases"][name]
        assert phases["AotCodeCompiler.compile"] > 0, phases
        assert max(phases.values()) <= index["compile_seconds"][name]
        assert not any(k.startswith("pass.") for k in phases)
