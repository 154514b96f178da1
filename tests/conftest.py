import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
TINY = "artifacts/tiny-fp32-cpu"  # the tiny profile's variant folder on the CPU, relative to a repo


def pytest_configure(config):
    """Remembered package checks (integrity.py) go to a folder of this run, not the user's cache."""
    import tempfile

    os.environ["SAM3_AOTI_CACHE"] = tempfile.mkdtemp(prefix="sam3-aoti-cache-")


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def copy_repo(dest: Path) -> Path:
    """The files `uv run doit` needs, in a fresh folder (no artifacts, no doit state)."""
    for name in ("dodo.py", "pipeline.toml", "cases.toml"):
        shutil.copy(REPO / name, dest / name)
    for name in ("src", "tasks", "env"):
        if (REPO / name).exists():
            shutil.copytree(REPO / name, dest / name, ignore=shutil.ignore_patterns("__pycache__", "cuda.env"))
    return dest


def run_doit(repo: Path, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    path = os.pathsep.join(filter(None, [str(repo / "src"), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run([sys.executable, "-m", "doit", *args], cwd=repo, env=env, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise AssertionError(f"doit {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


def executed(proc: subprocess.CompletedProcess) -> set[str]:
    """Tasks doit ran (". name") as opposed to found up to date ("-- name")."""
    return {line[3:].strip() for line in proc.stdout.splitlines() if line.startswith(".  ")}


@pytest.fixture(scope="session")
def built_repo(tmp_path_factory) -> Path:
    """A temp copy of the repo after one full `doit` run of the tiny profile on the CPU."""
    repo = copy_repo(tmp_path_factory.mktemp("repo"))
    run_doit(repo, "device=cpu")
    return repo


@pytest.fixture(scope="session")
def tiny_model():
    """The tiny profile's random-init model, as the weights stage builds it from pipeline.toml."""
    from sam3_aoti.config import load_settings
    from sam3_aoti.weights import build_model

    return build_model(load_settings(device="cpu"))


def hf_tokenizer_files(folder: Path, merges_text: str) -> None:
    """vocab.json + merges.txt as transformers' CLIPTokenizer saves them, built from CLIP's merges."""
    from sam3_aoti.tokenizer import _NUM_MERGES, _bytes_to_unicode

    merges = merges_text.split("\n")[1 : _NUM_MERGES + 1]
    vocab = list(_bytes_to_unicode().values())
    vocab = vocab + [v + "</w>" for v in vocab] + ["".join(m.split()) for m in merges]
    vocab += ["<|startoftext|>", "<|endoftext|>"]
    (folder / "vocab.json").write_text(json.dumps({t: i for i, t in enumerate(vocab)}))
    (folder / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")


def rewrite_package(package: Path, target: Path, edit, resign: bool = True) -> Path:
    """A copy of `package` at `target` with `edit(name, data)` applied to its entries, and its fallback (with
    the fallback's digest) beside it. `resign` updates the metadata's part digests to the edited bytes, as a
    builder would; without it the copy is what a tamperer leaves."""
    import hashlib
    import zipfile

    from sam3_aoti.integrity import digest_file
    from sam3_aoti.paths import fallback_of

    with zipfile.ZipFile(package) as src:
        entries = [(item, edit(item.filename, src.read(item))) for item in src.infolist()]
    if resign:
        for i, (item, data) in enumerate(entries):
            if item.filename.endswith("extra/metadata.json"):
                metadata = json.loads(data)
                for other, other_data in entries:
                    part = other.filename.split("/", 1)[1]
                    if part in metadata.get("parts_sha256", {}):
                        metadata["parts_sha256"][part] = hashlib.sha256(other_data).hexdigest()
                entries[i] = (item, json.dumps(metadata).encode())
    with zipfile.ZipFile(target, "w") as dst:
        for item, data in entries:
            dst.writestr(item, data)
    shutil.copy(fallback_of(package), fallback_of(target))
    shutil.copy(digest_file(fallback_of(package)), digest_file(fallback_of(target)))
    return target
