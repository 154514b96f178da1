"""Nothing lost, nothing silently wrong: checked targets, checked packages, bad input caught before the work."""

import fcntl
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image

from sam3_aoti.runtime import images as image_reader
from sam3_aoti.errors import InputError, PackageError, Sam3AotiError
from sam3_aoti.runtime.integrity import digest_file
from sam3_aoti.runtime.loader import load_package

from helpers import REPO, TINY, TINY_MODELS, copy_repo, executed, rewrite_package, run_doit, stale, start_doit


def one_line_error(proc: subprocess.CompletedProcess, words: str) -> None:
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and words in out, out[-3000:]
    assert "Traceback" not in out, out[-3000:]


# --- validate first: at doit load, before any stage ---------------------------------------------------------

@pytest.mark.parametrize("old, new, words", [
    ("shapes = [[1, 1], [2, 3], [3, 4]]", "shapes = [[0, 1]]", "[verify] shapes must be a list of [batch, prompts]"),
    ("shapes = [[1, 1], [2, 3], [3, 4]]", 'shapes = "big"', "got 'big'"),
    ("max_abs = 1e-5", 'max_abs = "abc"', "[verify.tolerances.fp32] max_abs must be a finite number >= 0"),
    ("max_abs = 1e-5", "max_abs = nan", "max_abs must be a finite number >= 0, got nan"),
    ("max_abs = 1e-5", "max_abs = inf", "max_abs must be a finite number >= 0, got inf"),
    ("max_abs = 1e-5", "max_abs = -1.0", "max_abs must be a finite number >= 0, got -1.0"),
    ("seed = 0", "seeed = 0", "[weights]: unknown key `seeed`: did you mean `seed`?"),
    ("bias_noise = 0.1", "bias_noise = 0.1\nmatrx_gain = 2.0", "unknown key `matrx_gain`: did you mean `matrix_gain`?"),
    ("[render]", "[rendr]", "at the top level: unknown key `rendr`: did you mean `render`?"),
    ("iters = 20", "iters = 100000000", "[bench] iters must be an integer from 1 to 100000"),
    ("max_instances = 5", "max_instances = 5\nthreshold = 0.5", "[render]: unknown key `threshold`"),
    ("shapes = [[1, 1], [2, 3], [4, 4], [16, 1], [1, 16]]", "shapes = [[0, 1]]", "[bench] shapes must be"),
    ('masked_attention = "sdpa"', 'masked_attention = "flash"', '[export] masked_attention must be "sdpa" or "eager"'),
    ('optimizations = ["box_bias_kernel"', 'optimizations = ["fast", "box_bias_kernel"',
     "[export] optimizations must be a list of distinct optimizations from 'box_bias_kernel', 'relu_epilogue'"),
    ('sdpa_backends = ["cudnn", "flash", "efficient", "math"]', 'sdpa_backends = ["cudnn", "fast"]',
     "[compile] sdpa_backends must be a list of distinct SDPA kernels"),
    ('columns = ["meta", "transformers", "exported", "aoti", "aoti_graphs"]', 'columns = ["aoti", "triton"]',
     "[bench] columns must be a list of distinct columns"),
    ('inductor = { max_autotune_gemm = true, max_autotune_gemm_backends = "ATEN,TRITON" }', 'inductor = "max"',
     "[tune] inductor must be a table of torch._inductor.config keys"),
    ("top1_same_min = 0.8", "top1_same_min = 2", "[parity.tolerances.bf16] top1_same_min must be a finite number >= 0 and <= 1"),
    ("[profiles.tiny]", "[old.tiny]", "has no [profiles] table"),
    ("example_batch = 2", "example_batch = 1", "example_batch must be an integer from 2 to 64"),
    ("[verify.tolerances.bf16.per_output.pred_boxes]", "[verify.tolerances.bf16.per_output.boxes]",
     "[verify.tolerances.bf16.per_output]: unknown key `boxes`: did you mean `pred_boxes`?"),
    ("max_abs = 1e-3  # boxes", 'max_abs = "1px"  # boxes', "[verify.tolerances.bf16.per_output.pred_boxes] max_abs must be a finite number"),
])
def test_a_bad_pipeline_toml_is_one_line_at_load(tmp_path, old, new, words):
    repo = copy_repo(tmp_path)
    config = repo / "pipeline.toml"
    assert old in config.read_text()
    text = config.read_text().replace(old, new, 1)
    if old == "[profiles.tiny]":  # no profiles at all: both tables out (commented)
        text = text.replace("[old.tiny]", "# [old.tiny]").replace("[profiles.sam3]", "# [old.sam3]")
        text = "\n".join(f"# {line}" if line.startswith(("architecture", "precision")) else line for line in text.split("\n"))
    config.write_text(text)
    proc = run_doit(repo, "list", check=False)
    one_line_error(proc, words)
    assert "pipeline.toml" in proc.stderr and proc.stderr.strip().count("\n") == 0


