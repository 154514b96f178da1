"""Installable as what it is: the wheel is the runtime (torch and a few small packages), the build is an extra.

The wheel is built by `uv build` and installed into a fresh venv beside torch alone (uv takes torch from its
cache); there `load_package`, `encode_prompts`, `sam3-aoti predict` and `info` run on the tiny package, with
transformers and doit not even installed. A plain pip (no uv, no overrides) resolves `.[build]` without the
torchvision that breaks `import transformers`.
"""

import json
import os
import shutil
import subprocess
import sys
import zipfile
from importlib import metadata
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from helpers import REPO, TINY, TINY_MODELS


def uv() -> str:
    found = shutil.which("uv")
    if not found:
        pytest.fail("uv is not on PATH: .ci/run installs it (python3 -m pip install uv)")
    return found


def run(*args, **kwargs) -> subprocess.CompletedProcess:
    proc = subprocess.run([str(a) for a in args], capture_output=True, text=True, **kwargs)
    assert proc.returncode == 0, f"{args}: {proc.stdout[-2000:]}\n{proc.stderr[-3000:]}"
    return proc


@pytest.fixture(scope="module")
def runtime_venv(tmp_path_factory) -> Path:
    """A fresh venv holding the built wheel, torch (the version the tests run) and what the wheel asks for."""
    tmp = tmp_path_factory.mktemp("wheel")
    run(uv(), "build", "--wheel", "--out-dir", tmp / "dist", REPO)
    wheel = next((tmp / "dist").glob("sam3_aoti-*.whl"))
    venv = tmp / "venv"
    run(uv(), "venv", "--python", sys.executable, venv)
    run(uv(), "pip", "install", "--python", venv / "bin" / "python", wheel, f"torch=={metadata.version('torch')}")
    return venv


def clean_env() -> dict:
    """No PYTHONPATH and no project venv: only what the fresh venv installed can be imported."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "VIRTUAL_ENV")}


def test_the_wheel_ships_the_runtime_its_vocabulary_and_types(tmp_path):
    run(uv(), "build", "--wheel", "--out-dir", tmp_path, REPO)
    with zipfile.ZipFile(next(tmp_path.glob("sam3_aoti-*.whl"))) as wheel:
        names = wheel.namelist()
        meta = wheel.read(next(n for n in names if n.endswith(".dist-info/METADATA"))).decode()
    for part in ("sam3_aoti/py.typed", "sam3_aoti/__main__.py", "sam3_aoti/runtime/vocab/bpe_simple_vocab_16e6.txt.gz",
                 "sam3_aoti/runtime/vocab/LICENSE", "sam3_aoti/runtime/loader.py"):
        assert part in names, part
    requires = [line.split(":", 1)[1].strip() for line in meta.splitlines() if line.startswith("Requires-Dist:")]
    runtime = [r for r in requires if "extra ==" not in r]
    assert {r.split(">")[0].split("=")[0].split("<")[0] for r in runtime} == {"torch", "numpy", "pillow", "regex", "ftfy"}
    assert any(r.startswith("transformers") and "extra == 'build'" in r.replace('"', "'") for r in requires)


def test_the_runtime_alone_loads_and_predicts_without_the_build(built_repo, runtime_venv, tmp_path):
    python = runtime_venv / "bin" / "python"
    package = built_repo / TINY / "package" / "sam3.pt2"
    Image.fromarray(np.full((60, 80, 3), 120, np.uint8)).save(tmp_path / "grey.png")
    probe = f"""
import importlib.util, json, sys
import sam3_aoti.runtime
loaded = sorted(m for m in ("transformers", "doit", "sam3_aoti.pipeline", "sam3_aoti.stages") if m in sys.modules)
import torch
from sam3_aoti import __version__, encode_prompts, load_package
package = load_package({str(package)!r})
token_ids = encode_prompts(["a grey square", "a cat"])
images = package.transforms(torch.full((1, 3, 60, 80), 120.0))
outputs = package.model(images, token_ids)
print(json.dumps({{"loaded": loaded, "version": __version__, "file": sam3_aoti.runtime.__file__,
                  "importable": [m for m in ("transformers", "doit", "skimage") if importlib.util.find_spec(m)],
                  "shapes": [list(o.shape) for o in outputs], "backend": package.backends["model"]}}))
"""
    result = json.loads(run(python, "-c", probe, cwd=tmp_path, env=clean_env()).stdout.strip().splitlines()[-1])
    assert result["loaded"] == [] and result["importable"] == []
    assert result["file"].startswith(str(runtime_venv)) and result["version"] == metadata.version("sam3-aoti")
    assert result["backend"] == "aoti" and result["shapes"][0][0] == 2
    cli = runtime_venv / "bin" / "sam3-aoti"
    proc = run(cli, "predict", package, "--image", tmp_path / "grey.png", "--prompt", "a grey square",
               "--output", tmp_path / "out" / "grey", cwd=tmp_path, env=clean_env())
    assert "instance(s)" in proc.stdout and json.loads((tmp_path / "out" / "grey.json").read_text())["prompts"]
    info = json.loads(run(cli, "info", package, "--json", cwd=tmp_path, env=clean_env()).stdout)
    assert set(info["models"]) == set(TINY_MODELS)
    version = run(python, "-m", "sam3_aoti", "--version", cwd=tmp_path, env=clean_env()).stdout
    assert version.strip() == f"sam3-aoti {metadata.version('sam3-aoti')}"
    bad = subprocess.run([str(cli), "predict", str(package), "--image", str(tmp_path / "none.png"), "--prompt", "x"],
                         cwd=tmp_path, env=clean_env(), capture_output=True, text=True)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and "no image at" in bad.stderr
    # the binary cache is an extra: without it, `pull` says how to get it, in one line
    pull = subprocess.run([str(cli), "pull", "s3://models/sam3-cache", "sam3-bf16-cuda@NVIDIA-H200", str(tmp_path / "d")],
                          cwd=tmp_path, env=clean_env(), capture_output=True, text=True)
    assert pull.returncode == 2 and len(pull.stderr.strip().splitlines()) == 1, pull.stderr
    assert "pip install 'sam3-aoti[cache]'" in pull.stderr


@pytest.mark.slow
def test_a_plain_pip_resolves_the_build_without_torchvision(tmp_path):
    """`pip install '.[build]'` as a user without uv would run it (a dry run: the resolution, not 3 GB of wheels).
    torchvision and timm (which open-clip-torch used to pull in) would break `import transformers`."""
    run(sys.executable, "-m", "venv", tmp_path / "venv")
    run(tmp_path / "venv" / "bin" / "pip", "install", "--quiet", "--dry-run", "--ignore-installed", "--report",
        tmp_path / "report.json", f"{REPO}[build]")
    names = {item["metadata"]["name"].lower() for item in json.loads((tmp_path / "report.json").read_text())["install"]}
    assert {"sam3-aoti", "torch", "transformers", "doit", "scikit-image", "safetensors"} <= names
    assert not {"torchvision", "timm", "open-clip-torch"} & names
