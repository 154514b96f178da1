"""The binary cache against a real S3 server (`rclone serve s3` on 127.0.0.1) and a folder: signed records,
content-addressed blobs, and every way an entry is refused, with nothing half-written left behind."""

import base64
import hashlib
import json
import os
import re
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from sam3_aoti.errors import ConfigError
from sam3_aoti.cache.binary_cache import Cache, Refused, blob_path, canonical, entry_path, pull
from sam3_aoti.cache.signing import PublicKey, SecretKey, TrustError, signer, trusted_keys
from sam3_aoti.cache.store import Store, StoreError


@pytest.fixture(params=[pytest.param("s3", marks=pytest.mark.slow), "file"])  # S3: a server process
def cache_url(request, tmp_path):
    """The same tests on a real S3 server and on a file:// folder."""
    if request.param == "s3":
        return request.getfixturevalue("s3_server").url("cache")
    return f"file://{tmp_path / 'cache-folder'}"


def get(url: str, rel: str) -> bytes:
    return Store(url).read(rel)


def put(url: str, rel: str, data: bytes | None) -> None:
    """What someone with write access to the store does to it (through the server, as any client would)."""
    store = Store(url)
    if data is None:
        store.fs.rm(f"{store.root}/{rel}")
    else:
        store.write(rel, data)


def outputs(tmp_path: Path, **files: bytes) -> dict[str, Path]:
    found = {}
    for rel, data in files.items():
        path = tmp_path / "built" / rel.replace("__", "/")
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data)
        found[rel.replace("__", "/")] = path
    return found


def leftovers(folder: Path) -> list[Path]:
    return [p for p in folder.rglob("*") if p.is_file()]


def test_keys_sign_and_verify_in_nix_forms():
    key = SecretKey.generate("builder-1.example.org")
    name, _, raw = key.text().partition(":")
    assert name == "builder-1.example.org" and len(base64.b64decode(raw)) == 64  # Nix: seed, then public key
    public = PublicKey.parse(str(key.public))
    signature = key.sign(b"entry")
    assert signer([signature], b"entry", {public.name: public}) == "builder-1.example.org"
    with pytest.raises(TrustError, match="does not match its content"):
        signer([signature], b"entry, altered", {public.name: public})
    with pytest.raises(TrustError, match="signed by builder-1.example.org, which is not a trusted key"):
        signer([signature], b"entry", {"other": PublicKey.parse(str(SecretKey.generate("other").public))})
    with pytest.raises(TrustError, match="unsigned"):
        signer([], b"entry", {public.name: public})
    with pytest.raises(TrustError, match="no key is trusted"):
        signer([signature], b"entry", {})


def test_a_key_file_made_by_nix_is_read(tmp_path):
    """nix-store --generate-binary-cache-key writes NAME:BASE64(64 bytes); a bare 32-byte seed works too."""
    key = SecretKey.generate("cache.example.org")
    for text in (key.text(), f"{key.name}:{base64.b64encode(key.seed).decode()}"):
        (tmp_path / "k").write_text(text + "\n")
        (tmp_path / "k").chmod(0o600)
        assert SecretKey.read(tmp_path / "k").public == key.public


def test_bad_keys_are_one_line_naming_the_fix(tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match="not NAME:BASE64 of an ed25519 key.*keygen"):
        PublicKey.parse("builder:bm90IGEga2V5")
    with pytest.raises(ConfigError, match="cannot be read.*SAM3_AOTI_SIGNING_KEY"):
        SecretKey.read(tmp_path / "missing")
    monkeypatch.setenv("SAM3_AOTI_TRUSTED_KEYS", "garbage")
    with pytest.raises(ConfigError, match="not NAME:BASE64"):
        trusted_keys()