@pytest.mark.parametrize("edit, words", [
    (lambda t: t.replace('prompts = ["a cat"]', 'prompts = "a cat"'), "prompts must be a non-empty list of non-empty strings"),
    (lambda t: t.replace('prompts = ["a cat"]', 'prompts = ["a cat", " "]'), "prompts must be a non-empty list"),
    (lambda t: t + '\n[[case]]\nimage = "missing.png"\nprompts = ["a roof"]\n', "does not exist"),
    (lambda t: t + '\n[[case]]\nimage = "broken.png"\nprompts = ["a roof"]\n', "does not decode"),
    (lambda t: t.replace("skimage:coins", "skimage:no_such_photo"), "skimage has no sample image"),
    (lambda t: 'case = "oops"\n', "`case` must be [[case]] tables"),
    (lambda t: t + '\n[[folder]]\npath = 5\nprompts = ["a roof"]\n', "path must be a folder's path (a string), got 5"),
    (lambda t: t.replace('prompts = ["a cat"]', 'prompts = ["a cat"]\nprompt = "a dog"', 1), "unknown key `prompt`: did you mean `prompts`?"),
    (lambda t: t + '\n[[case]]\nimage = "tiny.png"\nprompts = ["a dot"]\n', "is 1 x 1 pixels: the package takes images of at least 2 x 2"),
])
def test_a_bad_cases_toml_is_one_line_at_load(tmp_path, edit, words):
    repo = copy_repo(tmp_path)
    (repo / "broken.png").write_bytes(b"\x89PNG\r\n\x1a\n" + b"not really")
    Image.new("RGB", (1, 1)).save(repo / "tiny.png")
    cases = repo / "cases.toml"
    cases.write_text(edit(cases.read_text()))
    proc = run_doit(repo, "list", check=False)
    one_line_error(proc, words)
    assert "cases.toml" in proc.stderr


@pytest.mark.parametrize("target, make, words", [
    ("cases.toml", lambda p: p.write_bytes(b"[[case]]\nimage = \"\xff\xfe\"\n"), "is not UTF-8 text"),
    ("cases.toml", lambda p: (p.unlink(), p.mkdir()), "is a folder, not a file"),
    ("pipeline.toml", lambda p: p.write_bytes(b"\xff\xfe[weights]\n"), "is not UTF-8 text"),
])
def test_config_files_that_are_folders_or_not_text_are_one_line(tmp_path, target, make, words):
    repo = copy_repo(tmp_path)
    make(repo / target)
    one_line_error(run_doit(repo, "list", check=False), words)


def test_config_a_folder_is_one_line(tmp_path):
    one_line_error(run_doit(copy_repo(tmp_path), "list", f"config={tmp_path}", check=False), "is a folder, not a file")


