"""`doit` end to end on the tiny profile in a temp copy: artifacts, caching, gates, one-line errors."""

import json
import os
import re
import signal
import subprocess
import sys
import time

import pytest


from helpers import TINY, copy_repo, executed, run_doit, stale, start_doit

STAGES = {"toolchain", "weights", "export", "export_parts", "reference", "fallback", "fallback_drift", "compile",
          "compile_parts", "package", "verify", "render"}


def test_first_run_builds_every_stage(built_repo):
    art = built_repo / TINY
    for rel in ["weights/checkpoint/model.safetensors", "export/programs.pt2", "export/program.json",
                "export/parts.pt2", "export/parts.json", "export/programs.portable.pt2", "reference/index.json",
                "export/fallback_drift.json", "compiled/index.json", "compiled_parts/index.json", "package/sam3.pt2", "package/sam3.exported.pt2", "verify/report.json", "verify/report.md", "verify/report.html",
                "render/index.md", "render/astronaut.png", "render/astronaut_mask_diff.png", "render/scores.png",
                *(f"logs/{s}.log" for s in STAGES)]:
        assert (art / rel).exists(), rel
    report = json.loads((art / "verify" / "report.json").read_text())
    assert report["passed"] and report["failed"] == 0 and report["checks"] > 50
    manifest = json.loads((art / "manifest.json").read_text())
    assert set(manifest["stages"]) == STAGES - {"toolchain"}  # the toolchain is per machine: doctor.json
    assert manifest["stages"]["verify"]["verified"] is True
    package = manifest["stages"]["package"]["outputs"]["package/sam3.pt2"]
    assert package["bytes"] == (art / "package" / "sam3.pt2").stat().st_size
    assert manifest["stages"]["export"]["torch"] != "absent"
    cases = len(re.findall(r"^## ", (art / "render" / "index.md").read_text(), re.M))
    render_log = (art / "logs" / "render.log").read_text()
    assert f"eager outputs: {cases} of {cases} from the reference cache" in render_log  # eager ran once, in reference
    verify_log = (art / "logs" / "verify.log").read_text()
    assert re.search(r"eager reference: (\d+) of \1 from the reference cache", verify_log), verify_log
    assert "loaded the eager model" not in verify_log  # beside the compile, not on the way to the pictures
    assert "the fallback as its stage measured it" in verify_log and "loaded the exported fallback" not in verify_log


def test_second_run_executes_nothing(built_repo):
    proc = run_doit(built_repo, "device=cpu")
    assert executed(proc) == set()
    assert {line[3:].strip() for line in proc.stdout.splitlines() if line.startswith("-- ")} == STAGES
    assert f"{TINY}/package/sam3.pt2" in proc.stdout  # where the results are


def test_a_copied_build_is_up_to_date(own_build):
    """doit's state names files relative to the checkout: a copy (or a moved checkout) rebuilds nothing."""
    assert stale(own_build) & STAGES == set()


def test_a_verify_tolerance_makes_verify_alone_stale(own_build):
    config = own_build / "pipeline.toml"
    config.write_text(config.read_text().replace("top5_overlap_min = 0.8", "top5_overlap_min = 0.75", 1))
    assert stale(own_build) & STAGES == {"verify"}


def test_a_failing_gate_fails_the_task_and_unmarks_the_package(own_build):
    config = own_build / "pipeline.toml"
    config.write_text(config.read_text().replace("max_abs = 1e-5\nmax_rel = 1e-4", "max_abs = 0\nmax_rel = 0", 1))
    proc = run_doit(own_build, "device=cpu", check=False)
    assert proc.returncode != 0
    assert executed(proc) == {"verify"}  # a tolerance reruns verify alone, and a failed one stops render
    assert "failed: " in proc.stderr and "checks failed, worst: " in proc.stderr
    assert "Traceback" not in proc.stdout + proc.stderr
    manifest = json.loads((own_build / TINY / "manifest.json").read_text())
    assert manifest["stages"]["verify"]["verified"] is False
    log = (own_build / TINY / "logs" / "verify.log").read_text()
    assert "✗ aoti " in log  # the AOTI rows failed (the worst may be the fallback's)
    hits, total = map(int, re.search(r"eager reference: (\d+) of (\d+) from the reference cache", log).groups())
    assert hits == total > 0  # the rerun did not run the eager model again


