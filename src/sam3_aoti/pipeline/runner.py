"""Run one stage: progress lines with elapsed time, a log under artifacts/, one-line errors, the exit codes of
`errors`. A stage gets its settings whole, from the file doit wrote (`--settings`), or resolves them from the
variables when run by hand (`python -m sam3_aoti.stages.<stage> --profile ...`)."""

from __future__ import annotations

import argparse
import contextlib
import errno
import logging
import os
import shutil
import sys
import time
from pathlib import Path

from ..errors import Sam3AotiError, first_line
from .paths import ProfilePaths
from .settings import Settings, load_settings

log = logging.getLogger("sam3_aoti")  # the package's logger: every module's `getLogger(__name__)` reaches it
UNDER_DOIT = "SAM3_AOTI_UNDER_DOIT"  # set by doit for its stage processes: doit says "interrupted" itself


class _Elapsed(logging.Formatter):
    def __init__(self, stage: str):
        super().__init__()
        self.stage, self.start = stage, time.monotonic()

    def format(self, record):
        line = f"[{self.stage} {time.monotonic() - self.start:6.1f}s] {record.getMessage()}"
        return f"{line}\n{self.formatException(record.exc_info)}" if record.exc_info else line


@contextlib.contextmanager
def stage_logging(settings: Settings, stage: str):
    """Send the stage's progress to stderr and to artifacts/<profile>/logs/<stage>.log."""
    path = ProfilePaths.of(settings).log(stage)
    path.parent.mkdir(parents=True, exist_ok=True)
    formatter = _Elapsed(stage)
    terminal, file = logging.StreamHandler(sys.stderr), logging.FileHandler(path, mode="w")
    terminal.setLevel(logging.INFO)  # the log file also keeps the DEBUG detail (e.g. every verify row)
    handlers = [terminal, file]
    for h in handlers:
        h.setFormatter(formatter)
        log.addHandler(h)
    log.setLevel(logging.DEBUG)
    log.propagate = False
    try:
        log.info("profile=%s device=%s precision=%s weights=%s", settings.profile, settings.device,
                 settings.precision, settings.weights)
        yield
        log.info("done")
    except Sam3AotiError as e:  # one line to the terminal; the library error behind it, whole, to the log
        if e.__cause__ is not None:
            log.debug("caused by", exc_info=(type(e.__cause__), e.__cause__, e.__cause__.__traceback__))
        log.error("failed: %s", e)
        raise
    except Exception as e:  # a bug, a full disk or an unforeseen library error: the traceback goes to the log only
        log.debug("traceback", exc_info=True)
        if isinstance(e, OSError) and e.errno == errno.ENOSPC:
            free = shutil.disk_usage(path.parent).free
            message = (f"the disk is full writing {e.filename or ProfilePaths.of(settings).root} ({free / 2**20:.0f} "
                       "MB free on it): free some space (`uv run doit clean` of an old variant), then run again")
        else:
            message = f"unexpected {first_line(e)} (traceback in {path})"
        log.error("failed: %s", message)
        raise Sam3AotiError(message) from None
    finally:
        for h in handlers:
            log.removeHandler(h)
            h.close()


def quiet_libraries(stage: str) -> None:
    """Builds never download, and library progress bars/deprecation chatter would bury ours. (The toolchain
    stages import neither torch nor transformers: they keep their seconds.)"""
    import os
    import warnings

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    if stage in ("toolchain", "probe"):
        return
    warnings.filterwarnings("ignore", message="The given buffer is not writable")
    warnings.filterwarnings("ignore", category=FutureWarning)
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()


def run(stage: str, fn, settings: Settings):
    quiet_libraries(stage)
    with stage_logging(settings, stage):
        return fn(settings)


def main(stage: str, fn, description: str) -> None:
    """`python -m sam3_aoti.stages.<stage>`: the same work as the doit task, for one-off runs."""
    parser = argparse.ArgumentParser(prog=f"python -m sam3_aoti.stages.{stage}", description=description)
    parser.add_argument("--settings", type=Path, help="the settings file doit wrote (artifacts/<variant>/settings.json); "
                                                      "the variables below are then not read")
    parser.add_argument("--profile", help="tiny (default) or sam3")
    parser.add_argument("--device", help="cpu or cuda (default: cuda when a GPU is present)")
    parser.add_argument("--precision", help="fp32, bf16 or fp8 (default: the profile's)")
    parser.add_argument("--weights", help="random (default) or a checkpoint path (profile sam3)")
    parser.add_argument("--config", help="pipeline.toml to read (default: the repository's)")
    parser.add_argument("--toolkit", help="pinned (default: the pip CUDA wheels) or machine")
    args = parser.parse_args()
    try:
        settings = (Settings.read(args.settings) if args.settings else
                    load_settings(args.profile, args.device, args.precision, args.weights, args.config,
                                  toolkit=args.toolkit))
    except Sam3AotiError as e:
        print(f"{stage}: {e}", file=sys.stderr)
        sys.exit(e.exit_code)
    try:
        run(stage, fn, settings)
    except Sam3AotiError as e:
        sys.exit(e.exit_code)  # stage_logging already printed the one-line reason
    except KeyboardInterrupt:
        if not os.environ.get(UNDER_DOIT):
            print(f"{stage}: interrupted", file=sys.stderr)
        sys.exit(130)