def test_a_misspelt_variable_is_refused(tmp_path):
    proc = run_doit(copy_repo(tmp_path), "list", "profiel=sam3", check=False)
    one_line_error(proc, "unknown variable profiel=sam3 (did you mean profile?): use profile, device, precision")
    assert proc.returncode == 2  # bad input, as everywhere (errors.py)


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
    rgb = image_reader.read_image(tmp_path / "g16.png")
    assert rgb.dtype == np.uint8 and rgb.shape == (40, 50, 3)
    np.testing.assert_allclose(rgb[..., 0], ramp / 257, atol=1)  # scaled, not clipped to white
    Image.fromarray((ramp // 256).astype(np.uint8)).convert("P").save(tmp_path / "palette.png")
    Image.new("RGBA", (7, 5), (10, 20, 30, 40)).save(tmp_path / "rgba.png")
    assert image_reader.read_image(tmp_path / "palette.png").shape == (40, 50, 3)
    alpha = 40 / 255  # over white, as a viewer on a white page shows it
    assert image_reader.read_image(tmp_path / "rgba.png")[0, 0].tolist() == [round(c * alpha + 255 * (1 - alpha))
                                                                              for c in (10, 20, 30)]


def test_an_oversized_image_is_refused_with_the_limit(tmp_path, monkeypatch):
    Image.new("RGB", (400, 300)).save(tmp_path / "big.png")
    monkeypatch.setattr(image_reader, "MAX_PIXELS", 100_000)
    with pytest.raises(PackageError, match=r"400 x 300 .* over the 0 MP limit: tile it"):
        image_reader.read_image(tmp_path / "big.png")


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
    digest_file(tampered).unlink()  # travelling alone: refused, unless trusted
    with pytest.raises(PackageError, match="has no digest beside it .* a digest inside it proves nothing"):
        load_package(tampered)
    with pytest.raises(PackageError, match="transforms/.*wrapper.so does not match its recorded digest"):
        load_package(tampered, trust=True)  # trust admits a package without a digest, never a damaged one
    proc = subprocess.run([sys.executable, "-m", "sam3_aoti", "info", str(tampered)], capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": str(REPO / "src")})
    assert proc.returncode == 2 and "has no digest beside it" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_a_package_that_vouches_for_itself_is_not_trusted(package_path, tmp_path):
    """A swapped .so with the metadata's part digests recomputed (what a crafted package does): only a digest
    from outside the archive, or --trust, lets it load."""
    crafted = copy_package(package_path, tmp_path, swap_so, digests=False, resign=True)
    with pytest.raises(PackageError, match="has no digest beside it"):
        load_package(crafted)
    Image.new("RGB", (30, 20)).save(tmp_path / "x.png")
    proc = predict(str(crafted), "--image", "x.png", "--prompt", "a roof", cwd=tmp_path)
    assert proc.returncode == 2 and "has no digest beside it" in proc.stderr
    with pytest.raises(PackageError, match="does not match the digest passed in"):
        load_package(crafted, sha256=hashlib.sha256(package_path.read_bytes()).hexdigest())
    (tmp_path / "good").mkdir()
    good = copy_package(package_path, tmp_path / "good", digests=False)
    assert load_package(good, sha256=hashlib.sha256(good.read_bytes()).hexdigest()).backends["model"] == "aoti"
    with pytest.raises(PackageError, match="is not a sha256"):
        load_package(good, sha256="abc")


@pytest.mark.parametrize("entry", ["sam3/data/aotinductor/model/../../../../{tmp}/x", "/{tmp}/x",
                                   "sam3/data/aotinductor/model/evil/../../x.so", "other/extra/metadata.json",
                                   "sam3/extra/notes.txt", "link"])
def test_an_entry_no_package_has_is_refused_before_torch_opens_it(package_path, tmp_path, entry):
    """Names are checked before torch's loader unpacks anything, trusted or not, digest or not: nothing is
    written outside the extraction folder."""
    import zipfile

    marker = tmp_path / "outside"
    marker.mkdir()
    name = entry.format(tmp=str(marker).strip("/"))
    crafted = copy_package(package_path, tmp_path, digests=False)
    with zipfile.ZipFile(crafted, "a") as archive:
        info = zipfile.ZipInfo("sam3/data/aotinductor/model/libevil.so" if name == "link" else name)
        if name == "link":
            info.create_system, info.external_attr = 3, (0o120777 << 16)  # a symbolic link
        archive.writestr(info, b"x")
    from sam3_aoti.runtime.integrity import write_digest

    write_digest(crafted)  # the user even has its digest: names are refused all the same
    for load in (lambda: load_package(crafted), lambda: load_package(crafted, trust=True)):
        with pytest.raises(PackageError, match="holds the entry .* which no sam3-aoti package has|root folders"):
            load()
    assert list(marker.iterdir()) == []


def test_a_failed_load_leaves_no_extraction_folder(package_path, tmp_path):
    """A package whose code is damaged but whose digests were rewritten to match (its builder's fault, not
    tampering): torch's loader fails, the fallback takes over, and no /tmp/XXXXXX folder is left."""
    def break_so(name, data):
        return b"not an ELF file" if name.endswith(".wrapper.so") else data

    broken = copy_package(package_path, tmp_path, break_so, digests=False, resign=True)
    before = {p.path for p in extraction_folders()}
    package = load_package(broken, trust=True)
    assert package.backends == dict.fromkeys(TINY_MODELS, "exported") and package.fallback_reason
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
    package.write_bytes(data)  # the same bytes again (a new mtime): nothing to rebuild, the package re-verified
    assert not {"package", "render"} & stale(own_build) and "verify" in stale(own_build)

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


# --- repairs that repair ---------------------------------------------------------------------------------------

def flip_a_byte_in_place(path: Path) -> None:
    """One byte changed, the size and the mtime kept (what a damaged disk or a careless tool leaves)."""
    st = path.stat()
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


def test_a_byte_changed_in_place_is_found_and_rebuilt_by_the_next_run(own_build):
    package = own_build / TINY / "package" / "sam3.pt2"
    before = package.read_bytes()
    flip_a_byte_in_place(package)
    assert {"package", "verify", "render"} <= stale(own_build)  # the ctime moved: hashed, and found
    one_line_error(run_doit(own_build, "check", "device=cpu", check=False), "package: package/sam3.pt2 was modified")
    manifest = json.loads((own_build / TINY / "manifest.json").read_text())
    assert manifest["stages"]["verify"]["verified"] is False  # a package that fails its digest is never verified
    proc = run_doit(own_build, "verify", "device=cpu")  # even verify alone repairs: doit rebuilds its input first
    assert {"package", "verify"} <= executed(proc) and not {"weights", "export", "compile"} & executed(proc)
    assert package.read_bytes() == before
    manifest = json.loads((own_build / TINY / "manifest.json").read_text())
    assert manifest["stages"]["verify"]["verified"] is True
    assert executed(run_doit(own_build, "device=cpu")) == set()


def test_a_copied_checkout_hashes_once_then_trusts_its_stamps(own_build, monkeypatch):
    """The copy's files have new ctimes: the first run hashes them and records the new times, the next
    only stats them."""
    assert stale(own_build) & {"weights", "export", "package"} == set()
    run_doit(own_build, "device=cpu")  # a run that may write refreshes the recorded times
    manifest = json.loads((own_build / TINY / "manifest.json").read_text())
    recorded = manifest["stages"]["package"]["outputs"]["package/sam3.pt2"]
    assert recorded["ctime_ns"] == (own_build / TINY / "package" / "sam3.pt2").stat().st_ctime_ns


def test_damaged_manifests_and_doit_state_are_one_line(own_build):
    state = own_build / TINY / ".doit.json"
    state.write_text("{not json")
    one_line_error(run_doit(own_build, "list", "--status", "device=cpu", check=False), ".doit.json (doit's state) is damaged")
    proc = run_doit(own_build, "check", "device=cpu")  # a command that may write sets it aside and goes on
    assert "set aside as .doit.json.damaged-" in proc.stderr and "Traceback" not in proc.stdout + proc.stderr
    assert json.loads(state.read_text())
    manifest = own_build / TINY / "manifest.json"
    manifest.write_text("[]")
    proc = run_doit(own_build, "list", "--status", "device=cpu")
    assert "manifest.json is damaged (not a manifest)" in proc.stderr and "Traceback" not in proc.stderr
    assert {"weights", "export", "compile", "package", "verify", "render"} <= stale(own_build)


# --- no traceback reaches a terminal ----------------------------------------------------------------------------

def test_ctrl_c_during_a_stage_is_one_line_and_130(own_build):
    source = own_build / "src" / "sam3_aoti" / "stages" / "export.py"
    source.write_text(source.read_text() + "\n# an edit: export runs\n")
    proc = start_doit(own_build, "device=cpu")
    deadline = time.monotonic() + 300
    lines = []
    for line in proc.stdout:
        lines.append(line)
        if "[export" in line and "exporting model" in line or time.monotonic() > deadline:
            break
    os.killpg(proc.pid, signal.SIGINT)
    rest, _ = proc.communicate(timeout=180)
    out = "".join(lines) + rest
    assert proc.returncode == 130, out[-3000:]
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out[-3000:]
    assert [line for line in out.splitlines() if "interrupted" in line] == [
        "sam3-aoti: interrupted during export; finished stages are kept: `uv run doit` goes on from there"]
    assert {"export"} <= stale(own_build) and not {"weights"} & stale(own_build)


def test_output_into_a_closed_pipe_is_quiet(package_path):
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    for command in (f"{sys.executable} -m sam3_aoti info {package_path} | head -c 10",
                    f"{sys.executable} -m doit list | head -c 10"):
        proc = subprocess.run(command, shell=True, cwd=package_path.parents[3], env=env, capture_output=True, text=True)
        assert proc.stderr == "", (command, proc.stderr)


def test_an_unwritable_variant_folder_is_one_line(tmp_path):
    repo = copy_repo(tmp_path)
    (repo / TINY).mkdir(parents=True)
    (repo / TINY / ".lock").mkdir()  # what a read-only folder does to the lock, even for root
    one_line_error(run_doit(repo, "device=cpu", check=False), "cannot write")


def test_the_disk_filling_up_is_named(tmp_path, capsys):
    import errno

    from sam3_aoti.pipeline.runner import stage_logging
    from sam3_aoti.pipeline.settings import load_settings

    settings = load_settings(device="cpu", artifacts=tmp_path)
    with pytest.raises(Sam3AotiError, match=r"the disk is full writing .*programs.pt2 \(\d+ MB free on it\): free some"):
        with stage_logging(settings, "export"):
            raise OSError(errno.ENOSPC, "No space left on device", str(tmp_path / "programs.pt2"))
    assert "Traceback" not in capsys.readouterr().err


# --- temporaries and paths -------------------------------------------------------------------------------------

def test_a_killed_loader_leaves_its_folder_to_the_next_one_and_nothing_in_tmp(package_path, tmp_path):
    cache = tmp_path / "cache"
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "SAM3_AOTI_CACHE": str(cache)}
    before = {p.name for p in Path("/tmp").iterdir()}
    holder = subprocess.Popen([sys.executable, "-c", f"from sam3_aoti import load_package; "
                               f"package = load_package({str(package_path)!r}); print('loaded', flush=True); "
                               "import time; time.sleep(600)"], env=env, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "loaded"
    folders = list((cache / "tmp").iterdir())
    assert len(folders) == 1 and folders[0].name.startswith(f"{holder.pid}-")
    assert sorted(p.name.split("-")[0] for p in folders[0].iterdir()) == sorted(TINY_MODELS)
    holder.kill()
    holder.wait()
    proc = subprocess.run([sys.executable, "-c", f"from sam3_aoti import load_package; load_package({str(package_path)!r})"],
                          env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert list((cache / "tmp").iterdir()) == []  # swept (the owner is dead), and the new one removed at exit
    assert {p.name for p in Path("/tmp").iterdir()} - before == set()


def test_a_failed_predict_removes_the_folder_it_made(package_path, tmp_path):
    Image.new("RGB", (30, 20)).save(tmp_path / "roof.png")
    proc = predict(str(tmp_path / "none.pt2"), "--image", "roof.png", "--prompt", "a roof", "--output", "new/deep/x",
                   cwd=tmp_path)
    assert proc.returncode == 2 and "no package at" in proc.stderr
    assert not (tmp_path / "new").exists()


def test_a_checkout_with_a_space_in_its_path_compiles(own_build, tmp_path):
    spaced = tmp_path / "a folder" / "sam3 aoti"
    spaced.parent.mkdir()
    shutil.move(own_build, spaced)
    source = spaced / "src" / "sam3_aoti" / "aoti" / "compile.py"
    source.write_text(source.read_text() + "\n# an edit: compile runs\n")
    proc = run_doit(spaced, "package", "device=cpu")
    assert {"compile", "package"} <= executed(proc)


def test_no_file_under_artifacts_names_the_checkout(built_repo):
    """A copied or moved checkout keeps working: cuda.env, doctor.json, settings and indices name paths inside
    the checkout relative to it ($SAM3_AOTI_ROOT)."""
    named = [str(p.relative_to(built_repo)) for p in (built_repo / "artifacts").rglob("*")
             if p.is_file() and p.suffix in (".env", ".json") and "inductor-cache" not in p.parts
             and str(built_repo) in p.read_text(errors="replace")]
    assert named == []


def test_a_misspelt_inductor_option_is_refused_before_the_compile(tmp_path):
    from sam3_aoti.aoti.compile import check_inductor_options
    from sam3_aoti.errors import ConfigError

    check_inductor_options({"max_autotune_gemm": True, "aot_inductor.package": True}, "[compile] inductor")
    with pytest.raises(ConfigError, match="`max_autotune_gem` is no torch._inductor.config option .* did you mean "
                                          "`max_autotune_gemm`"):
        check_inductor_options({"max_autotune_gem": True}, "[compile] inductor")


def test_a_compile_worker_refuses_a_misspelt_option_before_it_reads_its_program(tmp_path):
    """The compile stage starts its workers before it imports torch: each checks the options first, and the
    refusal crosses back to the stage whole (one line, exit 2)."""
    import pickle
    from concurrent.futures import ProcessPoolExecutor
    from multiprocessing import get_context

    from sam3_aoti.aoti.compile import compile_program
    from sam3_aoti.errors import ConfigError

    missing = tmp_path / "no-such-archive.pt2"  # read after the check: reading it would fail otherwise
    with ProcessPoolExecutor(1, get_context("spawn")) as pool:
        job = pool.submit(compile_program, str(missing), "model", {"max_autotune_gem": True}, None,
                          str(tmp_path / "out"))
        with pytest.raises(ConfigError, match="did you mean `max_autotune_gemm`") as refused:
            job.result()
    assert refused.value.exit_code == 2 and not (tmp_path / "out").exists()
    assert str(pickle.loads(pickle.dumps(refused.value))) == str(refused.value)


def test_images_are_read_as_a_viewer_shows_them(tmp_path):
    """EXIF orientation applied, CMYK and float greys converted, the same reader for predict and the cases."""
    from sam3_aoti.pipeline.cases import Case

    portrait = Image.new("RGB", (40, 20), (200, 10, 10))
    exif = portrait.getexif()
    exif[0x0112] = 6  # "rotate 90 CW to view": a phone held upright
    portrait.save(tmp_path / "phone.jpg", exif=exif)
    assert image_reader.read_image(tmp_path / "phone.jpg").shape == (40, 20, 3)
    assert Case("phone", str(tmp_path / "phone.jpg"), ("a wall",)).load_image().shape == (40, 20, 3)
    Image.new("CMYK", (8, 6), (0, 255, 255, 0)).save(tmp_path / "cmyk.jpg")
    assert image_reader.read_image(tmp_path / "cmyk.jpg")[0, 0].tolist()[0] > 200  # red, not black
    Image.fromarray(np.full((5, 7), 0.5, np.float32), mode="F").save(tmp_path / "float.tif")
    assert image_reader.read_image(tmp_path / "float.tif")[0, 0].tolist() == [128, 128, 128]
    assert image_reader.array_to_rgb8(np.full((3, 4), 65535, np.uint16))[0, 0].tolist() == [255, 255, 255]
