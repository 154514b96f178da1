"""Fixtures and hooks only (shared helpers live in helpers.py). No torch at collection: the quick loop starts fast."""

import json
import os
import shutil
import time
from pathlib import Path

import pytest

from helpers import RUN_SPANS, TINY, build_key, build_root, copy_build, start_build, wait_for_build


def pytest_configure(config):
    """Remembered package checks (integrity.py) go to a folder of this run, not the user's cache; torch gets one
    thread. A run has one id, which its xdist workers share."""
    import tempfile
    import uuid

    os.environ["SAM3_AOTI_CACHE"] = tempfile.mkdtemp(prefix="sam3-aoti-cache-")
    # One OpenMP thread per process of the run (unless set): the tiny model gains little from intra-op threads,
    # and beside xdist workers or a build, torch's default (a thread per core) oversubscribes the cores, where
    # OpenMP's waiting threads spin: the quick loop beside a tiny build took 183 s with the default, 49 s so.
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    # Inductor's pool of compile processes unstarted (unless set) where no GPU is: a CPU compile is one C++ file
    # per model, so the pool is only its start, a torch import per core in every process that compiles.
    from sam3_aoti.pipeline.settings import gpu_present

    if not gpu_present():
        os.environ.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    # The run's own builds at full priority (unless set): its build-reading tests wait for them, and niced
    # builds behind the tests that need none finished at 363 s instead of 154 (benchmarks/cpu-2026-12-05-nice).
    os.environ.setdefault("SAM3_AOTI_NICE", "0")
    if not hasattr(config, "workerinput"):  # the run's own process; its workers inherit what it sets
        os.environ[RUN_ID] = uuid.uuid4().hex  # a new id, even in a pytest that a test starts
        # the run's build, as the checkout is now: an edit while the run goes on starts no second build
        os.environ[BUILD_KEY] = build_key()
        # The timeline file is this run's: a pytest that one of its tests starts writes none (it would take the
        # builds' spans); the workers and builds find it under RUN_SPANS.
        config.spans_path = os.environ.pop("SAM3_AOTI_TEST_SPANS", None)
        if config.spans_path:
            os.environ[RUN_SPANS] = config.spans_path
            Path(f"{config.spans_path}.builds").unlink(missing_ok=True)
    config.run_id = os.environ[RUN_ID]
    config.pluginmanager.register(BuildsFirst(), "sam3-aoti-builds-first")


def cpu_seconds() -> float:
    """This process's CPU time and that of its children it has waited for (a test's doit, stages, servers)."""
    import resource

    own, children = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return own.ru_utime + own.ru_stime + children.ru_utime + children.ru_stime


@pytest.hookimpl(tryfirst=True)
def pytest_runtest_setup(item):
    item.cpu_start, item.wall_start = cpu_seconds(), time.time()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item, call):
    """Each test's CPU seconds from its setup to its teardown, in its teardown report (xdist carries it to the
    run's own process): on 2 cores the suite's time is its CPU work, which wall-clock durations hide."""
    outcome = yield
    report = outcome.get_result()
    if call.when == "teardown" and hasattr(item, "cpu_start"):
        report.user_properties += [("cpu_s", round(cpu_seconds() - item.cpu_start, 2)),
                                   ("wall", (item.wall_start, time.time()))]


