"""The binary cache in the doit flow, on the tiny build: one builder pushes, a clean clone substitutes the
verified package without building anything, a new seed substitutes the compiled code, refusals build here,
and a node with no checkout pulls by ref. Against a real S3 server (rclone serve s3) and a file:// folder."""

import json
import os
import re
import subprocess
import sys

import pytest

from helpers import TINY, copy_build, copy_repo, executed, run_doit, stale


@pytest.fixture(params=["s3", "file"])
def fleet(request, tmp_path):
    """(url, environment of every machine of the fleet, public key trusted, environment of the builder)."""
    env = {}
    if request.param == "s3":
        server = request.getfixturevalue("s3_server")
        url, env = server.url("fleet-cache"), dict(server.env)
    else:
        url = f"file://{tmp_path / 'fleet-cache'}"
    made = subprocess.run([sys.executable, "-m", "sam3_aoti", "cache", "keygen", "builder-a", "--out",
                           str(tmp_path / "builder-a.key")], capture_output=True, text=True, check=True)
    public = made.stdout.strip()
    return url, {**env, "SAM3_AOTI_TRUSTED_KEYS": public}, public, {**env, "SAM3_AOTI_SIGNING_KEY": str(tmp_path / "builder-a.key")}


def clean(folder):
    folder.mkdir()
    return folder


def substituted(repo) -> dict:
    manifest = json.loads((repo / TINY / "manifest.json").read_text())
    return {stage: entry["origin"].get("signed_by") for stage, entry in manifest["stages"].items()
            if "substituted" in entry.get("origin", {})}


def test_a_clean_clone_substitutes_the_verified_package_and_builds_nothing(own_build, built_repo, fleet, tmp_path):
    url, node_env, public, builder_env = fleet
    pushed = run_doit(own_build, "push", f"cache={url}", env=builder_env)
    assert "ref tiny-fp32-cpu@cpu-" in pushed.stderr, pushed.stderr
    info = subprocess.run([sys.executable, "-m", "sam3_aoti", "info", str(own_build / TINY / "package/sam3.pt2")],
                          capture_output=True, text=True, check=True).stdout
    assert "origin: built here" in info
    node = copy_repo(clean(tmp_path / "node"))
    proc = run_doit(node, f"cache={url}", env=node_env)
    assert executed(proc) == {"toolchain"}, proc.stdout  # no weights, export, compile, package, verify, render
    assert substituted(node) == {"package": "builder-a", "verify": "builder-a", "render": "builder-a"}
    assert "package: substituted from" in proc.stderr and "signed by builder-a" in proc.stderr
    for name in ("package/sam3.pt2", "package/sam3.exported.pt2", "verify/report.json", "render/index.md"):
        assert (node / TINY / name).read_bytes() == (built_repo / TINY / name).read_bytes(), name
    assert not (node / TINY / "weights").exists() and not (node / TINY / "compiled").exists()
    again = run_doit(node)  # no cache now: the substituted stages are today's, nothing runs
    assert executed(again) == set(), again.stdout
    assert {"package", "verify", "render"}.isdisjoint(stale(node))
    info = subprocess.run([sys.executable, "-m", "sam3_aoti", "info", str(node / TINY / "package/sam3.pt2")],
                          capture_output=True, text=True, check=True).stdout
    assert f"origin: substituted from {url}, signed by builder-a" in info
    # a service node with no checkout: the package by its ref, checked against the trusted key
    ref = re.search(r"cache: ref (\S+) ->", pushed.stderr).group(1)
    dest = tmp_path / "service"
    pulled = subprocess.run([sys.executable, "-m", "sam3_aoti", "pull", url, ref, str(dest), "--trusted-key", public],
                            capture_output=True, text=True, env={**os.environ, **node_env})
    assert pulled.returncode == 0, pulled.stderr
    assert (dest / "sam3.pt2").read_bytes() == (built_repo / TINY / "package/sam3.pt2").read_bytes()
    info = subprocess.run([sys.executable, "-m", "sam3_aoti", "info", str(dest / "sam3.pt2")], capture_output=True,
                          text=True, check=True).stdout
    assert "integrity: matches sam3.pt2.sha256" in info and f"origin: pulled ref {ref} from {url}" in info