def test_a_signing_key_others_can_read_is_refused_and_one_name_is_one_key(tmp_path, monkeypatch):
    """As ssh refuses a private key others may read; two trusted keys of one name are an error naming both,
    not a silent choice that then refuses the genuine builder's records."""
    key = SecretKey.generate("builder-a")
    (tmp_path / "k").write_text(key.text())
    for mode in (0o644, 0o640, 0o604):
        (tmp_path / "k").chmod(mode)
        with pytest.raises(ConfigError, match=f"readable by others \\(mode {mode:o}\\).*chmod 600"):
            SecretKey.read(tmp_path / "k")
    (tmp_path / "k").chmod(0o600)
    assert SecretKey.read(tmp_path / "k").public == key.public
    impostor = SecretKey.generate("builder-a").public
    monkeypatch.setenv("SAM3_AOTI_TRUSTED_KEYS", str(impostor))
    with pytest.raises(ConfigError, match="two trusted keys are named builder-a") as found:
        trusted_keys([str(key.public)])
    assert str(key.public) in str(found.value) and str(impostor) in str(found.value)
    monkeypatch.delenv("SAM3_AOTI_TRUSTED_KEYS")
    assert trusted_keys([str(key.public), str(key.public)]) == {"builder-a": key.public}  # the same key twice: fine


def test_an_entry_round_trips_and_names_what_it_answers_for(cache_url, tmp_path):
    url = cache_url
    key = SecretKey.generate("builder-a")
    trusted = {"builder-a": key.public}
    files = outputs(tmp_path, package__a=b"A" * 1000, package__b=b"B" * 10)
    Cache(url, trusted, key).push_entry("package", "k1", files, {"verified": True})
    assert Cache(url, trusted).entry("package", "k2") is None
    record, signed_by = Cache(url, trusted).entry("package", "k1")
    assert signed_by == "builder-a" and set(record["outputs"]) == {"package/a", "package/b"}
    dest = tmp_path / "variant"
    Cache(url, trusted).fetch(record, dest, ["package/a", "package/b"])
    assert (dest / "package/a").read_bytes() == b"A" * 1000 and not [p for p in dest.iterdir() if p.name.startswith(".")]
    # an entry copied under another key is refused: the signature covers the key it answers for
    put(url, entry_path("package", "k3"), get(url, entry_path("package", "k1")))
    with pytest.raises(Refused, match="signed for key 'k1', not 'k3'"):
        Cache(url, trusted).entry("package", "k3")


def test_a_blob_damaged_in_place_is_replaced_by_the_next_push_and_a_failed_write_leaves_nothing(cache_url, tmp_path):
    """The next push compares the blob's content, not its size (a folder store's blob re-hashed, an S3 object by
    the sha256 in its metadata), and puts a damaged one right; a write that fails midway leaves no .tmp beside
    the blobs."""
    from sam3_aoti.cache.binary_cache import blob_path
    from sam3_aoti.cache.store import StoreError

    url, key = cache_url, SecretKey.generate("builder-a")
    files = outputs(tmp_path, package__a=b"A" * 1000)
    Cache(url, {}, key).push_entry("package", "k1", files, {})
    blob = blob_path(hashlib.sha256(b"A" * 1000).hexdigest())
    put(url, blob, b"X" * 1000)  # same size, other bytes
    Cache(url, {}, key).push_entry("package", "k1", files, {})
    assert get(url, blob) == b"A" * 1000
    if not url.startswith("file://"):
        return
    url = str(tmp_path / "store")
    store = Store(url)
    with pytest.raises(StoreError, match="cannot upload"):
        store._put("blobs/x", "upload", lambda path: (Path(path).write_bytes(b"half"), 1 / 0))
    assert not [p for p in (tmp_path / "store").rglob("*.tmp")]


@pytest.mark.parametrize("how, why", [
    ("unsigned", "it is unsigned"),
    ("untrusted", "signed by mallory, which is not a trusted key"),
    ("altered", "its signature by builder-a does not match its content"),
    ("outside", "names outputs that are not relative paths"),
])
def test_entries_no_trusted_key_vouches_for_are_refused(cache_url, tmp_path, how, why):
    url = cache_url
    key, mallory = SecretKey.generate("builder-a"), SecretKey.generate("mallory")
    Cache(url, {}, mallory if how == "untrusted" else key).push_entry("package", "k", outputs(tmp_path, a=b"x"), {})
    record = json.loads(get(url, entry_path("package", "k")))
    if how == "unsigned":
        record["signatures"] = []
    elif how == "altered":
        record["info"] = {"verified": True}
    elif how == "outside":
        record["outputs"] = {"../../etc/x": record["outputs"]["a"]}
        record["signatures"] = [key.sign(canonical(record))]
    put(url, entry_path("package", "k"), json.dumps(record).encode())
    with pytest.raises(Refused, match=why):
        Cache(url, {"builder-a": key.public}).entry("package", "k")


