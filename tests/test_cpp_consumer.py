"""examples/cpp: a service without Python loads the package with libtorch and gets Python's answer."""

import re
import shutil
import subprocess

import pytest
import torch

from sam3_aoti.runtime.loader import load_package

from helpers import REPO, TINY

TOKENS = [49406, 320, 1929, 49407]  # "a dog"


def synthetic_image(height: int, width: int) -> torch.Tensor:
    """The picture main.cpp makes, the same operations in the same order."""
    y = torch.arange(height, dtype=torch.float).view(1, 1, height, 1)
    x = torch.arange(width, dtype=torch.float).view(1, 1, 1, width)
    c = torch.arange(3, dtype=torch.float).view(1, 3, 1, 1)
    return 127.5 * (1 + torch.sin(0.05 * y + 0.03 * x + c))


@pytest.mark.slow
def test_cpp_consumer_loads_and_runs_the_package(built_repo, tmp_path):
    compiler = shutil.which("c++") or shutil.which("g++")
    if not compiler:
        pytest.skip("no C++ compiler (c++ or g++) on PATH: the C++ consumer cannot be built here")
    cmake = shutil.which("cmake")
    if not cmake:
        pytest.skip("no cmake on PATH: the C++ consumer cannot be built here")
    build = tmp_path / "build"
    for command in ([cmake, "-S", str(REPO / "examples" / "cpp"), "-B", str(build),
                     f"-DCMAKE_PREFIX_PATH={torch.utils.cmake_prefix_path}", f"-DCMAKE_CXX_COMPILER={compiler}"],
                    [cmake, "--build", str(build), "-j2"]):
        proc = subprocess.run(command, capture_output=True, text=True)
        assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]

    package = built_repo / TINY / "package" / "sam3.pt2"
    proc = subprocess.run([str(build / "sam3_consumer"), str(package), "97", "150", *map(str, TOKENS)],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr[-3000:]
    top = re.search(r"top score ([\d.e-]+) at query (\d+)", proc.stdout)
    assert top and "pred_masks [1, " in proc.stdout, proc.stdout

    ours = load_package(package)
    ids = torch.zeros(1, 32, dtype=torch.long)
    ids[0, :len(TOKENS)] = torch.tensor(TOKENS)
    with torch.no_grad():
        logits, _, _, presence = ours.model(ours.transforms(synthetic_image(97, 150)), ids)
    scores = (logits[..., 0].sigmoid() * presence.sigmoid()).flatten()
    assert int(top.group(2)) == scores.argmax().item()
    assert abs(float(top.group(1)) - scores.max().item()) < 1e-6

    proc = subprocess.run([str(build / "sam3_consumer"), str(tmp_path / "missing.pt2")], capture_output=True, text=True)
    assert proc.returncode == 1 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
