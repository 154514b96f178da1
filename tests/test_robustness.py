"""Nothing lost, nothing silently wrong: checked targets, checked packages, bad input caught before the work."""

import fcntl
import json
import os
import shutil
import subprocess
import sys
import time

import numpy as np
import pytest
import torch
from PIL import Image

from sam3_aoti.runtime import images
from sam3_aoti.errors import InputError, PackageError, Sam3AotiError
from sam3_aoti.runtime.integrity import digest_file
from sam3_aoti.runtime.loader import load_package

from helpers import REPO, TINY, copy_repo, executed, rewrite_package, run_doit, stale


def one_line_error(proc: subprocess.CompletedProcess, words: str) -> None:
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and words in out, out[-3000:]
    assert "Traceback" not in out, out[-3000:]


# --- validate first: at doit load, before any stage ---------------------------------------------------------

@pytest.mark.parametrize("old, new, words", [
    ("shapes = [[1, 1], [2, 3], [3, 4]]", "shapes = [[0, 1]]", "[verify] shapes must be a list of [batch, prompts]"),
    ("shapes = [[1, 1], [2, 3], [3, 4]]", 'shapes = "big"', "got 'big'"),
    ("max_abs = 1e-5", 'max_abs = "abc"', "[verify.tolerances.fp32] max_abs must be a number"),
    ("shapes = [[1, 1], [2, 3], [4, 4], [16, 1], [1, 16]]", "shapes = [[0, 1]]", "[bench] shapes must be"),
    ('masked_attention = "sdpa"', 'masked_attention = "flash"', '[export] masked_attention must be "sdpa" or "eager"'),
    ('sdpa_backends = ["cudnn", "flash", "efficient", "math"]', 'sdpa_backends = ["cudnn", "fast"]',
     "[compile] sdpa_backends must be a list of distinct SDPA kernels"),
    ('columns = ["meta", "transformers", "exported", "aoti", "aoti_graphs"]', 'columns = ["aoti", "triton"]',
     "[bench] columns must be a list of distinct columns"),
    ('inductor = { max_autotune_gemm = true, max_autotune_gemm_backends = "ATEN,TRITON" }', 'inductor = "max"',
     "[tune] inductor must be a table of torch._inductor.config keys"),
    ("top1_same_min = 0.8", "top1_same_min = 2", "[parity.tolerances.bf16] top1_same_min must be a number between 0 and 1"),
    ("[profiles.tiny]", "[old.tiny]", "has no [profiles] table"),
    ("example_batch = 2", "example_batch = 1", "example_batch must be an integer >= 2"),
    ("[verify.tolerances.bf16.per_output.pred_boxes]", "[verify.tolerances.bf16.per_output.boxes]",
     "[verify.tolerances.bf16.per_output.boxes] is not an output: use one of pred_logits"),
    ("max_abs = 1e-3  # boxes", 'max_abs = "1px"  # boxes', "[verify.tolerances.bf16.per_output.pred_boxes] max_abs must be a number"),
])
def test_a_bad_pipeline_toml_is_one_line_at_load(tmp_path, old, new, words):
    repo = copy_repo(tmp_path)
    config = repo / "pipeline.toml"
    assert old in config.read_text()
    config.write_text(config.read_text().replace(old, new, 1).replace("[profiles.sam3]", "[old.sam3]")
                      if old == "[profiles.tiny]" else config.read_text().replace(old, new, 1))
    proc = run_doit(repo, "list", check=False)
    one_line_error(proc, words)
    assert "pipeline.toml" in proc.stderr and proc.stderr.strip().count("\n") == 0


@pytest.mark.parametrize("edit, words", [
    (lambda t: t.replace('prompts = ["a cat"]', 'prompts = "a cat"'), "prompts must be a non-empty list of non-empty strings"),
    (lambda t: t.replace('prompts = ["a cat"]', 'prompts = ["a cat", " "]'), "prompts must be a non-empty list"),
    (lambda t: t + '\n[[case]]\nimage = "missing.png"\nprompts = ["a roof"]\n', "does not exist"),
    (lambda t: t + '\n[[case]]\nimage = "broken.png"\nprompts = ["a roof"]\n', "does not decode"),
    (lambda t: t.replace("skimage:coins", "skimage:no_such_photo"), "skimage has no sample image"),
])
def test_a_bad_cases_toml_is_one_line_at_load(tmp_path, edit, words):
    repo = copy_repo(tmp_path)
    (repo / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"not really")
    cases = repo / "cases.toml"
    cases.write_text(edit(cases.read_text()))
    proc = run_doit(repo, "list", check=False)
    one_line_error(proc, words)
    assert "cases.toml" in proc.stderr


