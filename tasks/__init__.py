"""The doit side: settings from doit variables, one task dict per stage, and the end-of-run summary.

Nothing here imports torch: `doit list` stays instant. Stage work happens in `sam3_aoti.stages.<stage>.run`,
each in its own process.
"""

from __future__ import annotations

import ast
import functools
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

from doit import get_var
from doit.action import TaskFailed
from doit.reporter import ConsoleReporter
from doit.tools import config_changed

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ROOT / "src"
PACKAGE = "sam3_aoti"
sys.path.insert(0, str(SOURCES))  # the checkout's library, even beside another installed copy

from sam3_aoti.errors import ConfigError, Sam3AotiError  # noqa: E402
from sam3_aoti.pipeline.artifacts import manifest_changes  # noqa: E402
from sam3_aoti.pipeline.paths import ProfilePaths, ToolchainPaths  # noqa: E402
from sam3_aoti.pipeline.runner import UNDER_DOIT  # noqa: E402
from sam3_aoti.pipeline.settings import load_settings  # noqa: E402
from tasks.runs import (BESIDE, RUNNING, kill_group, low_disk, may_write_now, nice_of,  # noqa: E402
                        record_stage_group, stage_nice, stage_preexec)

SETTING_VARIABLES = ("profile", "device", "precision", "weights", "config", "toolkit")
VARIABLES = (*SETTING_VARIABLES, "cache", "ref")  # the binary cache's (tasks.cache): no stage reads them
# Stages that load the package: up to date only while the package still holds what `package` wrote, so that a
# damaged package is rebuilt, and verified again, before any of them is taken as done.
READS_PACKAGE = ("verify", "render", "bench", "parity", "throughput")


def _settings():
    """The variables, pipeline.toml, cases.toml and $SAM3_AOTI_NICE, all checked before any stage runs."""
    from doit import doit_cmd

    from sam3_aoti.pipeline.cases import check_cases
    from sam3_aoti.pipeline.paths import DEFAULT_CASES
    from sam3_aoti.pipeline.schema import check_variables

    try:
        check_variables(doit_cmd._CMDLINE_VARS or {}, VARIABLES)
        settings = load_settings(**{name: get_var(name) for name in SETTING_VARIABLES})
        check_ref(get_var("ref"), get_var("cache") or settings.stage("cache").get("url"))
        check_cases(DEFAULT_CASES)
        stage_nice()
        return settings
    except Sam3AotiError as e:
        print(f"sam3-aoti: {e}", file=sys.stderr)
        sys.exit(e.exit_code)


def check_ref(ref: str | None, cache_url: str | None) -> None:
    """`ref=NAME` is refused when doit loads, before anything is built or pushed: a name a store path cannot
    hold, or no cache to publish it to."""
    if ref is None:
        return
    from sam3_aoti.cache.binary_cache import check_ref_name

    check_ref_name(ref)
    if cache_url in (None, "", "none", "off"):
        raise ConfigError(f"ref={ref} names a package published to a binary cache, and no cache is set: add "
                          "cache=URL (or [cache] url in pipeline.toml)")


SETTINGS = _settings()
if SETTINGS.notice:
    print(f"sam3-aoti: {SETTINGS.notice}", file=sys.stderr)
PATHS = ProfilePaths.of(SETTINGS)
ENV_FILE = ToolchainPaths.of(SETTINGS).env_file


def weights_inputs(weights: str) -> list[Path]:
    """The user's checkpoint files a rebuild depends on: model files and tokenizer files beside them."""
    from sam3_aoti.runtime.tokenizer import CHECKPOINT_TOKENIZER_FILES

    if weights == "random":
        return []
    source = Path(weights)
    folder = source if source.is_dir() else source.parent
    model = [source / "config.json", *sorted(source.glob("*.safetensors"))] if source.is_dir() else [source]
    tokenizer = [folder / name for name in CHECKPOINT_TOKENIZER_FILES]
    return model + [f for f in tokenizer if f.is_file()]


def module_file(module: str) -> Path | None:
    """`sam3_aoti.a.b` -> src/sam3_aoti/a/b.py (or its package's __init__.py); None if it is no module here."""
    base = SOURCES.joinpath(*module.split("."))
    for path in (base.with_suffix(".py"), base / "__init__.py"):
        if path.is_file():
            return path
    return None