def test_editing_the_export_code_reruns_export_and_nothing_after_it(own_build):
    """Early cutoff: each re-export writes the same archive, byte for byte, and the same program digest."""
    archives = {stage: own_build / TINY / "export" / name for stage, name in
                (("export", "programs.pt2"), ("export_parts", "parts.pt2"))}
    before = {stage: archive.read_bytes() for stage, archive in archives.items()}
    for stage in archives:
        source = own_build / "src" / "sam3_aoti" / "stages" / f"{stage}.py"
        source.write_text(source.read_text() + "\n# an edit\n")
    assert stale(own_build) & STAGES == set(archives)
    assert executed(run_doit(own_build, "device=cpu")) == set(archives)
    assert {stage: archive.read_bytes() for stage, archive in archives.items()} == before


@pytest.mark.parametrize("module, stages", [
    ("aoti/weights_blob.py", {"compile", "compile_parts", "package"}),  # the compiles check the blob writer
    ("runtime/cuda_graphs.py", {"package", "fallback_drift", "verify", "render"}),  # every stage that loads a package
    ("pipeline/report.py", {"verify"}),
])
def test_editing_a_module_of_a_subpackage_makes_exactly_its_importers_stale(own_build, module, stages):
    source = own_build / "src" / "sam3_aoti" / module
    source.write_text(source.read_text() + "\n# an edit\n")
    assert stale(own_build) & STAGES == stages


def test_new_weights_repackage_without_recompiling_and_a_killed_run_redoes_only_its_stage(own_build):
    """Another seed: same architecture, other values. The compiled code stays; weights, export and package
    rerun (the package gets the new weights blob in seconds). That run is killed in verify: doit saved its
    state after each task, so the rerun redoes verify and render only, and verify (AOTI against eager with
    the new weights) passes."""
    art = own_build / TINY
    index = (art / "compiled" / "index.json").read_bytes()
    parts_index = (art / "compiled_parts" / "index.json").read_bytes()
    blob_before = json.loads((art / "manifest.json").read_text())["stages"]["package"]["outputs"]
    config = own_build / "pipeline.toml"
    config.write_text(config.read_text().replace("seed = 0", "seed = 1", 1))
    log = art / "logs" / "verify.log"
    log.unlink()
    run = start_doit(own_build, "device=cpu")
    deadline = time.monotonic() + 600
    while not (log.exists() and "profile=" in log.read_text()) and time.monotonic() < deadline:
        time.sleep(0.2)
    os.killpg(run.pid, signal.SIGKILL)  # doit and its verify process, as a power cut would
    first = run.communicate()[0]
    assert {"weights", "export", "export_parts", "fallback", "package"} <= executed(
        subprocess.CompletedProcess([], 0, first, ""))
    assert ".  compile" not in first and (art / "compiled" / "index.json").read_bytes() == index  # nor compile_parts
    assert (art / "compiled_parts" / "index.json").read_bytes() == parts_index
    assert executed(run_doit(own_build, "device=cpu")) == {"verify", "render"}
    assert json.loads((art / "verify" / "report.json").read_text())["passed"]
    manifest = json.loads((art / "manifest.json").read_text())
    assert manifest["stages"]["package"]["outputs"] != blob_before  # new weights in the package
    assert manifest["stages"]["verify"]["verified"] is True
    assert re.search(r"weights .* once", (art / "logs" / "package.log").read_text())


def test_variants_build_side_by_side(built_repo):
    """Each (profile, precision, device) has its own folder and doit state: looking at another variant
    leaves this one up to date, and `doit list` says where each lives."""
    other = run_doit(built_repo, "list", "--status", "profile=sam3", "weights=random", "device=cpu")
    assert "[artifacts/sam3-fp32-cpu/]" in other.stdout
    assert {line.split()[1] for line in other.stdout.splitlines() if line.startswith("R ")} >= {"compile", "package"}
    mine = run_doit(built_repo, "list", "--status", "device=cpu")
    assert f"[{TINY}/]" in mine.stdout
    assert {line.split()[1] for line in mine.stdout.splitlines() if line.startswith("U ")} >= STAGES - {"toolchain"}
    assert not (built_repo / "artifacts" / "sam3-fp32-cpu" / "package").exists()


def test_bad_variable_is_one_line(tmp_path):
    repo = copy_repo(tmp_path)
    proc = run_doit(repo, "list", "profile=huge", check=False)
    assert proc.returncode != 0
    assert proc.stderr.strip().count("\n") == 0 and "profile" in proc.stderr


def test_list_does_not_import_torch(tmp_path):
    repo = copy_repo(tmp_path)
    probe = "import sys; from doit.loader import get_module; get_module('dodo.py'); print('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", probe], cwd=repo, capture_output=True, text=True,
                         env={"PYTHONPATH": str(repo / "src"), "PATH": "/usr/bin:/bin"})
    assert out.stdout.strip() == "False", out.stderr