@pytest.mark.parametrize("damage, why", [
    ("altered", "does not match its sha256"),
    ("truncated", "has 500 bytes, its record names 1000"),
    ("missing", "missing"),
])
def test_a_blob_that_is_not_what_the_record_names_is_refused_and_nothing_is_left(cache_url, tmp_path, damage, why):
    url = cache_url
    key = SecretKey.generate("builder-a")
    data = bytes(range(250)) * 4
    Cache(url, {}, key).push_entry("verify", "k", outputs(tmp_path, verify__report=data, verify__other=b"ok"), {})
    blob = blob_path(hashlib.sha256(data).hexdigest())
    put(url, blob, {"altered": data[::-1], "truncated": data[:500], "missing": None}[damage])
    cache = Cache(url, {"builder-a": key.public})
    record, _ = cache.entry("verify", "k")
    dest = tmp_path / "variant"
    (dest / "verify").mkdir(parents=True)
    (dest / "verify" / "report").write_bytes(b"what was here before")
    with pytest.raises(Refused, match=why):
        cache.fetch(record, dest, ["verify/report", "verify/other"])
    assert (dest / "verify" / "report").read_bytes() == b"what was here before"  # no output half replaced
    assert leftovers(dest) == [dest / "verify" / "report"]


def test_a_blob_of_many_blocks_comes_back_whole(cache_url, tmp_path):
    """Read in ranges (S3-compatible stores fail botocore's whole-object checksum on each range: it is off)."""
    key = SecretKey.generate("builder-a")
    data = os.urandom(20 << 20)
    Cache(cache_url, {}, key).push_entry("package", "k", outputs(tmp_path, package__big=data), {})
    cache = Cache(cache_url, {"builder-a": key.public})
    cache.fetch(cache.entry("package", "k")[0], tmp_path / "variant", ["package/big"])
    assert (tmp_path / "variant" / "package" / "big").read_bytes() == data


def test_the_server_stopped_mid_download_is_one_line_and_leaves_nothing(s3_server, tmp_path):
    store = Store(s3_server.url("cache"))
    big = tmp_path / "big"
    big.write_bytes(os.urandom(40 << 20))  # five blocks of the download
    store.upload(big, "blobs/big")
    digest = hashlib.sha256(big.read_bytes()).hexdigest()

    def stop_server(got, size):
        s3_server.stop()

    dest = tmp_path / "dest" / "big"
    with pytest.raises(StoreError, match="cannot download blobs/big"):
        store.download("blobs/big", dest, digest, big.stat().st_size, progress=stop_server)
    assert leftovers(tmp_path / "dest") == []


def test_an_unreachable_cache_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("AWS_ENDPOINT_URL", "http://127.0.0.1:9")  # nothing listens on the discard port
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "x")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "y")
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    with pytest.raises(StoreError, match=r"cache s3://b/c: cannot read entries/package/k.json"):
        Cache("s3://b/c", {}).entry("package", "k")


def test_https_caches_are_read_only():
    with pytest.raises(ConfigError, match="read-only"):
        Cache("https://127.0.0.1:9/cache", {}, SecretKey.generate("a")).push_entry("package", "k", {}, {})


PUSHER = """
import sys
from pathlib import Path
from sam3_aoti.cache.binary_cache import Cache
from sam3_aoti.cache.signing import SecretKey
files = {f"render/{i}.png": Path(sys.argv[3]) / f"{i}.png" for i in range(20)}
for _ in range(5):
    Cache(sys.argv[1], {}, SecretKey.read(sys.argv[2])).push_entry("render", "same-key", files, {"by": sys.argv[4]})
"""


