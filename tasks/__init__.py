"""The doit side: settings from doit variables, one task dict per stage, and the end-of-run summary.

Nothing here imports torch: `doit list` stays instant. Stage work happens in `sam3_aoti.<stage>.run`.
"""

from __future__ import annotations

import sys
from pathlib import Path

from doit import get_var
from doit.action import TaskFailed
from doit.reporter import ConsoleReporter
from doit.tools import config_changed

ROOT = Path(__file__).resolve().parent.parent
SOURCES = ROOT / "src" / "sam3_aoti"
sys.path.insert(0, str(ROOT / "src"))  # the checkout's library, even beside another installed copy

from sam3_aoti.config import load_settings  # noqa: E402
from sam3_aoti.errors import Sam3AotiError  # noqa: E402
from sam3_aoti.paths import ProfilePaths  # noqa: E402

VARIABLES = ("profile", "device", "precision", "weights", "config")


def _settings():
    try:
        return load_settings(*(get_var(name) for name in VARIABLES))
    except Sam3AotiError as e:
        sys.exit(f"sam3-aoti: {e}")


SETTINGS = _settings()
PATHS = ProfilePaths.of(SETTINGS)


def sources(*modules: str) -> list[str]:
    """The library modules a stage's result depends on: editing one reruns that stage."""
    return [str(SOURCES / f"{m}.py") for m in modules]


def run_stage(name: str):
    import importlib

    from sam3_aoti.stage import run

    module = importlib.import_module(f"sam3_aoti.{name}")
    try:
        run(name, module.run, SETTINGS)
    except Sam3AotiError as e:
        return TaskFailed(f"{name}: {e}")
    return None


def stage_task(name: str, doc: str, modules: list[str], file_dep: list, targets: list, **fingerprint_extra) -> dict:
    return {
        "doc": doc,
        "actions": [(run_stage, [name])],
        "file_dep": sources(name, *modules) + [str(p) for p in file_dep],
        "targets": [str(p) for p in targets],
        "uptodate": [config_changed({**SETTINGS.fingerprint(name), **fingerprint_extra})],
        "clean": True,
        "verbosity": 2,
    }


class SummaryReporter(ConsoleReporter):
    """doit's console reporter, plus where the results are, printed at the end of every run."""

    def complete_run(self):
        super().complete_run()
        shown = [("package", PATHS.package), ("report", PATHS.verify_report_md), ("pictures", PATHS.render_index)]
        lines = [f"  {label:9} {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}"
                 for label, path in shown if path.exists()]
        if lines and not self.failures:
            self.write(f"sam3-aoti [{SETTINGS.profile}, {SETTINGS.device}, {SETTINGS.precision}]:\n" + "\n".join(lines) + "\n")
