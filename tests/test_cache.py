"""The binary cache against a real S3 server (`rclone serve s3` on 127.0.0.1) and a folder: signed records,
content-addressed blobs, and every way an entry is refused, with nothing half-written left behind."""

import base64
import hashlib
import json
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from sam3_aoti.errors import ConfigError
from sam3_aoti.runtime.binary_cache import Cache, Refused, blob_path, canonical, entry_path, pull
from sam3_aoti.runtime.signing import PublicKey, SecretKey, TrustError, signer, trusted_keys
from sam3_aoti.runtime.store import Store, StoreError


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


def test_a_blob_damaged_in_place_is_replaced_by_the_next_push_and_a_failed_write_leaves_nothing(tmp_path):
    """A folder store: the next push compares the blob's content, not its size, and puts a damaged one right; a
    write that fails midway leaves no .tmp beside the blobs."""
    from sam3_aoti.runtime.binary_cache import blob_path
    from sam3_aoti.runtime.store import StoreError

    url, key = str(tmp_path / "store"), SecretKey.generate("builder-a")
    files = outputs(tmp_path, package__a=b"A" * 1000)
    Cache(url, {}, key).push_entry("package", "k1", files, {})
    blob = tmp_path / "store" / blob_path(hashlib.sha256(b"A" * 1000).hexdigest())
    blob.write_bytes(b"X" * 1000)  # same size, other bytes
    Cache(url, {}, key).push_entry("package", "k1", files, {})
    assert blob.read_bytes() == b"A" * 1000
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
from sam3_aoti.runtime.binary_cache import Cache
from sam3_aoti.runtime.signing import SecretKey
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
])
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
