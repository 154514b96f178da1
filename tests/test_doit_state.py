"""Nothing lost, nothing silently wrong in the build: checked targets, doit's state, interrupted and concurrent runs,
full disks, temporaries of dead runs."""

import fcntl
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from sam3_aoti.errors import Sam3AotiError

from helpers import TINY, copy_repo, executed, one_line_error, run_doit, stale, start_doit


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


def test_stages_stop_before_the_work_when_the_disk_is_too_full(built_repo, monkeypatch):
    from sam3_aoti.pipeline import artifacts
    from sam3_aoti.pipeline.settings import load_settings
    from sam3_aoti.stages import compile as compile_stage

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
    from sam3_aoti.errors import CompileError
    from sam3_aoti.pipeline.runner import stage_logging
    from sam3_aoti.pipeline.settings import load_settings

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


def test_a_checkout_with_a_space_in_its_path_builds(second_clean_build):
    """The second clean build (conftest) ran in a checkout whose path has spaces (`a folder/.sam3 aoti.building`,
    renamed when whole): export, compile, the fallback and package all took their paths through it."""
    assert " " in second_clean_build.parent.name and " " in second_clean_build.name
    art = second_clean_build / TINY
    assert re.search(r"^\[compile +\d+\.\ds\] compiled model in", (art / "logs" / "compile.log").read_text(), re.M)
    assert json.loads((art / "manifest.json").read_text())["stages"]["package"]["outputs"]


def test_no_file_under_artifacts_names_the_checkout(built_repo):
    """A copied or moved checkout keeps working: cuda.env, doctor.json, settings and indices name paths inside
    the checkout relative to it ($SAM3_AOTI_ROOT)."""
    named = [str(p.relative_to(built_repo)) for p in (built_repo / "artifacts").rglob("*")
             if p.is_file() and p.suffix in (".env", ".json") and "inductor-cache" not in p.parts
             and str(built_repo) in p.read_text(errors="replace")]
    assert named == []


def processes_of(repo: Path) -> list[int]:
    """The processes whose environment names this checkout: doit, its stages, their workers and compilers."""
    marker, found = str(repo.resolve()).encode(), []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit() and int(entry.name) != os.getpid():
            try:
                if marker in Path(entry.path, "environ").read_bytes():
                    found.append(int(entry.name))
            except OSError:
                pass
    return found


@pytest.mark.parametrize("how", [signal.SIGINT, signal.SIGKILL])
def test_an_interrupted_compile_leaves_no_worker_behind(own_build, how):
    """Ctrl-C, or SIGKILL of doit, while AOTInductor's workers compile: nothing of the run is left a few seconds
    later (before, the workers compiled on for minutes and wrote into the variant's folder after the next run
    had cleared its temporaries)."""
    source = own_build / "src" / "sam3_aoti" / "aoti" / "compile.py"
    source.write_text(source.read_text() + "\n# an edit: compile runs\n")
    proc = start_doit(own_build, "device=cpu")
    deadline = time.monotonic() + 300
    for line in proc.stdout:
        if "AOTInductor compiling" in line or time.monotonic() > deadline:
            break
    time.sleep(5)  # the workers are spawned and at work
    assert len(processes_of(own_build)) >= 3, "doit, its compile stage and a worker should be running"
    os.killpg(proc.pid, how)
    proc.communicate(timeout=180)
    deadline = time.monotonic() + 20
    while processes_of(own_build) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert processes_of(own_build) == []