def test_two_builders_pushing_one_key_at_once_leave_a_whole_valid_entry(cache_url, tmp_path):
    url = cache_url
    key = SecretKey.generate("builder-a")
    (tmp_path / "k").write_text(key.text())
    (tmp_path / "k").chmod(0o600)
    source = tmp_path / "files"
    source.mkdir()
    for i in range(20):
        (source / f"{i}.png").write_bytes(bytes([i]) * (100_000 + i))
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent / "src")}
    pushers = [subprocess.Popen([sys.executable, "-c", PUSHER, url, str(tmp_path / "k"), str(source), name], env=env,
                                stderr=subprocess.PIPE, text=True) for name in ("one", "two")]
    for p in pushers:
        assert p.wait(timeout=300) == 0, p.stderr.read()
    cache = Cache(url, {"builder-a": key.public})
    record, _ = cache.entry("render", "same-key")
    assert record["info"]["by"] in ("one", "two")
    dest = tmp_path / "variant"
    cache.fetch(record, dest, ["render"])
    assert sorted(p.name for p in (dest / "render").iterdir()) == sorted(f"{i}.png" for i in range(20))
    if url.startswith("file://"):  # no temporary left in a folder cache
        assert not [p for p in Path(url.removeprefix("file://")).rglob("*") if p.name.endswith(".tmp")]


def test_pull_takes_only_a_verified_ref_a_trusted_key_signed(cache_url, tmp_path):
    url = cache_url
    key = SecretKey.generate("builder-a")
    package = b"PK fake package"
    digest = hashlib.sha256(package).hexdigest()
    files = outputs(tmp_path, **{"sam3.pt2": package, "sam3.pt2.sha256": f"{digest}  sam3.pt2\n".encode(),
                                 "report.json": b"{}"})
    cache = Cache(url, {}, key)
    cache.push_ref("tiny-fp32-cpu@cpu-x86_64", files, {"verified": True})
    cache.push_ref("unverified", files, {"verified": False})
    dest = tmp_path / "node"
    origin = pull(url, "tiny-fp32-cpu@cpu-x86_64", dest, {"builder-a": key.public})
    assert origin["signed_by"] == "builder-a" and (dest / "sam3.pt2").read_bytes() == package
    assert json.loads((dest / "origin.json").read_text())["ref"] == "tiny-fp32-cpu@cpu-x86_64"
    with pytest.raises(Refused, match="did not pass verify"):
        pull(url, "unverified", tmp_path / "other", {"builder-a": key.public})
    with pytest.raises(Refused, match="no ref 'nope'"):
        pull(url, "nope", tmp_path / "other", {"builder-a": key.public})
    with pytest.raises(Refused, match="not a trusted key"):
        pull(url, "tiny-fp32-cpu@cpu-x86_64", tmp_path / "other", {"x": SecretKey.generate("x").public})
    assert not (tmp_path / "other").exists() or leftovers(tmp_path / "other") == []


@pytest.mark.parametrize("ref, dest, words", [
    ("ok-ref", "a-file", "is a file: pull into a folder"),
    ("ok-ref", "/proc/sam3-aoti-pull", "cannot make /proc/sam3-aoti-pull"),
    ("a/b", "dest", "ref 'a/b': use up to 128 letters"),
    ("x..y", "dest", "no slash, space or `..`"),
    ("has space", "dest", "ref 'has space'"),
    ("r" * 300, "dest", "(300 characters)"),
], ids=lambda value: value[:20])
def test_pull_refuses_a_bad_destination_or_ref_name_before_reading_the_cache(tmp_path, ref, dest, words):
    """Exit 2, one line, before the cache is opened (this one does not exist), and a user's files stay."""
    (tmp_path / "a-file").write_text("mine")
    proc = subprocess.run([sys.executable, "-m", "sam3_aoti", "pull", str(tmp_path / "no-cache"), ref, dest],
                          cwd=tmp_path, capture_output=True, text=True,
                          env={**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent / "src")})
    assert proc.returncode == 2 and words in proc.stderr, proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1 and (tmp_path / "a-file").read_text() == "mine"


def test_the_cli_makes_keys_and_pulls_with_one_line_errors(tmp_path):
    cli = [sys.executable, "-m", "sam3_aoti"]
    made = subprocess.run([*cli, "cache", "keygen", "builder-a", "--out", str(tmp_path / "a.key")],
                          capture_output=True, text=True)
    assert made.returncode == 0, made.stderr
    public = PublicKey.parse(made.stdout.strip())
    assert SecretKey.read(tmp_path / "a.key").public == public
    assert (tmp_path / "a.key").stat().st_mode & 0o077 == 0
    again = subprocess.run([*cli, "cache", "keygen", "builder-a", "--out", str(tmp_path / "a.key")],
                           capture_output=True, text=True)
    assert again.returncode == 2 and "never overwritten" in again.stderr and len(again.stderr.splitlines()) == 1
    refused = subprocess.run([*cli, "pull", f"file://{tmp_path}/none", "r", str(tmp_path / "d"),
                              "--trusted-key", str(public)], capture_output=True, text=True)
    assert refused.returncode == 1 and refused.stderr.startswith("sam3-aoti: ") and len(refused.stderr.splitlines()) == 1