def _parents(module: str) -> list[str]:
    """The packages Python imports before `module`: their __init__.py runs too."""
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


@functools.lru_cache(maxsize=None)  # each module parsed once per doit load, however many stages import it
def imported_modules(module: str) -> frozenset[str]:
    """The sam3_aoti modules `module` imports anywhere in its source (function-level imports too, relative or
    absolute, into any subpackage), or runs (`"sam3_aoti.toolchain.probe"` as a string), with their packages."""
    path = module_file(module)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom):
            base = package.rsplit(".", node.level - 1)[0] if node.level else ""
            base = ".".join(filter(None, [base, node.module]))
            for alias in node.names:  # `from pkg import module` names a module; `from module import name`, not
                found.add(f"{base}.{alias.name}" if module_file(f"{base}.{alias.name}") else base)
        elif isinstance(node, ast.Import):
            found.update(a.name for a in node.names)
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            found.add(node.value)
    modules = {m for m in found if (m == PACKAGE or m.startswith(PACKAGE + ".")) and module_file(m)}
    return frozenset(modules | {p for m in modules for p in _parents(m)})


def sources(stage: str) -> list[str]:
    """Every library file the stage imports, directly or not, in every subpackage, read from the code (never a
    hand list that goes stale): editing one reruns the stage."""
    start = f"{PACKAGE}.stages.{stage}"
    seen, todo = set(), [start, *_parents(start)]
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo += imported_modules(module)
    return sorted(str(module_file(m)) for m in seen)


def linked(path: Path) -> Path:
    """`path` as the stage process sees it: through a link without whitespace where the checkout's path has
    some (torch's C++ build line does not quote every path: `pipeline.paths.space_free`)."""
    from sam3_aoti.pipeline.paths import space_free

    path = Path(path)
    return space_free(ROOT) / path.relative_to(ROOT) if path.is_relative_to(ROOT) else path


def stage_command(name: str) -> list[str]:
    """The stage's process, handed the settings resolved here, whole (a fallback taken once, not re-decided)."""
    SETTINGS.write(PATHS.settings)
    return [str(linked(Path(sys.executable))), "-m", f"{PACKAGE}.stages.{name}", "--settings",
            str(linked(PATHS.settings))]


def stage_env(name: str, env_file: Path = ENV_FILE) -> dict:
    """The environment of a stage process: ours, the checkout's library first, Inductor's caches in the
    variant's folder (no global temp cache changes a build; a rebuild reuses its kernels), plus the
    toolchain's cuda.env, except for `toolchain`, which writes that file: it must see the machine as it
    is, or a fix recorded by an earlier run (CXX) is taken for the machine's compiler and left out of the
    new file; and after `probe`, a fix the probe found (probe.env). On the CPU, Inductor's pool of compile
    processes is left unstarted (unless set): a CPU model's kernels are one C++ file, so the pool only costs
    its start, a torch import per core in every stage process (a tiny build: 5.5 core-minutes of user time
    with it, 4.6 without). A stage only verify waits for (`runs.BESIDE`) has its OpenMP threads wait passively
    (unless set): spinning beside the compiles, the tiny fallback's measurement took 44 core-seconds, not 21."""
    from sam3_aoti.toolchain.cuda_env import read_env_file

    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TORCHINDUCTOR_CACHE_DIR": str(linked(PATHS.inductor_cache)),
           UNDER_DOIT: "1"}
    if SETTINGS.device == "cpu":
        env.setdefault("TORCHINDUCTOR_COMPILE_THREADS", "1")
    if name in BESIDE:
        env.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(linked(SOURCES)), env.get("PYTHONPATH")]))
    if name != "toolchain":
        env.update(read_env_file(env_file, env))
    if name not in ("toolchain", "probe"):
        env.update(read_env_file(ToolchainPaths.of(SETTINGS).probe_env, env))
    return env


