"""One doit run per variant at a time, no leftovers of dead runs, and doit's state saved after every task.

doit saves which tasks succeeded only when a run ends, so a SIGKILL during compile would make the next run
redo export too; and two runs on one checkout would interleave their writes.
"""

from __future__ import annotations

import fcntl
import os
import re
import shutil
import sys
from pathlib import Path

from doit.dependency import Dependency

# doit commands that only read: they take no lock and clean nothing.
READ_ONLY_COMMANDS = {"list", "help", "info", "dumpdb", "tabcompletion"}
# atomic_output's temporaries: ".<target name>.<8 characters of mkdtemp>", beside the target
TEMPORARY = re.compile(r"^\..+\.[a-z0-9_]{8}$")
_held = []  # the open lock file, for the life of the process


def doit_command(argv: list[str]) -> str:
    """The doit command of this process ("run" when only tasks and variables are given)."""
    from doit.doit_cmd import DoitMain

    commands = {c.get_name() for c in DoitMain.DOIT_CMDS}
    words = [a for a in argv[1:] if not a.startswith("-") and "=" not in a]
    return words[0] if words and words[0] in commands else "run"


def hold_lock(root: Path) -> None:
    """Take `root/.lock` for this process, or stop with one line naming the process that holds it."""
    handle = open(root / ".lock", "a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "another process"
        sys.exit(f"sam3-aoti: doit ({holder}) is already building {root}: wait for it to finish, or stop it")
    handle.seek(0)
    handle.truncate()
    handle.write(f"pid {os.getpid()}")
    handle.flush()
    _held.append(handle)


def remove_stale_temporaries(root: Path) -> list[Path]:
    """Under the lock no other run is writing: every atomic_output temporary left here is a dead run's."""
    stale = [p for p in root.rglob(".*") if p.is_dir() and TEMPORARY.match(p.name)]
    for path in stale:
        shutil.rmtree(path, ignore_errors=True)
    return stale


def save_state_after_every_task() -> None:
    """doit's JSON backend rewrites its file on `dump`; doing so after each success makes an interrupted run
    lose only the task it was in."""
    if getattr(Dependency.save_success, "durable", False):
        return
    save_success = Dependency.save_success

    def save_and_dump(self, task, result_hash=None):
        save_success(self, task, result_hash)
        self.backend.dump()

    save_and_dump.durable = True
    Dependency.save_success = save_and_dump


def guard(root: Path) -> None:
    """Lock, clean and make state durable, for every command that may run or change tasks."""
    root.mkdir(parents=True, exist_ok=True)  # doit keeps its state file there
    save_state_after_every_task()
    if doit_command(sys.argv) in READ_ONLY_COMMANDS:
        return
    hold_lock(root)
    for path in remove_stale_temporaries(root):
        print(f"sam3-aoti: removed {path}, left by an interrupted run", file=sys.stderr)