def pytest_terminal_summary(terminalreporter):
    """The 25 tests of most CPU work (each with its processes) and the run's total (the builds started at
    collection count where they are waited for; the workers' own start is left out), then the last five tests to
    end: whether the run ends on a long test."""
    reports = [r for r in terminalreporter.stats.get("passed", []) + terminalreporter.stats.get("failed", []) +
               terminalreporter.stats.get("", []) if r.when == "teardown" and "cpu_s" in dict(r.user_properties)]
    if not reports:
        return
    spent = [(dict(r.user_properties)["cpu_s"], r.nodeid) for r in reports]
    terminalreporter.write_sep("=", f"most CPU work: 25 of {len(spent)} tests, {sum(s for s, _ in spent) / 60:.1f} "
                                    "core-minutes in all")
    for seconds, nodeid in sorted(spent, reverse=True)[:25]:
        terminalreporter.write_line(f"{seconds:8.1f}s cpu  {nodeid}")
    spans = [(dict(r.user_properties)["wall"], r.nodeid) for r in reports]
    first = min(start for (start, _), _ in spans)
    terminalreporter.write_sep("-", "the last 5 tests to end (seconds after the first began)")
    for (start, stop), nodeid in sorted(spans, key=lambda span: span[0][1])[-5:]:
        terminalreporter.write_line(f"{start - first:7.0f} -> {stop - first:5.0f} s  {nodeid}")
    if getattr(terminalreporter.config, "spans_path", None):  # every test's and build's span, for a timeline
        path = Path(terminalreporter.config.spans_path)
        tests = [{"test": r.nodeid, "start": span[0], "stop": span[1], "cpu_s": dict(r.user_properties)["cpu_s"]}
                 for r, (span, _) in zip(reports, spans)]
        built = path.with_name(f"{path.name}.builds")
        builds = [json.loads(line) for line in built.read_text().splitlines()] if built.exists() else []
        built.unlink(missing_ok=True)
        path.write_text(json.dumps({"tests": tests, "builds": builds}))


