"""One doit run per variant at a time, no leftovers of dead runs, doit's state saved after every task, and
no traceback on the terminal: Ctrl-C, a closed pipe, a damaged state file or an unwritable folder end in
one line.

doit saves which tasks succeeded only when a run ends, so a SIGKILL during compile would make the next run
redo export too; and two runs on one checkout would interleave their writes.
"""

from __future__ import annotations

import fcntl
import functools
import json
import os
import re
import shutil
import signal
import sys
import time
from pathlib import Path

from doit.dependency import Dependency, MD5Checker, get_file_md5

# doit commands that only read: they take no lock and clean nothing.
READ_ONLY_COMMANDS = {"list", "help", "info", "dumpdb", "tabcompletion"}
# atomic_output's temporaries: ".<target name>.<8 characters of mkdtemp>", beside the target
TEMPORARY = re.compile(r"^\..+\.[a-z0-9_]{8}$")
_held = []  # the open lock file, for the life of the process
RUNNING: list = []  # (stage, Popen) of the stage processes doit waits for (the probe runs beside compile)


def doit_command(argv: list[str]) -> str:
    """The doit command of this process ("run" when only tasks and variables are given)."""
    from doit.doit_cmd import DoitMain

    commands = {c.get_name() for c in DoitMain.DOIT_CMDS}
    words = [a for a in argv[1:] if not a.startswith("-") and "=" not in a]
    return words[0] if words and words[0] in commands else "run"


def hold_lock(root: Path) -> None:
    """Take `root/.lock` for this process, or stop with one line naming the process that holds it. Whatever a
    killed run's stages left running (their process groups, which the lock file lists) is killed first: the
    lock covers a run's stages and their workers, not only doit."""
    handle = open(root / ".lock", "a+")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = (handle.read().strip().splitlines() or ["another process"])[0]
        sys.exit(f"sam3-aoti: doit ({holder}) is already building {root}: wait for it to finish, or stop it")
    handle.seek(0)
    for line in handle.read().splitlines():
        words = line.split()
        if len(words) == 2 and words[0] == "stage-group" and words[1].isdigit():
            kill_group(int(words[1]), root)
    handle.seek(0)
    handle.truncate()
    handle.write(f"pid {os.getpid()}\n")
    handle.flush()
    _held.append(handle)


def record_stage_group(pgid: int) -> None:
    """A stage's process group, in the lock file while the stage runs: a next run kills what is left of it."""
    if _held:
        _held[0].write(f"stage-group {pgid}\n")
        _held[0].flush()


def kill_group(pgid: int, root: Path | None = None, wait_s: float = 10.0) -> None:
    """SIGKILL what is left of a stage's process group (its compile workers, their compilers) and wait until it
    is gone. With `root`, only a group whose processes are this variant's stages (their environment names its
    Inductor cache): a pid reused since is someone else's."""
    if root is not None and not any(_is_stage_of(pid, root) for pid in _members(pgid)):
        return
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        return
    deadline = time.monotonic() + wait_s
    while _members(pgid) and time.monotonic() < deadline:
        time.sleep(0.05)


def _members(pgid: int) -> list[int]:
    """The live processes of a process group (Linux /proc; zombies are gone already)."""
    found = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                fields = Path(entry.path, "stat").read_text().rsplit(")", 1)[1].split()
            except (OSError, IndexError):
                continue
            if fields[2] == str(pgid) and fields[0] != "Z":
                found.append(int(entry.name))
    return found


def _is_stage_of(pid: int, root: Path) -> bool:
    try:
        return str(root.resolve()).encode() in Path(f"/proc/{pid}/environ").read_bytes()
    except OSError:
        return False


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


@functools.lru_cache(maxsize=1)
def may_write_now() -> bool:
    """Whether this doit command may run or change tasks (not `list`, `info`, ...)."""
    return doit_command(sys.argv) not in READ_ONLY_COMMANDS


BUILD_NICE = 10  # how far a build's stages step back for the machine's other work ($SAM3_AOTI_NICE; 0: not at all)
# The stages whose work only verify waits for step back further, so that on a machine of few cores the package's
# own path (the exports and compiles) takes the cores first.
BESIDE = ("reference", "fallback", "fallback_drift")
BESIDE_NICE = 5
# Each stage has a session of its own, and Linux's autogroup shares the CPU between sessions by their own nice:
# five stages at nice 10 weighed five times what one terminal at nice 10 does, and a quick loop beside a tiny
# build took 63 s against 42 alone. A stage's session steps back 6 more (1.25^-6, about a quarter of the weight):
# the four or five stages a build runs at once then weigh about what one session at the build's nice does.
SESSION_EXTRA_NICE = 6


def stage_nice() -> int:
    """$SAM3_AOTI_NICE, else BUILD_NICE: read here, in doit, so a bad value is one line, not a failed fork."""
    from sam3_aoti.errors import ConfigError

    value = os.environ.get("SAM3_AOTI_NICE", str(BUILD_NICE))
    try:
        return max(0, min(19, int(value)))
    except ValueError:
        raise ConfigError(f"SAM3_AOTI_NICE={value!r} is not a whole number: set 0 to 19 (how far a build's "
                          "stages step back for other work), or unset it") from None


def nice_of(stage: str) -> int:
    """A stage's nice value: the build's (`stage_nice`), and for a stage only verify waits for, more."""
    return min(19, stage_nice() + (BESIDE_NICE if stage in BESIDE else 0))


def stage_preexec(nice: int):
    """What a stage process does before it runs: `die_with_parent`, then `step_back(nice)`."""
    def preexec() -> None:
        die_with_parent()
        step_back(nice)
    return preexec


