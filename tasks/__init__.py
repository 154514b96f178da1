"""The doit side: settings from doit variables, one task dict per stage, and the end-of-run summary.

Nothing here imports torch: `doit list` stays instant. Stage work happens in `sam3_aoti.<stage>.run`.
"""

from __future__ import annotations

import ast
import functools
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

from doit import get_var
from doit.action import TaskFailed
from doit.reporter import ConsoleReporter
from doit.tools import config_changed

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ROOT / "src" / "sam3_aoti"
sys.path.insert(0, str(ROOT / "src"))  # the checkout's library, even beside another installed copy

from sam3_aoti.artifacts import manifest_changes  # noqa: E402
from sam3_aoti.config import load_settings  # noqa: E402
from sam3_aoti.errors import Sam3AotiError  # noqa: E402
from sam3_aoti.paths import ProfilePaths  # noqa: E402
from sam3_aoti.cuda_env import env_file  # noqa: E402

VARIABLES = ("profile", "device", "precision", "weights", "config", "toolkit")


def _settings():
    """The variables, pipeline.toml and cases.toml, all checked before any stage runs."""
    from doit import doit_cmd

    from sam3_aoti.config import DEFAULT_CASES
    from sam3_aoti.validate import check_cases, check_variables

    try:
        check_variables(doit_cmd._CMDLINE_VARS or {}, VARIABLES)
        settings = load_settings(**{name: get_var(name) for name in VARIABLES})
        check_cases(DEFAULT_CASES)
        return settings
    except Sam3AotiError as e:
        sys.exit(f"sam3-aoti: {e}")


SETTINGS = _settings()
if SETTINGS.notice:
    print(f"sam3-aoti: {SETTINGS.notice}", file=sys.stderr)
PATHS = ProfilePaths.of(SETTINGS)
ENV_FILE = env_file(SETTINGS)


@functools.lru_cache(maxsize=None)  # each module parsed once per doit load, however many stages import it
def imported_modules(module: str) -> frozenset[str]:
    """The sam3_aoti modules `module` imports anywhere in its source (function-level imports too) or runs
    (`python -m sam3_aoti.probe`)."""
    found = set()
    for node in ast.walk(ast.parse((SOURCES / f"{module}.py").read_text())):
        if isinstance(node, ast.ImportFrom) and node.level == 1:
            found.update([node.module.split(".")[0]] if node.module else [a.name for a in node.names])
        elif isinstance(node, ast.ImportFrom) and (node.module or "").startswith("sam3_aoti."):
            found.add(node.module.split(".")[1])
        elif isinstance(node, ast.Import):
            found.update(a.name.split(".")[1] for a in node.names if a.name.startswith("sam3_aoti."))
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and node.value.startswith("sam3_aoti."):
            found.add(node.value.split(".")[1])
    return frozenset(m for m in found if (SOURCES / f"{m}.py").exists())


def sources(stage: str) -> list[str]:
    """Every library module the stage imports, directly or not, read from the code (never a hand list that
    goes stale): editing one reruns the stage."""
    seen, todo = set(), [stage]
    while todo:
        module = todo.pop()
        if module not in seen:
            seen.add(module)
            todo += imported_modules(module)
    return [str(SOURCES / f"{m}.py") for m in sorted(seen)]


def stage_command(name: str) -> list[str]:
    """The stage's process, given the settings as resolved here (a fallback taken once, not re-decided)."""
    resolved = {"profile": SETTINGS.profile, "device": SETTINGS.device, "precision": SETTINGS.precision,
                "weights": SETTINGS.weights, "config": get_var("config"), "toolkit": SETTINGS.toolkit}
    args = [sys.executable, "-m", f"sam3_aoti.{name}"]
    for var in VARIABLES:
        if resolved[var]:
            args += [f"--{var}", resolved[var]]
    return args


def stage_env(name: str, env_file: Path = ENV_FILE) -> dict:
    """The environment of a stage process: ours, the checkout's library first, Inductor's caches in the
    variant's folder (no global temp cache changes a build; a rebuild reuses its kernels), plus the
    toolchain's cuda.env, except for `toolchain`, which writes that file: it must probe the machine as it
    is, or a fix recorded by an earlier run (CXX) makes the probe pass, is left out of the new file, and
    the compile crashes."""
    from sam3_aoti.cuda_env import read_env_file

    env = {**os.environ, "PYTHONUNBUFFERED": "1", "TORCHINDUCTOR_CACHE_DIR": str(PATHS.inductor_cache)}
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(ROOT / "src"), env.get("PYTHONPATH")]))
    if name != "toolchain":
        env.update(read_env_file(env_file, env))
    return env


def run_stage(name: str):
    """Each stage in its own process: memory is returned between full-size stages, cuda.env applies
    before torch is imported, and a crash in native code fails the task instead of killing doit."""
    proc = subprocess.run(stage_command(name), cwd=ROOT, env=stage_env(name))
    if proc.returncode == 0:
        return None
    how = f"exit {proc.returncode}" if proc.returncode > 0 else f"killed by {signal.Signals(-proc.returncode).name}"
    return TaskFailed(f"stage {name} failed ({how}); log: {PATHS.log(name).relative_to(ROOT)}")


def stage_task(name: str, doc: str, file_dep: list, targets: list, **fingerprint_extra) -> dict:
    """Paths inside the checkout are given relative to it (doit runs from dodo.py's folder), so doit's state
    holds no absolute path: a copied or moved checkout with its artifacts is still up to date."""
    return {
        "doc": f"{doc} [{relative(PATHS.root)}/]",
        "actions": [(run_stage, [name])],
        "file_dep": [str(relative(Path(p))) for p in [*sources(name), *file_dep]],
        "targets": [str(relative(Path(p))) for p in targets],
        "uptodate": [config_changed({**SETTINGS.fingerprint(name), **fingerprint_extra}), targets_intact(name)],
        "clean": True,
        "verbosity": 2,
    }


class targets_intact:
    """doit sees that targets exist; this sees that they still hold what their stage wrote (the manifest's
    size, mtime and sha256), so a truncated package or an edited report makes its stage run again; and a
    verify that did not pass (or died) is never up to date."""

    def __init__(self, stage: str):
        self.stage = stage

    def __call__(self, task, values):
        if stage_entry(self.stage).get("verified") is False:
            return False
        return not manifest_changes(PATHS.manifest, [self.stage])


def stage_entry(stage: str) -> dict:
    manifest = json.loads(PATHS.manifest.read_text()) if PATHS.manifest.exists() else {}
    return manifest.get("stages", {}).get(stage, {})


def check_artifacts():
    """`doit check`: re-hash every artifact of this variant against the manifest; name what changed."""
    problems = manifest_changes(PATHS.manifest, rehash=True)
    for line in problems:
        print(f"changed  {line}")
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