def signed_ref_files(tmp_path: Path, package: bytes = b"PK fake package") -> dict[str, Path]:
    digest = hashlib.sha256(package).hexdigest()
    return outputs(tmp_path, **{"sam3.pt2": package, "sam3.pt2.sha256": f"{digest}  sam3.pt2\n".encode(),
                                "report.json": b"{}"})


@pytest.mark.parametrize("record, why", [
    (b"{not json", "is not a sam3-aoti-entry/1 record"),
    # a short id: the test's id is in PYTEST_CURRENT_TEST, and 400 kB there is past what one variable may hold
    # when the S3 server starts ("Argument list too long")
    pytest.param(b"[" * 200_000 + b"]" * 200_000, "is not a sam3-aoti-entry/1 record", id="nested-200000-deep"),
    ({"signatures": 5}, "field `signatures` is not a list"),
    ({"signatures": [5]}, "signatures are not strings"),
    ({"outputs": [1]}, "field `outputs` is not an object"),
    ({"info": "x"}, "field `info` is not an object"),
    ({"stage": ["package"]}, "field `stage` is not a string"),
])
def test_a_record_of_the_wrong_shape_is_refused_with_one_line(cache_url, tmp_path, record, why):
    """Anyone who can write to the store, with no key, can write a record: its shape is checked before use."""
    key = SecretKey.generate("builder-a")
    cache = Cache(cache_url, {"builder-a": key.public}, key)
    cache.push_entry("package", "k", outputs(tmp_path, **{"package__a": b"a"}), {})
    if isinstance(record, dict):
        record = json.dumps({**json.loads(get(cache_url, entry_path("package", "k"))), **record}).encode()
    put(cache_url, entry_path("package", "k"), record)
    with pytest.raises(Refused, match=re.escape(why)):
        cache.entry("package", "k")


def alarm(seconds: int):
    """Fail a test that hangs (a FIFO read blocks forever) instead of hanging the run."""
    import signal

    def hung(*_):
        raise AssertionError(f"hung for {seconds} s")
    signal.signal(signal.SIGALRM, hung)
    signal.alarm(seconds)


def test_a_fifo_in_a_folder_store_is_refused_not_read(tmp_path):
    """A FIFO as a record or as a blob of a folder cache: one line, no hang; a push replaces the blob."""
    key = SecretKey.generate("builder-a")
    url = f"file://{tmp_path / 'store'}"
    cache = Cache(url, {"builder-a": key.public}, key)
    files = outputs(tmp_path, **{"package__a": b"a" * 10})
    record = cache.push_entry("package", "k", files, {})
    blob = tmp_path / "store" / blob_path(record["outputs"]["package/a"]["sha256"])
    blob.unlink()
    os.mkfifo(blob)
    alarm(30)
    try:
        with pytest.raises(Refused, match="is not a regular file: refused"):
            cache.fetch(cache.entry("package", "k")[0], tmp_path / "variant", ["package"])
        cache.push_entry("package", "k", files, {})  # the FIFO is no blob: replaced
        assert blob.is_file() and blob.read_bytes() == b"a" * 10
        (tmp_path / "store" / entry_path("package", "k")).unlink()
        os.mkfifo(tmp_path / "store" / entry_path("package", "k"))
        with pytest.raises(StoreError, match="is not a regular file: refused"):
            cache.entry("package", "k")
    finally:
        signal_off()


def signal_off():
    import signal

    signal.alarm(0)


class Answering:
    """A real HTTP server on 127.0.0.1 answering every request with one status (a cache's https gateway that
    denies or fails), for at most `seconds`."""

    def __init__(self, status: int):
        import http.server

        class Handler(http.server.BaseHTTPRequestHandler):
            def do_GET(self):
                self.send_response(status)
                self.send_header("Content-Length", "2")
                self.end_headers()
                self.wfile.write(b"{}")

            do_HEAD = do_GET

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.timeout = 5
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/cache"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()


