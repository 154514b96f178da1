"""The loader: AOTI runners first, exported programs when the AOTI part cannot load; atomic artifacts."""

import shutil
import zipfile

import pytest
import torch

from sam3_aoti.artifacts import atomic_output
from sam3_aoti.errors import PackageError
from sam3_aoti.model import example_inputs
from sam3_aoti.package import load_package


@pytest.fixture(scope="module")
def package_path(built_repo):
    return built_repo / "artifacts" / "tiny" / "package" / "sam3.pt2"


def test_loads_aoti_runners_with_metadata_and_vocabulary(package_path):
    package = load_package(package_path)
    assert package.backends == {"model": "aoti", "transforms": "aoti"} and package.fallback_reason is None
    assert package.metadata["models"]["model"]["dynamic_dims"] == {"batch": {"min": 1}, "num_prompts": {"min": 1}}
    assert package.metadata["score"] == "sigmoid(pred_logits) * sigmoid(presence_logit_dec)"
    assert package.encode_prompts(["a dog"])[0, :4].tolist() == [49406, 320, 1929, 49407]


def test_falls_back_to_exported_programs_when_aoti_cannot_load(package_path, tmp_path, tiny_model):
    broken = tmp_path / "broken.pt2"
    with zipfile.ZipFile(package_path) as src, zipfile.ZipFile(broken, "w") as dst:
        for item in src.infolist():
            data = src.read(item)
            if item.filename.endswith(".so"):
                data = b"not an ELF file"
            dst.writestr(item, data)
    package = load_package(broken)
    assert package.backends == {"model": "exported", "transforms": "exported"}
    assert package.fallback_reason
    reference = load_package(package_path)
    args = example_inputs(tiny_model.config, 2, 2, seed=3)
    with torch.no_grad():
        for got, want in zip(package.model(*args), reference.model(*args)):
            torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_aoti_runner_reads_permuted_inputs_correctly(package_path):
    package = load_package(package_path)
    hwc = torch.rand(97, 150, 3) * 255
    permuted = hwc.permute(2, 0, 1)[None]  # a view: not row-major
    assert not permuted.is_contiguous()
    torch.testing.assert_close(package.transforms(permuted), package.transforms(permuted.contiguous()))


def test_missing_package_is_a_clear_error(tmp_path):
    with pytest.raises(PackageError, match="no package at .*uv run doit compile"):
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