def step_back(nice: int) -> None:
    """Lower this process's priority by `nice`, and its session's further where Linux groups CPU time by session
    (autogroup: a stage has a session of its own, which would otherwise weigh as much as a whole terminal;
    `SESSION_EXTRA_NICE`).
    A build's compiles then take the cores when nothing else wants them: a test run or an editor beside a build
    keeps its speed, and the build's CPU time counts as `nice` in /proc/stat (what `-n auto` reads as idle)."""
    if nice <= 0:
        return
    try:
        os.nice(nice)
    except OSError:
        pass
    try:
        with open("/proc/self/autogroup", "w") as autogroup:
            autogroup.write(str(min(19, nice + SESSION_EXTRA_NICE)))
    except OSError:  # no autogroup (another kernel, or turned off): the process's own nice is all there is
        pass


def die_with_parent() -> None:
    """In a stage process, before it runs: die when doit does (Linux's PR_SET_PDEATHSIG), so that a doit killed
    by SIGKILL leaves no stage writing on behind the next run's back."""
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGKILL)
    except (OSError, AttributeError):
        pass


def low_disk(root: Path, below: int = 1 << 30) -> str:
    """`: the disk of ROOT has X free` when a failed stage may have filled it, else ""."""
    try:
        free = shutil.disk_usage(root).free
    except OSError:
        return ""
    return f": the disk of {root} has {free / 2**30:.2f} GB free, it may have filled up: free some space" \
        if free < below else ""


def interrupted(signum, frame) -> None:
    """Ctrl-C: the running stage gets it (and cleans up), then one line and exit code 130. Stages that finished
    are saved already (`save_state_after_every_task`)."""
    during = ""
    for stage, proc in list(RUNNING):
        during = f" during {stage}"
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=120)
        except Exception:
            proc.kill()
        kill_group(proc.pid)  # and whatever of it is left: its workers, their compilers
    sys.stderr.write(f"sam3-aoti: interrupted{during}; finished stages are kept: `uv run doit` goes on from there\n")
    sys.stderr.flush()
    os._exit(130)


def check_state_file(path: Path, may_write: bool) -> None:
    """doit's own state (.doit.json): a damaged one would stop doit with a traceback. A run sets it aside and
    starts afresh (every stage is checked again); a read-only command says what to do."""
    if not path.exists():
        return
    try:
        json.loads(path.read_text() or "{}")
        return
    except (ValueError, UnicodeDecodeError, OSError):
        pass
    if not may_write:
        sys.exit(f"sam3-aoti: {path} (doit's state) is damaged: run `uv run doit` to set it aside and rebuild")
    aside = path.with_name(f"{path.name}.damaged-{time.strftime('%Y%m%d-%H%M%S')}")
    os.replace(path, aside)
    print(f"sam3-aoti: {path} (doit's state) was damaged: set aside as {aside.name}; stages are checked again",
          file=sys.stderr)


def guard(root: Path) -> None:
    """Lock, clean and make state durable, for every command that may run or change tasks; one line, never a
    traceback, for what would stop doit on the way."""
    signal.signal(signal.SIGINT, interrupted)
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)  # output piped into a program that closes early: quiet
    may_write = may_write_now()
    try:
        root.mkdir(parents=True, exist_ok=True)  # doit keeps its state file there
        save_state_after_every_task()
        check_state_file(root / ".doit.json", may_write)
        if not may_write:
            return
        hold_lock(root)
        for path in remove_stale_temporaries(root):
            print(f"sam3-aoti: removed {path}, left by an interrupted run", file=sys.stderr)
    except OSError as e:
        sys.exit(f"sam3-aoti: cannot write {e.filename or root} ({e.strerror}): make it writable, or build "
                 "elsewhere (artifacts/ is under the checkout)")


class RecordedChecksums(MD5Checker):
    """doit's own check (a file whose mtime moved is compared by content), but a file the variant's manifest
    recorded, unchanged since (size, mtime and ctime as recorded), is identified by the sha256 its stage
    computed while writing it, not hashed again with md5 at every task boundary: on the H200 that was about
    45 s of a fresh full-size build (the 3.4 GB checkpoint, the 1.7 GB package and fallback, per task)."""

    manifest: Path | None = None  # the variant's manifest (set by tasks)
    _recorded: tuple = (None, {})

    def recorded(self) -> dict:
        """abs path -> (bytes, mtime_ns, ctime_ns, sha256) of every output in the manifest, read once per change."""
        try:
            stamp = self.manifest.stat().st_mtime_ns
        except (OSError, AttributeError):
            return {}
        if self._recorded[0] != stamp:
            from sam3_aoti.pipeline.artifacts import recorded_files

            RecordedChecksums._recorded = (stamp, recorded_files(self.manifest))
        return self._recorded[1]

    def checksum(self, path: str, stat: os.stat_result) -> str:
        recorded = self.recorded().get(str(Path(path).absolute()))
        if recorded and recorded[:3] == (stat.st_size, stat.st_mtime_ns, stat.st_ctime_ns):
            return f"sha256:{recorded[3]}"
        return get_file_md5(path)

    def check_modified(self, file_path, file_stat, state):
        timestamp, size, checksum = state
        if file_stat.st_mtime == timestamp:
            return False
        if file_stat.st_size != size:
            return True
        if checksum.startswith("sha256:"):  # compared in the kind it was saved in (a copied file's ctime moved)
            recorded = self.checksum(file_path, file_stat)
            if not recorded.startswith("sha256:"):
                from sam3_aoti.runtime.files import sha256

                recorded = f"sha256:{sha256(file_path)}"
            return checksum != recorded
        return checksum != get_file_md5(file_path)

    def get_state(self, dep, current_state):
        stat = os.stat(dep)
        if current_state and current_state[0] == stat.st_mtime:
            return None
        return stat.st_mtime, stat.st_size, self.checksum(dep, stat)