@pytest.mark.parametrize("status, words", [(403, "the server answered 403 Forbidden"),
                                           (500, "the server answered 500 Internal Server Error"),
                                           (404, "has no ref 'r'")])
def test_an_https_cache_that_refuses_or_fails_is_named_so(tmp_path, status, words):
    with Answering(status) as server:
        with pytest.raises((Refused, StoreError), match=re.escape(words)):
            pull(server.url, "r", tmp_path / "node", {})


def test_a_missing_folder_bucket_or_closed_port_is_named_so(tmp_path, s3_server):
    with pytest.raises(StoreError, match=r"the folder .*/nowhere does not exist: make it"):
        pull(f"file://{tmp_path / 'nowhere'}", "r", tmp_path / "node", {})
    with pytest.raises(StoreError, match="the bucket no-such-bucket does not exist: make it"):
        pull("s3://no-such-bucket/cache", "r", tmp_path / "node", {})
    with pytest.raises(StoreError, match="the bucket no-such-bucket does not exist"):
        Cache("s3://no-such-bucket/cache", {}, SecretKey.generate("a")).push_entry(
            "package", "k", outputs(tmp_path, **{"package__a": b"a"}), {})
    with pytest.raises(StoreError, match=r"Cannot connect to host 127.0.0.1:9"):
        pull("http://127.0.0.1:9/cache", "r", tmp_path / "node", {})


PUSH_LIMITED = """
import resource, signal, sys
from pathlib import Path
from sam3_aoti.cache.binary_cache import Cache
from sam3_aoti.cache.signing import SecretKey
from sam3_aoti.errors import Sam3AotiError
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # past the limit a write fails with EFBIG, as on a full disk (ENOSPC)
resource.setrlimit(resource.RLIMIT_FSIZE, (1 << 20, 1 << 20))
try:
    Cache(sys.argv[1], {}, SecretKey.generate("a")).push_entry("package", "k", {"package/big": Path(sys.argv[2])}, {})
except Sam3AotiError as e:
    print(e)
    sys.exit(1)
"""


def test_a_push_onto_a_full_disk_is_one_line_and_leaves_no_temporary(tmp_path):
    """The store's disk fills up mid-upload (a file-size limit: the same failed write without a device to
    fill): one line naming it, no temporary left in the store."""
    big = tmp_path / "big"
    big.write_bytes(os.urandom(4 << 20))
    store = tmp_path / "store"
    proc = subprocess.run([sys.executable, "-c", PUSH_LIMITED, f"file://{store}", str(big)], capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent / "src")})
    assert proc.returncode == 1 and "cannot upload blobs/sha256/" in proc.stdout and "File too large" in proc.stdout
    assert "Traceback" not in proc.stderr and leftovers(store) == []


def test_a_push_to_a_store_it_cannot_write_is_one_line(tmp_path):
    """A folder store where a file stands in the way (what a read-only folder is even to root), and, for a user
    other than root, a folder without write permission: one line naming the blob, no traceback."""
    files = outputs(tmp_path, **{"package__a": b"a"})
    blocked = tmp_path / "store"
    blocked.mkdir()
    (blocked / "blobs").write_text("a file where the store's folder goes")
    with pytest.raises(StoreError, match=r"cannot (look up|upload) blobs/sha256/\w+/\w+ \(NotADirectoryError"):
        Cache(f"file://{blocked}", {}, SecretKey.generate("a")).push_entry("package", "k", files, {})
    if os.geteuid() != 0:
        (tmp_path / "read-only").mkdir(mode=0o555)
        with pytest.raises(StoreError, match=r"cannot upload blobs/sha256/.*Permission denied"):
            Cache(f"file://{tmp_path / 'read-only'}", {}, SecretKey.generate("a")).push_entry("package", "k", files, {})