@pytest.mark.parametrize("refusal, why", [
    ("untrusted", "signed by builder-a, which is not a trusted key: refused; builds here instead"),
    ("altered", "does not match its sha256 (altered or damaged): refused; builds here instead"),
])
def test_a_refused_substitution_is_one_line_and_the_stage_builds_here(own_build, fleet, tmp_path, refusal, why):
    url, node_env, _, builder_env = fleet
    run_doit(own_build, "push", f"cache={url}", env=builder_env)
    if refusal == "untrusted":
        node_env = {**node_env, "SAM3_AOTI_TRUSTED_KEYS": subprocess.run(
            [sys.executable, "-m", "sam3_aoti", "cache", "keygen", "other", "--out", str(tmp_path / "other.key")],
            capture_output=True, text=True, check=True).stdout.strip()}
    else:  # someone with write access to the store replaces the package's blob (s3_server set this process up)
        from sam3_aoti.cache.binary_cache import blob_path
        from sam3_aoti.runtime.files import sha256
        from sam3_aoti.cache.store import Store

        package = bytearray((own_build / TINY / "package/sam3.pt2").read_bytes())
        blob = blob_path(sha256(own_build / TINY / "package/sam3.pt2"))
        package[len(package) // 2] ^= 1  # one bit, the size kept
        Store(url).write(blob, bytes(package))
    node = copy_repo(clean(tmp_path / "node"))
    proc = run_doit(node, "weights", f"cache={url}", env=node_env)  # the plan runs at load, whatever the target
    lines = [line for line in proc.stderr.splitlines() if line.startswith("sam3-aoti cache: package")]
    assert len(lines) == 1 and why in lines[0], proc.stderr
    assert substituted(node) == {} and not (node / TINY / "package").exists()
    assert executed(proc) == {"weights"}


def test_a_new_seed_substitutes_the_compiled_code_and_pushes_its_package(own_build, built_repo, new_seed_build, fleet,
                                                                       tmp_path):
    url, node_env, _, builder_env = fleet
    run_doit(own_build, "push", f"cache={url}", env=builder_env)
    node = copy_build(new_seed_build, tmp_path / "node")
    assert "seed = 1" in (node / "pipeline.toml").read_text()
    proc = run_doit(node, "package", f"cache={url}", env={**node_env, **builder_env})
    assert executed(proc) == {"toolchain", "compile", "compile_parts", "package"}, proc.stdout  # the rest: built
    assert "compile: substituted from" in proc.stderr and "compile_parts: substituted from" in proc.stderr, proc.stderr
    assert not [w for w in ("[compile ", "[compile_parts ", "[probe ") if w in proc.stderr]  # no AOTInductor, no probe
    assert "package: pushed to" in proc.stderr
    assert substituted(node) == {"compile": "builder-a", "compile_parts": "builder-a"}
    new, old = (r / TINY / "package/sam3.pt2" for r in (node, built_repo))
    assert new.read_bytes() != old.read_bytes()  # other weights, the same compiled code
    for index in ("compiled/index.json", "compiled_parts/index.json"):
        assert (node / TINY / index).read_bytes() == (built_repo / TINY / index).read_bytes()


@pytest.mark.parametrize("fault, words", [
    ("missing bucket", "the bucket no-such-bucket does not exist: make it"),
    ("closed port", "Could not connect to the endpoint URL"),
    ("blocked folder", "(NotADirectoryError"),
])
def test_doit_push_faults_are_one_line_and_leave_the_build_standing(own_build, s3_server, tmp_path, fault, words):
    """`doit push` itself against a store that cannot take it: the task fails with one line naming the fault
    (doit's exit code for a failed task, 1), no traceback, and the build is still up to date."""
    subprocess.run([sys.executable, "-m", "sam3_aoti", "cache", "keygen", "builder-a", "--out",
                    str(tmp_path / "builder-a.key")], capture_output=True, text=True, check=True)
    env = {**s3_server.env, "SAM3_AOTI_SIGNING_KEY": str(tmp_path / "builder-a.key")}
    url = "s3://no-such-bucket/cache"
    if fault == "closed port":
        url, env["AWS_ENDPOINT_URL"] = s3_server.url("fleet-cache"), "http://127.0.0.1:9"
    elif fault == "blocked folder":
        (tmp_path / "store").mkdir()
        (tmp_path / "store" / "blobs").write_text("a file where the store's folder goes")
        url = f"file://{tmp_path / 'store'}"
    proc = run_doit(own_build, "push", f"cache={url}", env=env, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 1 and "Traceback" not in out, out[-3000:]
    failed = [line for line in out.splitlines() if "push failed after nothing" in line]
    assert len(failed) == 1 and words in failed[0], out[-3000:]
    assert stale(own_build) & {"export", "compile", "package", "verify"} == set()