def test_a_misspelt_variable_is_refused(tmp_path):
    proc = run_doit(copy_repo(tmp_path), "list", "profiel=sam3", check=False)
    one_line_error(proc, "unknown variable profiel=sam3: use profile, device, precision, weights, config")


# --- inputs the package, the loader and predict are given -------------------------------------------------

@pytest.fixture(scope="module")
def package_path(built_repo):
    return built_repo / TINY / "package" / "sam3.pt2"


def test_model_and_transforms_refuse_inputs_they_cannot_take(package_path):
    package = load_package(package_path)
    ids = package.encode_prompts(["a cat"])
    good = torch.rand(1, 3, 112, 112)
    for images, token_ids, words in [
        (good.double(), ids, "images must be float32 [batch, 3, 112, 112] on cpu, got float64"),
        (good[0], ids, "got float32 [3, 112, 112]"),
        (torch.rand(1, 3, 100, 112), ids, "got float32 [1, 3, 100, 112]"),
        (torch.rand(0, 3, 112, 112), ids, "batch 0"),
        (good, ids[:, :31], "token_ids must be int64 [num_prompts, 32]"),
        (good, ids.int(), "token_ids must be int64"),
        (good, ids[:0], "num_prompts 0"),
        (good, ids + 60000, "ids outside [0, 49408)"),
    ]:
        with pytest.raises(InputError, match=words.replace("[", r"\[").replace("]", r"\]").replace("(", r"\(")
                           .replace(")", r"\)")):
            package.model(images, token_ids)
    for images in [torch.rand(3, 50, 50), torch.rand(1, 3, 1, 50), torch.rand(1, 1, 50, 50), torch.rand(0, 3, 9, 9)]:
        with pytest.raises(InputError):
            package.transforms(images)


def test_prompts_empty_or_too_long(package_path, caplog):
    package = load_package(package_path)
    for prompts in [[""], ["  "], [], "a cat"]:
        with pytest.raises(InputError):
            package.encode_prompts(prompts)
    with caplog.at_level("WARNING", logger="sam3_aoti"):
        ids = package.encode_prompts([" ".join(["roof"] * 40)])
    assert ids[0, -1].item() == 49407  # end token kept, words cut
    assert "is 40 tokens long; the model reads 30: the last 10 are dropped" in caplog.text