def test_logs_show_stage_and_elapsed_time(built_repo):
    log = (built_repo / TINY / "logs" / "compile.log").read_text()
    assert re.search(r"^\[compile +\d+\.\ds\] compiled model in", log, re.M)


def test_bench_runs_alone_and_writes_a_table(own_build):
    """The table is under test, not the timings: fewer calls per shape, torch's CPU ISA probe (14 s per loader
    process here, README) off for every loader, and the sections timed eager (compiling the seven twice was 120 of
    this test's 150 CPU seconds; test_measure.py times a compiled section at two shapes)."""
    config = own_build / "pipeline.toml"
    text = config.read_text().replace("warmup = 3\niters = 20", "warmup = 1\niters = 2", 1)
    assert 'sections = "compiled"' in text
    text = text.replace('sections = "compiled"', 'sections = "eager"', 1)
    config.write_text(text.replace("[[1, 1], [2, 3], [4, 4], [16, 1], [1, 16]]", "[[1, 1], [2, 3], [1, 4]]", 1))
    proc = run_doit(own_build, "bench", "device=cpu", env={"TORCHINDUCTOR_VEC_ISA_OK": "0"})
    assert executed(proc) == {"bench"}  # the package is up to date: nothing upstream reruns
    bench = json.loads((own_build / TINY / "bench" / "bench.json").read_text())
    assert [(r["batch"], r["prompts"]) for r in bench["rows"]] == [(1, 1), (2, 3), (1, 4)]
    columns = ["transformers eager", "exported program", "AOTI"]
    for i, r in enumerate(bench["rows"]):  # on the CPU: no CUDA-graph or Meta column, no GEMM rate, no kernel profile
        assert list(r["backends"]) == columns and r["order"] == columns[i % 3:] + columns[:i % 3]  # rotated
        parts = r["parts"]  # the tiny package is split: its parts timed alone, with their FLOPs
        assert list(parts) == ["encode_image", "encode_text", "decode", "a new prompt against encoded images",
                               "these prompts against encoded images", "the whole call with 4 exemplar boxes",
                               "a new set of 4 boxes against encoded images and prompts"]
        assert all(v["median_ms"] > 0 for v in parts.values())
        assert parts["encode_image"]["flop"] + parts["encode_text"]["flop"] + parts["decode"]["flop"] == r["flop"]
        assert min(parts[n]["flop"] for n in ("encode_image", "encode_text", "decode")) > 0
        assert all(v["median_ms"] > 0 and v["p90_ms"] >= v["median_ms"] and v["images_per_s"] > 0
                   for v in r["backends"].values())
        assert r["flop"] > 0
        by_section = r["sections"]  # each section alone, fed what the whole call gives it
        assert by_section["how"] == "eager" and list(by_section["sections"]) == [
            "ViT", "text encoder", "geometry encoder", "DETR encoder", "DETR decoder", "mask decoder", "scoring"]
        assert all(v["median_ms"] > 0 and v["flop"] > 0 and v["tflop_per_s"] >= 0 and v["weight_bytes"] > 0
                   and "floor_ms" not in v for v in by_section["sections"].values())  # a floor needs the GPU's rates
        built = by_section["flop"]  # the build's own count: its optimizations restructure some of the model's arithmetic
        assert 0.9 * built <= sum(v["flop"] for v in by_section["sections"].values()) <= built  # the glue has few
        assert 0.5 * r["flop"] <= built <= 2 * r["flop"]
        assert by_section["package_ms"] == r["backends"]["AOTI"]["median_ms"] and by_section["transforms"]["median_ms"] > 0
        assert by_section["between_ms"] == round(by_section["package_ms"] - by_section["sum_ms"], 2)
    assert bench["rows"][1]["flop"] > bench["rows"][0]["flop"]  # FLOPs counted per shape
    assert {"sam3_aoti load_package, first start", "sam3_aoti load_package, next start",
            "torch load_package model, no ISA probe", "load_pt2, no ISA probe"} == set(bench["load_seconds"])
    assert all(seconds > 0 for seconds in bench["load_seconds"].values()) and bench["fallback_load_seconds"] > 0
    md = (own_build / TINY / "bench" / "bench.md").read_text()
    assert bench["iters"] == 2 and "| 2 | 3 |" in md and "AOTI ms (p90)" in md and "## Load" in md
    assert "## Encode once, decode many" in md and "decode TFLOP/s" in md
    assert "## Where a call's time goes, by section: each section eager alone" in md and "| DETR encoder |" in md
    assert (own_build / TINY / "bench" / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


@pytest.mark.slow  # a stage process
def test_a_missing_input_fails_the_stage_in_one_line(tmp_path):
    repo = copy_repo(tmp_path)
    proc = run_doit(repo, "-s", "bench", "device=cpu", check=False)  # -s: run bench alone, no package built
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "Traceback" not in out
    assert out.count("failed: no package at") == 1
    assert f"log: {TINY}/logs/bench.log" in out


def test_two_clean_builds_give_the_same_program_and_bitwise_equal_outputs(built_repo, second_clean_build):
    """Reproducible: another clean checkout builds the same exported archive, byte for byte, and a package
    whose outputs equal the first one's bit for bit."""
    import torch

    from sam3_aoti.model.configs import example_inputs, tiny_config
    from sam3_aoti.runtime.loader import load_package

    for rel in ("export/programs.pt2", "export/program.json", "export/parts.pt2", "export/parts.json"):
        assert (second_clean_build / TINY / rel).read_bytes() == (built_repo / TINY / rel).read_bytes(), rel
    inputs = example_inputs(tiny_config(), 2, 3, seed=3)
    with torch.no_grad():
        first, second = (load_package(root / TINY / "package" / "sam3.pt2").model(*inputs)
                         for root in (built_repo, second_clean_build))
        assert all(torch.equal(a, b) for a, b in zip(first, second))


def test_the_profile_table_is_in_every_stage_fingerprint():
    """[profiles.<name>] decides the architecture: editing it must rerun the stages, from weights on."""
    from dataclasses import replace

    from sam3_aoti.pipeline.settings import load_settings

    settings = load_settings(device="cpu")
    edited = {**settings.tables, "profiles": {**settings.tables["profiles"], "tiny": {"architecture": "full"}}}
    for stage in ("weights", "export", "compile"):
        assert settings.fingerprint(stage) != replace(settings, tables=edited).fingerprint(stage)


def test_doit_takes_a_recorded_files_sha256_instead_of_hashing_it_again(tmp_path):
    """The manifest's sha256 stands for a file whose size, mtime and ctime are as recorded; a byte changed in
    place (its size and mtime kept) moves the ctime, and doit's own md5 decides again."""
    import os

    from sam3_aoti.pipeline.artifacts import record
    from tasks.runs import RecordedChecksums

    big = tmp_path / "package" / "sam3.pt2"
    big.parent.mkdir()
    big.write_bytes(b"x" * 1000)
    record(tmp_path / "manifest.json", "package", [big], {})
    checker = RecordedChecksums()
    checker.manifest = tmp_path / "manifest.json"
    state = checker.get_state(str(big), None)
    assert state[2].startswith("sha256:")
    stat = big.stat()
    big.write_bytes(b"y" * 1000)
    os.utime(big, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    later = (state[0] - 1, *state[1:])  # as if saved at another mtime: the content is compared
    assert checker.check_modified(str(big), big.stat(), later)
    assert not checker.get_state(str(big), None)[2].startswith("sha256:")  # not the recorded file any more
    big.write_bytes(b"x" * 1000)  # the recorded content again, at a new ctime (a copied checkout)
    os.utime(big, ns=(stat.st_atime_ns, stat.st_mtime_ns + 10**9))
    assert not checker.check_modified(str(big), big.stat(), state)


def test_a_recorded_file_is_hashed_once(tmp_path, monkeypatch):
    """A later stage takes a file's sha256 from the manifest while the file is what its stage recorded; a file
    rewritten since (same size, its ctime moved) is read again; a digest written and then recorded reads once."""
    import hashlib
    import os

    import sam3_aoti.runtime.files as files
    from sam3_aoti.pipeline.artifacts import record, recorded_sha256
    from sam3_aoti.runtime.integrity import write_digest

    checkpoint = tmp_path / "weights" / "checkpoint"
    checkpoint.mkdir(parents=True)
    weights = checkpoint / "model.safetensors"
    weights.write_bytes(b"a" * 4096)
    record(tmp_path / "manifest.json", "weights", [checkpoint], {})
    reads = []
    real = files.sha256
    monkeypatch.setattr(files, "sha256", lambda p: reads.append(p) or real(p))
    assert recorded_sha256(tmp_path / "manifest.json", weights) == hashlib.sha256(b"a" * 4096).hexdigest()
    assert reads == []
    stat = weights.stat()
    weights.write_bytes(b"b" * 4096)
    os.utime(weights, ns=(stat.st_atime_ns, stat.st_mtime_ns))
    assert recorded_sha256(tmp_path / "manifest.json", weights) == hashlib.sha256(b"b" * 4096).hexdigest()
    assert reads == [weights]

    package = tmp_path / "sam3.pt2"
    package.write_bytes(b"p" * 4096)
    write_digest(package)
    record(tmp_path / "manifest.json", "package", [package], {})
    assert reads == [weights, package]