def run_stage(name: str):
    """Each stage in its own process: memory is returned between full-size stages, cuda.env applies
    before torch is imported, and a crash in native code fails the task instead of killing doit. The
    process has a session of its own (Ctrl-C reaches doit alone, which passes it on to the stage, not to the
    stage's compile workers), dies with doit and steps back for other work on the machine (`runs.step_back`,
    $SAM3_AOTI_NICE). Its progress lines reach the terminal; anything else it or
    the libraries under it print (warnings, a C++ abort's stack frames) goes to logs/<stage>.output.log, so
    the terminal gets one line per failure, never a traceback."""
    raw_log = PATHS.log(name).with_suffix(".output.log")
    raw_log.parent.mkdir(parents=True, exist_ok=True)
    proc = subprocess.Popen(stage_command(name), cwd=linked(ROOT), env=stage_env(name), start_new_session=True,
                            preexec_fn=stage_preexec(nice_of(name)), stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True, errors="replace")
    RUNNING.append((name, proc))  # the probe runs beside the compile: both get a Ctrl-C
    record_stage_group(proc.pid)  # a session of its own: its group is the stage's pid
    raw = 0
    try:
        with open(raw_log, "w") as other:
            for line in proc.stdout:
                if line.startswith(f"[{name} "):
                    sys.stderr.write(line)
                    sys.stderr.flush()
                else:
                    other.write(line)
                    raw += 1
        returncode = proc.wait()
    finally:
        RUNNING.remove((name, proc))
        kill_group(proc.pid)  # nothing of the stage outlives it (a worker it did not stop, a compiler)
    if returncode == 0:
        return None
    how = f"exit {returncode}" if returncode > 0 else f"killed by {signal.Signals(-returncode).name}"
    disk = low_disk(PATHS.root)
    more = f", its other output: {relative(raw_log)}" if raw else ""
    return TaskFailed(f"stage {name} failed ({how}){disk}; log: {relative(PATHS.log(name))}{more}")


def build(name: str):
    """A stage's action: for a compile, the cache by content first; the stage; then its key in the manifest and,
    where this run pushes, its outputs in the cache (tasks.cache)."""
    from tasks import cache

    if name in cache.COMPILES:
        if cache.open_cache() and cache.substitute(name, cache.compile_content_key(name)):
            return None
        failed = compile_with_probe(name)
    else:
        failed = run_stage(name)
    if failed or name not in cache.INPUTS:
        return failed
    try:
        cache.built(name)
    except Sam3AotiError as e:  # no key without the toolchain's facts: the build stands, it is not pushed
        print(f"sam3-aoti cache: {name} has no key ({e})", file=sys.stderr)
    return None


PROBED: list = []  # the AOTI probe's result in this doit run (tasks run in threads of one process)
PROBE_LOCK = threading.Lock()


def probe_once():
    """The AOTI probe, once per run: the first compile to ask runs it, the other waits for its result."""
    with PROBE_LOCK:
        if not PROBED:
            PROBED.append(run_stage("probe"))
        return PROBED[0]


def compile_with_probe(name: str):
    """The AOTI probe beside the compile that really runs, not before it (a minute on a GPU, hidden behind the
    compile's five): a probe that finds the toolchain broken, and a fix, has the compile redone with the fix."""
    fix = ToolchainPaths.of(SETTINGS).probe_env
    before = fix.read_text() if fix.exists() else None
    probe: list = []
    beside = threading.Thread(target=lambda: probe.append(probe_once()))
    beside.start()
    failed = run_stage(name)
    beside.join()
    if probe[0]:
        return probe[0]
    if (fix.read_text() if fix.exists() else None) != before:
        print(f"sam3-aoti: the probe found a fix ({relative(fix)}): compiling {name} again with it", file=sys.stderr)
        failed = run_stage(name)
    return failed


def off(doc: str, why: str, what: str, instead: str = "nothing to do") -> dict:
    """A stage that this variant does not run: its task says why, and does nothing."""
    return {"doc": f"{doc} (off here: {why})", "actions": [lambda: print(f"sam3-aoti: {what} ({why}): {instead}")],
            "uptodate": [False], "verbosity": 2}


