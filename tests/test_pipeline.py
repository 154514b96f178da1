"""`doit` end to end on the tiny profile in a temp copy: artifacts, caching, gates, one-line errors."""

import json
import re
import subprocess
import sys

from conftest import copy_repo, executed, run_doit

STAGES = {"toolchain", "weights", "export", "compile", "verify", "render"}


def test_first_run_builds_every_stage(built_repo):
    art = built_repo / "artifacts" / "tiny"
    for rel in ["weights/checkpoint/model.safetensors", "export/model.pt2", "export/transforms.pt2",
                "package/sam3.pt2", "verify/report.json", "verify/report.md", "verify/report.html",
                "render/index.md", "render/astronaut.png", "render/astronaut_mask_diff.png", "render/scores.png",
                *(f"logs/{s}.log" for s in STAGES)]:
        assert (art / rel).exists(), rel
    report = json.loads((art / "verify" / "report.json").read_text())
    assert report["passed"] and report["failed"] == 0 and report["checks"] > 50
    manifest = json.loads((art / "manifest.json").read_text())
    assert set(manifest["stages"]) == STAGES - {"toolchain"}  # the toolchain is per machine: doctor.json
    assert manifest["stages"]["verify"]["verified"] is True
    package = manifest["stages"]["compile"]["outputs"]["package/sam3.pt2"]
    assert package["bytes"] == (art / "package" / "sam3.pt2").stat().st_size
    assert manifest["stages"]["export"]["torch"] != "absent"


def test_second_run_executes_nothing(built_repo):
    proc = run_doit(built_repo, "device=cpu")
    assert executed(proc) == set()
    assert {line[3:].strip() for line in proc.stdout.splitlines() if line.startswith("-- ")} == STAGES
    assert "artifacts/tiny/package/sam3.pt2" in proc.stdout  # where the results are


def test_a_verify_tolerance_reruns_verify_alone(built_repo):
    config = built_repo / "pipeline.toml"
    text = config.read_text()
    config.write_text(text.replace("top5_overlap_min = 0.8", "top5_overlap_min = 0.75", 1))
    try:
        assert executed(run_doit(built_repo, "device=cpu")) == {"verify"}
    finally:
        config.write_text(text)
    log = (built_repo / "artifacts" / "tiny" / "logs" / "verify.log").read_text()
    hits, total = map(int, re.search(r"eager reference: (\d+) of (\d+) from cache", log).groups())
    assert hits == total > 0  # the rerun did not run the eager model again
    run_doit(built_repo, "device=cpu")


def test_a_failing_gate_fails_the_task_and_unmarks_the_package(built_repo):
    config = built_repo / "pipeline.toml"
    text = config.read_text()
    config.write_text(text.replace("max_abs = 1e-3", "max_abs = -1.0", 1))  # nothing can pass
    try:
        proc = run_doit(built_repo, "device=cpu", check=False)
        assert proc.returncode != 0
        assert "failed: " in proc.stderr and "checks failed, worst: aoti" in proc.stderr
        assert "Traceback" not in proc.stdout + proc.stderr
        manifest = json.loads((built_repo / "artifacts" / "tiny" / "manifest.json").read_text())
        assert manifest["stages"]["verify"]["verified"] is False
        assert "render" not in executed(proc)
    finally:
        config.write_text(text)
    run_doit(built_repo, "device=cpu")


def test_editing_the_export_code_reruns_export(built_repo):
    source = built_repo / "src" / "sam3_aoti" / "export.py"
    text = source.read_text()
    source.write_text(text + "\n# an edit\n")
    try:
        ran = executed(run_doit(built_repo, "device=cpu"))
    finally:
        source.write_text(text)
    assert "export" in ran and "weights" not in ran
    # downstream stages rerun when the exported programs' bytes changed (doit compares file hashes)
    run_doit(built_repo, "device=cpu")


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
    log = (built_repo / "artifacts" / "tiny" / "logs" / "compile.log").read_text()
    assert re.search(r"^\[compile +\d+\.\ds\] compiled model in", log, re.M)


def test_bench_runs_alone_and_writes_a_table(built_repo):
    proc = run_doit(built_repo, "bench", "device=cpu")
    assert executed(proc) == {"bench"}  # the package is up to date: nothing upstream reruns
    bench = json.loads((built_repo / "artifacts" / "tiny" / "bench" / "bench.json").read_text())
    assert [(r["batch"], r["prompts"]) for r in bench["rows"]] == [(1, 1), (2, 3), (4, 4)]
    assert all(r["aoti_ms"] > 0 and r["eager_ms"] > 0 for r in bench["rows"])
    assert "| 2 | 3 |" in (built_repo / "artifacts" / "tiny" / "bench" / "bench.md").read_text()


def test_a_missing_input_fails_the_stage_in_one_line(tmp_path):
    repo = copy_repo(tmp_path)
    proc = run_doit(repo, "-s", "bench", "device=cpu", check=False)  # -s: run bench alone, no package built
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and "Traceback" not in out
    assert out.count("failed: no package at") == 1
    assert "log: artifacts/tiny/logs/bench.log" in out