def test_sixteen_bit_and_other_image_modes_become_rgb8(tmp_path):
    ramp = np.linspace(0, 65535, 40 * 50).reshape(40, 50).astype(np.uint16)
    Image.fromarray(ramp).save(tmp_path / "g16.png")
    rgb = images.read_image(tmp_path / "g16.png")
    assert rgb.dtype == np.uint8 and rgb.shape == (40, 50, 3)
    np.testing.assert_allclose(rgb[..., 0], ramp / 257, atol=1)  # scaled, not clipped to white
    Image.fromarray((ramp // 256).astype(np.uint8)).convert("P").save(tmp_path / "palette.png")
    Image.new("RGBA", (7, 5), (10, 20, 30, 40)).save(tmp_path / "rgba.png")
    assert images.read_image(tmp_path / "palette.png").shape == (40, 50, 3)
    assert images.read_image(tmp_path / "rgba.png")[0, 0].tolist() == [10, 20, 30]


def test_an_oversized_image_is_refused_with_the_limit(tmp_path, monkeypatch):
    Image.new("RGB", (400, 300)).save(tmp_path / "big.png")
    monkeypatch.setattr(images, "MAX_PIXELS", 100_000)
    with pytest.raises(PackageError, match=r"400 x 300 .* over the 0 MP limit: tile it"):
        images.read_image(tmp_path / "big.png")


def predict(*args: str, cwd) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    return subprocess.run([sys.executable, "-m", "sam3_aoti", "predict", *args], cwd=cwd, env=env,
                          capture_output=True, text=True)


def test_predict_checks_outputs_before_loading_anything(tmp_path):
    Image.new("RGB", (30, 20)).save(tmp_path / "roof.png")
    (tmp_path / "out.png").mkdir()
    (tmp_path / "file").write_text("a file, not a folder")
    for output, words in [("out", "out.png is a folder"), ("file/x", "cannot create")]:
        proc = predict("missing.pt2", "--image", "roof.png", "--prompt", "a roof", "--output", output, cwd=tmp_path)
        assert proc.returncode != 0 and words in proc.stderr, proc.stderr  # not "no package at": checked first
        assert len(proc.stderr.strip().splitlines()) == 1


def test_predict_on_a_damaged_package_is_one_line(package_path, tmp_path):
    Image.new("RGB", (30, 20)).save(tmp_path / "roof.png")
    (tmp_path / "truncated.pt2").write_bytes(package_path.read_bytes()[:100_000])
    (tmp_path / "text.pt2").write_text("not a package")
    for name in ("truncated.pt2", "text.pt2"):
        proc = predict(name, "--image", "roof.png", "--prompt", "a roof", cwd=tmp_path)
        assert proc.returncode != 0 and "truncated or not a sam3-aoti package" in proc.stderr, proc.stderr
        assert len(proc.stderr.strip().splitlines()) == 1


# --- integrity before native code ----------------------------------------------------------------------------

def copy_package(package_path, folder, edit=lambda name, data: data, digests=True, resign=False):
    """The package and its fallback in `folder`, entries edited by `edit`; with `digests`, the digest files
    the build wrote beside them too (which then no longer match an edit)."""
    target = rewrite_package(package_path, folder / "sam3.pt2", edit, resign)
    if digests:
        shutil.copy(digest_file(package_path), digest_file(target))
    return target


def swap_so(name, data):
    return data[:-64] + bytes(64) if name.endswith(".wrapper.so") and "/transforms/" in name else data


def extraction_folders():
    return {p for p in os.scandir("/tmp") if len(p.name) == 6 and p.is_dir()}


def test_a_tampered_package_is_refused_before_its_code_loads(package_path, tmp_path):
    tampered = copy_package(package_path, tmp_path, swap_so)
    with pytest.raises(PackageError, match="does not match its digest sam3.pt2.sha256"):
        load_package(tampered)
    digest_file(tampered).unlink()  # travelling alone: the metadata's part digests still catch it
    with pytest.raises(PackageError, match="transforms/.*wrapper.so does not match its recorded digest"):
        load_package(tampered, trust=True)  # trust admits a package without digests, never a mismatch
    proc = subprocess.run([sys.executable, "-m", "sam3_aoti", "info", str(tampered)], capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": str(REPO / "src")})
    assert proc.returncode == 2 and "does not match its recorded digest" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_a_package_without_digests_needs_trust(package_path, tmp_path):
    def strip(name, data):
        if name.endswith("extra/metadata.json"):
            metadata = json.loads(data)
            del metadata["parts_sha256"]
            return json.dumps(metadata).encode()
        return data

    bare = copy_package(package_path, tmp_path, strip, digests=False)
    with pytest.raises(PackageError, match="carries no digest .*--trust"):
        load_package(bare)
    assert load_package(bare, trust=True).backends == {"model": "aoti", "transforms": "aoti"}


def test_a_failed_load_leaves_no_extraction_folder(package_path, tmp_path):
    """A package whose code is damaged but whose digests were rewritten to match (its builder's fault, not
    tampering): torch's loader fails, the fallback takes over, and no /tmp/XXXXXX folder is left."""
    def break_so(name, data):
        return b"not an ELF file" if name.endswith(".wrapper.so") else data

    broken = copy_package(package_path, tmp_path, break_so, digests=False, resign=True)
    before = {p.path for p in extraction_folders()}
    package = load_package(broken)
    assert package.backends == {"model": "exported", "transforms": "exported"} and package.fallback_reason
    assert {p.path for p in extraction_folders()} == before


# --- targets are checked, not trusted ------------------------------------------------------------------------

def test_a_truncated_package_or_edited_report_makes_its_stage_stale(own_build):
    art = own_build / TINY
    package = art / "package" / "sam3.pt2"
    data = package.read_bytes()
    package.write_bytes(data[:100_000])
    proc = run_doit(own_build, "check", "device=cpu", check=False)
    one_line_error(proc, "package: package/sam3.pt2 has 100000 bytes")
    rerun = stale(own_build)
    assert {"package", "verify", "render"} <= rerun and not {"weights", "export", "compile"} & rerun
    package.write_bytes(data)  # the same bytes again (a new mtime): nothing to redo
    assert not {"package", "verify", "render"} & stale(own_build)

    report = art / "verify" / "report.md"
    report.write_text(report.read_text().replace("PASSED", "FAILED"))
    assert {"verify"} <= stale(own_build) and not {"package", "render"} & stale(own_build)
    assert "verify: verify/report.md" in run_doit(own_build, "check", "device=cpu", check=False).stdout


def test_a_verify_that_dies_leaves_the_package_unverified_and_stale(own_build, tmp_path):
    art = own_build / TINY
    fallback = art / "package" / "sam3.exported.pt2"
    shutil.move(fallback, tmp_path / fallback.name)  # verify's fallback check cannot load: it dies midway
    env = {**os.environ, "PYTHONPATH": str(own_build / "src")}
    proc = subprocess.run([sys.executable, "-m", "sam3_aoti.stages.verify", "--device", "cpu"], cwd=own_build,
                          env=env, capture_output=True, text=True)
    assert proc.returncode != 0 and "no exported-program fallback" in proc.stderr
    assert json.loads((art / "manifest.json").read_text())["stages"]["verify"]["verified"] is False
    shutil.move(tmp_path / fallback.name, fallback)
    assert "verify" in stale(own_build)  # an unverified package is not up to date


# --- interrupted and concurrent runs -------------------------------------------------------------------------

def test_stale_temporaries_of_dead_runs_are_removed(built_repo):
    stale = built_repo / TINY / "package" / ".sam3.pt2.abcd1234"
    (stale / "half").mkdir(parents=True)
    proc = run_doit(built_repo, "device=cpu")
    assert not stale.exists() and "left by an interrupted run" in proc.stderr
    assert executed(proc) == set()


def test_a_second_run_stops_while_the_first_holds_the_variant(built_repo):
    lock = built_repo / TINY / ".lock"
    with open(lock, "a+") as handle:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        handle.seek(0)
        handle.truncate()
        handle.write("pid 4242")
        handle.flush()
        proc = run_doit(built_repo, "device=cpu", check=False)
        listed = run_doit(built_repo, "list", "device=cpu")  # reading needs no lock
    one_line_error(proc, "doit (pid 4242) is already building")
    assert proc.stderr.strip().count("\n") == 0 and "verify" in listed.stdout


# --- disk space ------------------------------------------------------------------------------------------------

def test_stages_stop_before_the_work_when_the_disk_is_too_full(built_repo, monkeypatch):
    from sam3_aoti.pipeline import artifacts
    from sam3_aoti.stages import compile as compile_stage
    from sam3_aoti.pipeline.settings import load_settings

    monkeypatch.setattr(artifacts.shutil, "disk_usage", lambda path: shutil._ntuple_diskusage(1 << 40, 1 << 40, 1 << 20))
    settings = load_settings(device="cpu", config=built_repo / "pipeline.toml", artifacts=built_repo / "artifacts")
    index = (built_repo / TINY / "compiled" / "index.json").read_bytes()
    t0 = time.monotonic()
    with pytest.raises(Sam3AotiError, match=r"compile needs about .* free on the disk of .*, 1.0 MB is free"):
        compile_stage.run(settings)
    assert time.monotonic() - t0 < 30  # refused before AOTInductor started
    assert (built_repo / TINY / "compiled" / "index.json").read_bytes() == index


def test_a_failed_stage_says_one_line_and_logs_the_cause_whole(tmp_path, capsys):
    """A library failure behind a stage error (e.g. AOTInductor's): one line on the terminal, the library's
    traceback in the stage log, where a bug report needs it."""
    from sam3_aoti.pipeline.settings import load_settings
    from sam3_aoti.errors import CompileError
    from sam3_aoti.pipeline.runner import stage_logging

    settings = load_settings(device="cpu", artifacts=tmp_path)

    def inner():
        raise ValueError("the generated kernel did not build")

    with pytest.raises(CompileError):
        with stage_logging(settings, "compile"):
            try:
                inner()
            except ValueError as e:
                raise CompileError(f"AOTInductor failed on model: {e}") from e
    terminal = capsys.readouterr().err
    assert "failed: AOTInductor failed on model" in terminal and "Traceback" not in terminal
    log = (tmp_path / "tiny-fp32-cpu" / "logs" / "compile.log").read_text()
    assert "Traceback" in log and "in inner" in log and "ValueError: the generated kernel did not build" in log