def busy_cores(seconds: float = 0.3) -> float:
    """How many of this machine's cores are busy now with work that does not step back: /proc/stat's jiffies
    over a short interval, less idle, iowait and niced time (a build's stages, `tasks.runs.step_back`, yield
    their cores to what runs beside them)."""
    import time

    def sample() -> tuple[int, int]:
        fields = [int(x) for x in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
        total = sum(fields[:8])  # user nice system idle iowait irq softirq steal (guest time is inside user's)
        return total, fields[1] + fields[3] + fields[4]  # nice, idle, iowait

    (total0, idle0), _, (total1, idle1) = sample(), time.sleep(seconds), sample()
    return (os.cpu_count() or 1) * (1 - (idle1 - idle0) / max(total1 - total0, 1))


def pytest_xdist_auto_num_workers(config):
    """`-n auto`: a worker per core that is idle now (as `make -l` holds back under load), and no workers (the run
    in this process) when fewer than two are: a worker costs its own imports and collection, about 8 core-seconds,
    which a machine busy with a build cannot spare (docs/testing.md)."""
    try:
        idle = len(os.sched_getaffinity(0)) - round(busy_cores())
    except OSError:
        idle = os.cpu_count() or 1
    return idle if idle >= 2 else 0


BUILD_KEY = "SAM3_AOTI_TEST_BUILD_KEY"
RUN_ID = "SAM3_AOTI_TEST_RUN_ID"  # the run's id (its second build's folder), set by its own process


def the_build() -> Path:
    """The tiny build of this checkout's content when the run began, kept per content (`helpers.build_key`)."""
    return build_root() / (os.environ.get(BUILD_KEY) or build_key())


def second_build(config) -> Path:
    """This run's second clean build (to `package`), cold: never a kept one. Its checkout's path has spaces, so
    the one build shows both that a build is reproducible and that a spaced path builds."""
    import tempfile

    return Path(tempfile.gettempdir()) / f"sam3-aoti-clean-{config.run_id}" / "a folder" / "sam3 aoti"


def pytest_collection_modifyitems(config, items):
    """A test that needs a tiny build (minutes on a CPU) or starts the S3 server is `slow`, as is one marked so
    for a compile, an export or a process of its own: `pytest -m "not slow"` is the quick loop. GPU tests are
    skipped where no NVIDIA driver is loaded (told without importing torch)."""
    from sam3_aoti.pipeline.settings import gpu_present

    skip = pytest.mark.skip(reason="needs CUDA")
    for item in items:
        if len(item.nodeid) > 300:  # it goes into PYTEST_CURRENT_TEST, which every subprocess of the test inherits
            item.runtest = lambda n=len(item.nodeid): pytest.fail(
                f"a test id of {n} characters: give its parameters short ids (parametrize's ids=)", pytrace=False)
        if {"built_repo", "second_clean_build", "s3_server"} & set(getattr(item, "fixturenames", ())):
            item.add_marker(pytest.mark.slow)
        if "gpu" in item.keywords and not gpu_present():
            item.add_marker(skip)


class BuildsFirst:
    @pytest.hookimpl(trylast=True)  # after `-m` deselected what will not run
    def pytest_collection_modifyitems(self, config, items):
        """The builds the selected tests need start now, in the background (one process of a run builds each),
        and the modules that need none run first, while they build."""
        wanted = set().union(*(getattr(item, "fixturenames", ()) for item in items
                               if not item.get_closest_marker("skip")))
        if "second_clean_build" in wanted:  # behind the first (niced): its two tests run last, and the first's
            # readers wait for it. Nice 4 puts its stages' sessions at 10 (tasks.runs.SESSION_EXTRA_NICE): at 16
            # more of it was left for the end, when it runs alone (the run's tail 47 -> 67 s, 72f6266)
            start_build(second_build(config), "package", "device=cpu", nice=4)
        if "built_repo" in wanted and not os.environ.get("SAM3_AOTI_TEST_BUILT_REPO"):
            start_build(the_build(), "device=cpu")
        items.sort(key=build_order(items))


def build_order(items):
    """The sort key of the run's order: modules that need no build first (while the builds run), then modules
    whose tests run stages on their own copy (`own_build`: the minutes-long ones, started as soon as the build is
    there, so the run does not end on one of them), then the modules that only read the build, then the tests
    that wait for the second clean build."""
    def uses(item) -> set:
        return set(getattr(item, "fixturenames", ()))

    reads = {item.path for item in items if {"built_repo", "second_clean_build"} & uses(item)}
    runs_stages = {item.path for item in items if "own_build" in uses(item)}
    return lambda item: (3 if "second_clean_build" in uses(item) else
                         2 - (item.path in runs_stages) if item.path in reads else 0)


@pytest.fixture(scope="session")
def built_repo(tmp_path_factory) -> Path:
    """A temp copy of the repo after one full `doit` run of the tiny profile on the CPU, built once per content
    (under $SAM3_AOTI_TEST_BUILDS or ~/.cache/sam3-aoti/test-builds) and reused by later runs."""
    if os.environ.get("SAM3_AOTI_TEST_BUILT_REPO"):  # a quick loop's: a copy you built (`doit device=cpu`) before
        return Path(os.environ["SAM3_AOTI_TEST_BUILT_REPO"])
    return copy_build(wait_for_build(the_build(), "device=cpu"), tmp_path_factory.mktemp("built") / "repo")


@pytest.fixture(scope="session")
def second_clean_build(request) -> Path:
    """Another clean checkout built to `package`, cold (started at collection, beside the first), in a folder
    whose path has spaces."""
    return wait_for_build(second_build(request.config), "package", "device=cpu")


def pytest_sessionfinish(session):
    """The second clean build is removed by the run's own process once every worker is done: a worker's session
    ends while another may still read the build (its two tests can run on two workers)."""
    if not hasattr(session.config, "workerinput"):
        shutil.rmtree(second_build(session.config).parents[1], ignore_errors=True)


@pytest.fixture(scope="session")
def new_seed_build() -> Path:
    """A clean checkout with another seed (the same architecture, other weights) built up to the compiles
    (toolchain, weights, the exports, the fallback), kept per content beside the tiny build: the binary cache's
    new-seed tests copy it and substitute the compiles."""
    tiny = the_build()
    return wait_for_build(tiny.with_name(f"{tiny.name}-seed-1"), "fallback", "export_parts", "device=cpu",
                          edits=[("seed = 0", "seed = 1")])


@pytest.fixture(scope="session")
def package_path(built_repo) -> Path:
    """The tiny build's package."""
    return built_repo / TINY / "package" / "sam3.pt2"


@pytest.fixture
def own_build(built_repo, tmp_path) -> Path:
    """A copy of the built repo, artifacts and doit state included and up to date (doit's state holds only
    checkout-relative paths), for a test that changes it: the shared build stays as built, and no test
    spends a rebuild putting it back."""
    return copy_build(built_repo, tmp_path / "repo")


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
