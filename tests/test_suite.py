"""The suite's own machinery: a group of tests stays on one worker, and `-n auto` counts the idle cores."""

import subprocess
import sys

import conftest


def test_a_group_of_tests_runs_on_one_worker(tmp_path):
    """`--dist loadgroup` with the pytest and xdist of uv.lock: tests marked with one xdist_group share a
    worker (the segment tests' one Ray; pytest 9.2 broke this silently, pytest-dev/pytest-xdist#1386)."""
    (tmp_path / "test_grouped.py").write_text(
        "import os\nimport pytest\n\npytestmark = pytest.mark.xdist_group('ray')\n\n"
        "@pytest.mark.parametrize('i', range(6))\ndef test_grouped(i):\n"
        "    print('WORKER', os.environ['PYTEST_XDIST_WORKER'])\n")
    (tmp_path / "test_free.py").write_text(
        "import pytest\n\n@pytest.mark.parametrize('i', range(6))\ndef test_free(i):\n    pass\n")
    proc = subprocess.run([sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadgroup", "-p", "no:cacheprovider",
                           "-rA", "-q", "-c", "/dev/null", str(tmp_path)],
                          capture_output=True, text=True, cwd=tmp_path)
    assert proc.returncode == 0, proc.stdout[-2000:]
    workers = {line.split()[1] for line in proc.stdout.splitlines() if line.startswith("WORKER ")}
    assert len(workers) == 1, proc.stdout[-2000:]


def test_auto_takes_a_worker_per_idle_core_and_none_when_fewer_than_two(monkeypatch):
    monkeypatch.setattr(conftest.os, "sched_getaffinity", lambda pid: set(range(8)))
    for busy, workers in [(0.1, 8), (2.4, 6), (6.6, 0), (7.9, 0)]:
        monkeypatch.setattr(conftest, "busy_cores", lambda busy=busy: busy)
        assert conftest.pytest_xdist_auto_num_workers(None) == workers
    monkeypatch.setattr(conftest.os, "sched_getaffinity", lambda pid: {0, 1})
    monkeypatch.setattr(conftest, "busy_cores", lambda: 0.0)
    assert conftest.pytest_xdist_auto_num_workers(None) == 2


def test_busy_cores_are_a_share_of_the_machine():
    assert 0.0 <= conftest.busy_cores(0.05) <= (conftest.os.cpu_count() or 1)


def test_a_stage_steps_back_for_other_work_in_its_own_session(monkeypatch):
    """A stage process (tasks.runs.stage_preexec) runs niced, and its session's group further where Linux
    groups CPU time by session (a build's several stage sessions together weigh about one session at its nice);
    the stages only verify waits for step back further; a bad $SAM3_AOTI_NICE is one line."""
    import os
    import subprocess
    from pathlib import Path

    import pytest

    from sam3_aoti.errors import ConfigError
    from tasks.runs import SESSION_EXTRA_NICE, nice_of, stage_nice, stage_preexec

    report = "import os; from pathlib import Path; p = Path('/proc/self/autogroup'); " \
             "print(os.nice(0), p.read_text().split()[-1] if p.exists() else '-')"
    out = subprocess.run([sys.executable, "-c", report], start_new_session=True, preexec_fn=stage_preexec(7),
                         capture_output=True, text=True, check=True).stdout.split()
    assert int(out[0]) == min(19, os.nice(0) + 7)
    if Path("/proc/self/autogroup").exists():
        assert out[1] == str(7 + SESSION_EXTRA_NICE)
    monkeypatch.delenv("SAM3_AOTI_NICE", raising=False)
    assert stage_nice() == 10
    assert nice_of("compile") == nice_of("export_parts") == 10 and nice_of("fallback") == nice_of("reference") == 15
    for value, want in (("0", 0), ("25", 19)):
        monkeypatch.setenv("SAM3_AOTI_NICE", value)
        assert stage_nice() == want
    monkeypatch.setenv("SAM3_AOTI_NICE", "17")
    assert nice_of("fallback_drift") == 19
    monkeypatch.setenv("SAM3_AOTI_NICE", "high")
    with pytest.raises(ConfigError, match="SAM3_AOTI_NICE='high' is not a whole number"):
        stage_nice()


def test_the_run_reads_the_build_last_and_runs_stages_on_it_first():
    """No-build modules first (while the builds run); of the modules that read the build, those with tests that
    run stages on their own copy (minutes each) before those that only read it; the second clean build's tests
    last."""
    from pathlib import Path
    from types import SimpleNamespace

    def item(path, *fixtures):
        return SimpleNamespace(path=Path(path), fixturenames=fixtures, name=f"{path}{fixtures}")

    items = [item("a_reads.py", "built_repo"), item("b_free.py"), item("c_stages.py", "built_repo"),
             item("c_stages.py", "own_build", "built_repo"), item("d_second.py", "second_clean_build"),
             item("e_free.py", "tmp_path")]
    ordered = sorted(items, key=conftest.build_order(items))
    assert [i.name for i in ordered] == [items[1].name, items[5].name, items[2].name, items[3].name, items[0].name,
                                         items[4].name]