def substituted_task(name: str, doc: str, targets: list) -> dict:
    """A stage whose outputs came from the binary cache for today's key: it reads nothing upstream (weights,
    export and compile need not exist here), and stays up to date while its outputs are intact and its key
    is today's."""
    from tasks import cache

    key = cache.substituted()[name]

    def fetch_again():
        return None if cache.open_cache() and cache.substitute(name, key) else TaskFailed(
            f"{name}: its substituted outputs changed and the cache cannot give them again: run `uv run doit` "
            "again, it builds them here")

    return {"doc": f"{doc} [{relative(PATHS.root)}/, substituted from the binary cache]",
            "actions": [fetch_again], "targets": [str(relative(Path(p))) for p in targets],
            "uptodate": [lambda task, values: cache.intact(name, key)], "clean": True, "verbosity": 2}


def stage_task(name: str, doc: str, file_dep: list, targets: list, recorded: bool = True,
               **fingerprint_extra) -> dict:
    """Paths inside the checkout are given relative to it (doit runs from dodo.py's folder), so doit's state
    holds no absolute path: a copied or moved checkout with its artifacts is still up to date."""
    from tasks import cache

    if name in cache.SUBSTITUTED_AT_LOAD and name in cache.substituted():
        return substituted_task(name, doc, targets)
    return {
        "doc": f"{doc} [{relative(PATHS.root)}/]",
        "actions": [(build, [name])],
        "file_dep": [str(relative(Path(p))) for p in [*sources(name), *file_dep]],
        "targets": [str(relative(Path(p))) for p in targets],
        "uptodate": [config_changed({**SETTINGS.fingerprint(name), **fingerprint_extra}),
                     *([targets_intact(name, ("package",) if name in READS_PACKAGE else ())] if recorded else [])],
        "clean": True,
        "verbosity": 2,
    }


class targets_intact:
    """doit sees that targets exist; this sees that they still hold what their stage wrote (the manifest's size,
    times and sha256: a byte changed in place, its size and mtime kept, moves the ctime), so a truncated package
    or an edited report makes its stage run again; and a verify that did not pass (or died) is never up to date.
    A run that may write refreshes the recorded times of files whose content still matches (a copied checkout
    hashes once, not on every run)."""

    def __init__(self, stage: str, inputs: tuple = ()):
        self.stage, self.inputs = stage, inputs  # stages whose outputs this one reads, checked the same way

    def __call__(self, task, values):
        from sam3_aoti.pipeline.artifacts import read_manifest

        if read_manifest(PATHS.manifest)["stages"].get(self.stage, {}).get("verified") is False:
            return False
        return not manifest_changes(PATHS.manifest, [self.stage, *self.inputs], refresh=may_write_now())


def check_artifacts():
    """`doit check`: re-hash every artifact of this variant against the manifest and name what changed; a changed
    package is no longer verified. `uv run doit` rebuilds exactly those: a file whose content changed has a new
    ctime, whatever its mtime says."""
    from sam3_aoti.pipeline.artifacts import mark

    problems = manifest_changes(PATHS.manifest, rehash=True)
    for line in problems:
        print(f"changed  {line}")
    if any(line.startswith("package:") for line in problems):
        mark(PATHS.manifest, "verify", verified=False)  # what was verified is not what is there now
    if problems:
        return TaskFailed(f"{len(problems)} artifact(s) of {relative(PATHS.root)} changed since their stage "
                          "wrote them: `uv run doit` rebuilds them")
    print(f"all artifacts of {relative(PATHS.root)} match {relative(PATHS.manifest)}")
    return None


class SummaryReporter(ConsoleReporter):
    """doit's console reporter, plus where the results are, printed at the end of every run."""

    def complete_run(self):
        super().complete_run()
        shown = [("package", PATHS.package), ("fallback", PATHS.fallback_package), ("report", PATHS.verify_report_md),
                 ("html", PATHS.verify_report_html), ("pictures", PATHS.render_dir), ("bench", PATHS.bench_md)]
        lines = [f"  {label:9} {relative(path)}" for label, path in shown if path.exists()]
        if lines and not self.failures:
            self.write(f"sam3-aoti variant {SETTINGS.variant} in {relative(PATHS.root)}/:\n" + "\n".join(lines) + "\n")


def relative(path: Path) -> Path:
    return path.relative_to(ROOT) if path.is_relative_to(ROOT) else path