KILLED = """
import sys, time
from pathlib import Path
from sam3_aoti.cache.binary_cache import Cache, pull
from sam3_aoti.cache.signing import PublicKey, SecretKey
if sys.argv[1] == "push":
    Cache(sys.argv[2], {}, SecretKey.generate("a")).push_entry("package", "k", {"package/big": Path(sys.argv[3])}, {})
else:
    key = PublicKey.parse(sys.argv[3])
    pull(sys.argv[2], "r", Path(sys.argv[4]), {key.name: key})
"""


def kill_when(proc: subprocess.Popen, appeared) -> None:
    """SIGKILL `proc` as soon as `appeared()` is true (at most 60 s)."""
    import time

    deadline = time.monotonic() + 60
    while not appeared():
        assert proc.poll() is None and time.monotonic() < deadline, "the process ended before it was killed"
        time.sleep(0.005)
    proc.kill()
    proc.wait()


def test_a_killed_push_or_pull_leaves_nothing_after_the_next_one(tmp_path):
    """SIGKILL mid-upload leaves a temporary blob in a folder store: the next push removes it. SIGKILL mid-pull
    leaves its staging in DEST: the next pull removes it, and a user's own file in DEST stays."""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent / "src")}
    big = tmp_path / "big"
    big.write_bytes(os.urandom(256 << 20))
    url = f"file://{tmp_path / 'store'}"
    pusher = subprocess.Popen([sys.executable, "-c", KILLED, "push", url, str(big)], env=env)
    kill_when(pusher, lambda: any(p.name.endswith(".tmp") for p in (tmp_path / "store").rglob("*")))
    assert [p for p in leftovers(tmp_path / "store") if p.name.endswith(".tmp")]
    key = SecretKey.generate("builder-a")
    Cache(url, {}, key).push_ref("r", {**signed_ref_files(tmp_path, big.read_bytes())}, {"verified": True})
    assert [p for p in leftovers(tmp_path / "store") if p.name.endswith(".tmp")] == []

    dest = tmp_path / "node"
    dest.mkdir()
    (dest / "notes.txt").write_text("mine")
    puller = subprocess.Popen([sys.executable, "-c", KILLED, "pull", url, str(key.public), str(dest)], env=env)
    kill_when(puller, lambda: any(p.name.endswith(".part") for p in dest.rglob("*")))
    assert list(dest.glob(".substitute.*"))
    pull(url, "r", dest, {"builder-a": key.public})
    assert not list(dest.glob(".substitute.*")) and (dest / "notes.txt").read_text() == "mine"
    assert (dest / "sam3.pt2").stat().st_size == big.stat().st_size


def test_an_older_signed_ref_put_back_is_refused_unless_asked_for(cache_url, tmp_path):
    """Rollback: the node remembers the newest ref it pulled per cache and name; a validly signed older one put
    back in the store is refused (one line), `allow_older` takes it on purpose."""
    key = SecretKey.generate("builder-a")
    cache, trusted = Cache(cache_url, {}, key), {"builder-a": key.public}
    cache.push_ref("r", signed_ref_files(tmp_path / "v1", b"PK version 1"), {"verified": True})
    old_record = get(cache_url, "refs/r.json")
    pull(cache_url, "r", tmp_path / "node", trusted)
    cache.push_ref("r", signed_ref_files(tmp_path / "v2", b"PK version 2"), {"verified": True})
    pull(cache_url, "r", tmp_path / "node", trusted)
    put(cache_url, "refs/r.json", old_record)
    with pytest.raises(Refused, match="before the one this node pulled already .* pass --allow-older"):
        pull(cache_url, "r", tmp_path / "node", trusted)
    assert (tmp_path / "node" / "sam3.pt2").read_bytes() == b"PK version 2"
    pull(cache_url, "r", tmp_path / "node", trusted, allow_older=True)
    assert (tmp_path / "node" / "sam3.pt2").read_bytes() == b"PK version 1"
    assert "issued" in json.loads((tmp_path / "node" / "origin.json").read_text())


def test_a_build_pushes_every_stage_a_cache_holds_by_default():
    """pipeline.toml's `[cache] push` names every stage the cache holds, the parts' compile too: a builder that
    pushes as it builds leaves its fleet nothing to compile."""
    from sam3_aoti.pipeline.settings import load_settings
    from tasks import cache

    assert "compile_parts" in cache.CACHED
    assert set(load_settings(device="cpu").stage("cache")["push"]) == set(cache.CACHED)
