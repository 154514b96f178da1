"""The tiny chain on a GPU (skipped without CUDA): toolchain doctor, CUDA AOTI package, verify gates."""

import json

import pytest

from conftest import copy_repo, run_doit


@pytest.mark.gpu
def test_tiny_pipeline_on_cuda(tmp_path):
    repo = copy_repo(tmp_path)
    run_doit(repo, "device=cuda")
    doctor = json.loads((repo / "artifacts" / "toolchain" / "doctor.json").read_text())
    assert doctor["verdict"].startswith("ok")
    assert doctor["toolkit"]["version"] == ".".join(doctor["torch_cuda"].split(".")[:2])
    art = repo / "artifacts" / "tiny"
    assert json.loads((art / "verify" / "report.json").read_text())["passed"]
    from sam3_aoti.package import load_package

    package = load_package(art / "package" / "sam3.pt2")
    assert package.backends == {"model": "aoti", "transforms": "aoti"}
    assert package.metadata["device"] == "cuda" and package.metadata["versions"]["gpu"]
