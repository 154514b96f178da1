"""The tiny chain on a GPU (skipped without CUDA): toolchain doctor, CUDA AOTI package, verify gates."""

import importlib.util
import json

import pytest

from conftest import REPO, copy_repo, run_doit
from sam3_aoti.cuda_toolkit import load_pins


@pytest.mark.gpu
def test_tiny_pipeline_on_cuda(tmp_path):
    repo = copy_repo(tmp_path)
    run_doit(repo, "device=cuda")
    doctor = json.loads((repo / "artifacts" / "toolchain" / "doctor.json").read_text())
    assert doctor["verdict"].startswith("ok")
    assert doctor["toolkit"]["version"] == ".".join(doctor["torch_cuda"].split(".")[:2])
    if load_pins(doctor["toolkit"]["version"]):  # hermetic by default: the pinned wheels, not the machine's
        assert doctor["toolkit"]["source"] == "pip wheels", doctor["toolkit"]
    art = repo / "artifacts" / "tiny-fp32-cuda"
    assert json.loads((art / "verify" / "report.json").read_text())["passed"]
    from sam3_aoti.package import load_package

    package = load_package(art / "package" / "sam3.pt2")
    assert package.backends == {"model": "aoti", "transforms": "aoti"}
    assert package.metadata["device"] == "cuda" and package.metadata["versions"]["gpu"]


@pytest.mark.gpu
@pytest.mark.skipif(importlib.util.find_spec("sam3") is None, reason="needs Meta's sam3 package (scripts/fetch_gpu_wheels.sh)")
def test_parity_with_metas_sam3():
    """Full-size fp32 package vs Meta's implementation on the cases, same weights in Meta's format. Uses the
    repository's artifacts: after `doit compile profile=sam3 weights=random device=cuda` only parity runs."""
    run_doit(REPO, "parity", "profile=sam3", "weights=random", "device=cuda", "precision=fp32")
    report = json.loads((REPO / "artifacts" / "sam3-fp32-cuda" / "parity" / "parity.json").read_text())
    assert report["passed"], report["failures"]
    assert len(report["cases"]) >= 6 and all(case["top1_same"] for case in report["cases"])
