"""Fixtures and hooks only (shared helpers live in helpers.py). No torch at collection: the quick loop starts fast."""

import os
import shutil
from pathlib import Path

import pytest

from helpers import TINY, copy_repo, run_doit, start_doit


def pytest_configure(config):
    """Remembered package checks (integrity.py) go to a folder of this run, not the user's cache."""
    import tempfile

    os.environ["SAM3_AOTI_CACHE"] = tempfile.mkdtemp(prefix="sam3-aoti-cache-")


def pytest_collection_modifyitems(config, items):
    """A test that needs the tiny build (minutes on a CPU) or starts the S3 server is `slow`, as is one marked so
    for a compile, an export or a process of its own: `pytest -m "not slow"` is the quick loop. GPU tests are
    skipped where no NVIDIA driver is loaded (told without importing torch)."""
    from sam3_aoti.pipeline.settings import gpu_present

    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if {"built_repo", "s3_server"} & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
        if "gpu" in item.keywords and not gpu_present():
            item.add_marker(skip)


_BACKGROUND: dict = {}


@pytest.fixture(scope="session")
def built_repo(tmp_path_factory, request) -> Path:
    """A temp copy of the repo after one full `doit` run of the tiny profile on the CPU. When the session
    will ask for `second_clean_build`, that build starts now, beside this one: a test run is mostly one
    busy core, and the second clean build fills the other."""
    if os.environ.get("SAM3_AOTI_TEST_BUILT_REPO"):  # a quick loop's: a copy you built (`doit device=cpu`) before
        return Path(os.environ["SAM3_AOTI_TEST_BUILT_REPO"])
    if any("second_clean_build" in getattr(item, "fixturenames", ()) for item in request.session.items):
        clean = copy_repo(tmp_path_factory.mktemp("clean"))
        _BACKGROUND["clean"] = (clean, start_doit(clean, "package", "device=cpu"))
    repo = copy_repo(tmp_path_factory.mktemp("repo"))
    run_doit(repo, "device=cpu")
    return repo


@pytest.fixture(scope="session")
def second_clean_build(built_repo) -> Path:
    """Another clean checkout built to `package` (started in the background by `built_repo`)."""
    clean, proc = _BACKGROUND["clean"]
    output, _ = proc.communicate(timeout=3600)
    if proc.returncode != 0:
        raise AssertionError(f"the second clean build failed ({proc.returncode}):\n{output}")
    return clean


@pytest.fixture(scope="session")
def package_path(built_repo) -> Path:
    """The tiny build's package."""
    return built_repo / TINY / "package" / "sam3.pt2"


@pytest.fixture
def own_build(built_repo, tmp_path) -> Path:
    """A copy of the built repo, artifacts and doit state included and up to date (doit's state holds only
    checkout-relative paths), for a test that changes it: the shared build stays as built, and no test
    spends a rebuild putting it back."""
    repo = tmp_path / "repo"
    shutil.copytree(built_repo, repo, symlinks=True, ignore=shutil.ignore_patterns(".lock", "__pycache__"))
    return repo


@pytest.fixture(scope="session")
def tiny_model():
    """The tiny profile's random-init model, as the weights stage builds it from pipeline.toml."""
    from sam3_aoti.pipeline.settings import load_settings
    from sam3_aoti.model.checkpoints import build_model

    return build_model(load_settings(device="cpu"))




@pytest.fixture
def s3_server(tmp_path, monkeypatch):
    """A real S3 server on 127.0.0.1 for one test (helpers.S3Server); this process's clients point at it."""
    from helpers import S3Server

    server = S3Server(tmp_path).start()
    for name, value in server.env.items():
        monkeypatch.setenv(name, value)
    yield server
    server.stop()
