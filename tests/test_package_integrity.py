"""A package is native code: nothing from an archive is trusted because the archive says so, and a load that
fails or is killed leaves nothing behind."""

import hashlib
import json
import os
import re
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
from PIL import Image

from sam3_aoti.errors import PackageError
from sam3_aoti.runtime import integrity
from sam3_aoti.runtime.info import archive_info
from sam3_aoti.runtime.integrity import digest_file
from sam3_aoti.runtime.loader import load_package
from sam3_aoti.runtime.scratch import process_folder

from helpers import REPO, TINY_MODELS, predict, rewrite_package


def copy_package(package_path, folder, edit=lambda name, data: data, digests=True, resign=False):
    """The package and its fallback in `folder`, entries edited by `edit`; with `digests`, the digest files
    the build wrote beside them too (which then no longer match an edit)."""
    target = rewrite_package(package_path, folder / "sam3.pt2", edit, resign)
    if digests:
        shutil.copy(digest_file(package_path), digest_file(target))
    return target


def swap_so(name, data):
    return data[:-64] + bytes(64) if name.endswith(".wrapper.so") and "/transforms/" in name else data


def extraction_folders():
    return {p for p in os.scandir("/tmp") if len(p.name) == 6 and p.is_dir()}


def test_a_tampered_package_is_refused_before_its_code_loads(package_path, tmp_path):
    tampered = copy_package(package_path, tmp_path, swap_so)
    with pytest.raises(PackageError, match="does not match its digest sam3.pt2.sha256"):
        load_package(tampered)
    digest_file(tampered).unlink()  # travelling alone: refused, unless trusted
    with pytest.raises(PackageError, match="has no digest beside it .* a digest inside it proves nothing"):
        load_package(tampered)
    with pytest.raises(PackageError, match="transforms/.*wrapper.so does not match its recorded digest"):
        load_package(tampered, trust=True)  # trust admits a package without a digest, never a damaged one
    proc = subprocess.run([sys.executable, "-m", "sam3_aoti", "info", str(tampered)], capture_output=True,
                          text=True, env={**os.environ, "PYTHONPATH": str(REPO / "src")})
    assert proc.returncode == 2 and "has no digest beside it" in proc.stderr
    assert len(proc.stderr.strip().splitlines()) == 1


def test_a_package_that_vouches_for_itself_is_not_trusted(package_path, tmp_path):
    """A swapped .so with the metadata's part digests recomputed (what a crafted package does): only a digest
    from outside the archive, or --trust, lets it load."""
    crafted = copy_package(package_path, tmp_path, swap_so, digests=False, resign=True)
    with pytest.raises(PackageError, match="has no digest beside it"):
        load_package(crafted)
    Image.new("RGB", (30, 20)).save(tmp_path / "x.png")
    proc = predict(str(crafted), "--image", "x.png", "--prompt", "a roof", cwd=tmp_path)
    assert proc.returncode == 2 and "has no digest beside it" in proc.stderr
    with pytest.raises(PackageError, match="does not match the digest passed in"):
        load_package(crafted, sha256=hashlib.sha256(package_path.read_bytes()).hexdigest())
    (tmp_path / "good").mkdir()
    good = copy_package(package_path, tmp_path / "good", digests=False)
    assert load_package(good, sha256=hashlib.sha256(good.read_bytes()).hexdigest()).backends["model"] == "aoti"
    with pytest.raises(PackageError, match="is not a sha256"):
        load_package(good, sha256="abc")


@pytest.mark.parametrize("entry", ["sam3/data/aotinductor/model/../../../../{tmp}/x", "/{tmp}/x",
                                   "sam3/data/aotinductor/model/evil/../../x.so", "other/extra/metadata.json",
                                   "sam3/extra/notes.txt", "link"])
def test_an_entry_no_package_has_is_refused_before_torch_opens_it(package_path, tmp_path, entry):
    """Names are checked before torch's loader unpacks anything, trusted or not, digest or not: nothing is
    written outside the extraction folder."""
    import zipfile

    marker = tmp_path / "outside"
    marker.mkdir()
    name = entry.format(tmp=str(marker).strip("/"))
    crafted = copy_package(package_path, tmp_path, digests=False)
    with zipfile.ZipFile(crafted, "a") as archive:
        info = zipfile.ZipInfo("sam3/data/aotinductor/model/libevil.so" if name == "link" else name)
        if name == "link":
            info.create_system, info.external_attr = 3, (0o120777 << 16)  # a symbolic link
        archive.writestr(info, b"x")
    from sam3_aoti.runtime.integrity import write_digest

    write_digest(crafted)  # the user even has its digest: names are refused all the same
    for load in (lambda: load_package(crafted), lambda: load_package(crafted, trust=True)):
        with pytest.raises(PackageError, match="holds the entry .* which no sam3-aoti package has|root folders"):
            load()
    assert list(marker.iterdir()) == []


def test_a_failed_load_leaves_no_extraction_folder(package_path, tmp_path):
    """A package whose code is damaged but whose digests were rewritten to match (its builder's fault, not
    tampering): torch's loader fails, the fallback takes over, and no /tmp/XXXXXX folder is left."""
    def break_so(name, data):
        return b"not an ELF file" if name.endswith(".wrapper.so") else data

    broken = copy_package(package_path, tmp_path, break_so, digests=False, resign=True)
    before = {p.path for p in extraction_folders()}
    package = load_package(broken, trust=True)
    assert package.backends == dict.fromkeys(TINY_MODELS, "exported") and package.fallback_reason
    assert {p.path for p in extraction_folders()} == before


def test_a_killed_loader_leaves_its_folder_to_the_next_one_and_nothing_in_tmp(package_path, tmp_path):
    """Nothing in the loaders' temporary folder (TMPDIR, a folder of this test's), nor in /tmp, where the other
    tests' processes beside this one write too (a g++'s ccXXXXXX.*, Python's tmpXXXXXXXX, the segment tests' Ray
    folders ray-XXXXXXXX): those are left out."""
    cache, temporary = tmp_path / "cache", tmp_path / "tmp"
    temporary.mkdir()
    env = {**os.environ, "PYTHONPATH": str(REPO / "src"), "SAM3_AOTI_CACHE": str(cache), "TMPDIR": str(temporary)}
    before = {p.name for p in Path("/tmp").iterdir()}
    holder = subprocess.Popen([sys.executable, "-c", f"from sam3_aoti import load_package; "
                               f"package = load_package({str(package_path)!r}); print('loaded', flush=True); "
                               "import time; time.sleep(600)"], env=env, stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "loaded"
    folders = list((cache / "tmp").iterdir())
    assert len(folders) == 1 and folders[0].name.startswith(f"{holder.pid}-")
    assert sorted(p.name.split("-")[0] for p in folders[0].iterdir()) == sorted(TINY_MODELS)
    holder.kill()
    holder.wait()
    proc = subprocess.run([sys.executable, "-c", f"from sam3_aoti import load_package; load_package({str(package_path)!r})"],
                          env=env, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert list((cache / "tmp").iterdir()) == []  # swept (the owner is dead), and the new one removed at exit
    assert list(temporary.iterdir()) == []
    # a g++'s and Python's temporary files of the tests beside this one, and the short Ray folders of the segment tests
    others = r"cc\w{6}\..*|tmp\w{8}|ray-\w{8}"
    assert {p.name for p in Path("/tmp").iterdir() if not re.fullmatch(others, p.name)} - before == set()


@pytest.mark.parametrize("metadata, words", [
    (b"{nope", "its metadata.json is not JSON"),
    (b"[1, 2]", "its metadata.json is an array, not an object"),
    (b'{"models": [1]}', "field `models` is an array, not an object"),
    (b'{"versions": "x"}', "field `versions` is a string, not an object"),
    (b'{"device": 3}', "field `device` is a number, not a string"),
    (b"[" * 100_000 + b"]" * 100_000, "its metadata.json is not JSON"),
    (b" " * (64 << 20) + b"{}", "metadata.json inflates past 4 MiB"),
], ids=lambda value: value if isinstance(value, str) else f"{len(value)} bytes")  # not 64 MiB in the id
def test_info_reads_nothing_unbounded_and_names_a_bad_metadata_field(tmp_path, metadata, words):
    """`info` reads an archive before any digest check: every entry within a limit (a 64 MiB metadata.json
    deflates to a few kB), metadata.json checked for shape and types, one line naming the field."""
    import zipfile

    from sam3_aoti.runtime.info import archive_info

    crafted = tmp_path / "sam3.pt2"
    with zipfile.ZipFile(crafted, "w", zipfile.ZIP_DEFLATED) as archive:
        archive.writestr("sam3/archive_format", b"pt2")
        archive.writestr("sam3/extra/metadata.json", metadata)
    assert crafted.stat().st_size < 1 << 20
    with pytest.raises(PackageError, match=re.escape(words)):
        archive_info(crafted, trust=True)


def exact_copy(package_path, folder):
    """The package and its digest file, byte for byte, in `folder`."""
    shutil.copy(package_path, folder / "sam3.pt2")
    shutil.copy(digest_file(package_path), digest_file(folder / "sam3.pt2"))
    return folder / "sam3.pt2"


def as_impostor(name, data):
    """Another archive a writer could rename over the package: its metadata says so (its code could be anything)."""
    if name.endswith("extra/metadata.json"):
        return json.dumps({**json.loads(data), "profile": "impostor"}).encode()
    return data


@pytest.mark.parametrize("reader", ["load_package", "info"])
@pytest.mark.parametrize("how", ["hashed", "remembered", "just written"])
def test_what_is_checked_is_what_loads(package_path, tmp_path, monkeypatch, how, reader):
    """An archive renamed over the package right after its digest check (hashed now, remembered from before, or
    hashed as it is copied because it was just written) is never read: load_package and info read the file
    that was checked."""
    monkeypatch.setenv("SAM3_AOTI_CACHE", str(tmp_path / "cache"))
    package = exact_copy(package_path, tmp_path)
    (tmp_path / "impostor").mkdir()
    impostor = rewrite_package(package_path, tmp_path / "impostor" / "sam3.pt2", as_impostor)
    if how != "just written":
        time.sleep(integrity.RACY_NS / 1e9 + 0.1)
    if how == "remembered":
        integrity.check_package(package)
    swaps = []

    def swap():
        shutil.copy(impostor, tmp_path / "next.pt2")
        os.replace(tmp_path / "next.pt2", package)
        swaps.append(package)

    hook = {"hashed": "hash_of", "remembered": "_check_record", "just written": "private_copy"}[how]
    owner = integrity.PackageFile if hook == "private_copy" else integrity
    real = getattr(owner, hook)
    monkeypatch.setattr(owner, hook, lambda *args: (real(*args), swap())[0])
    if reader == "info":
        assert archive_info(package)["profile"] == "tiny"
    else:
        loaded = load_package(package)
        assert loaded.metadata["profile"] == "tiny" and loaded.backends == dict.fromkeys(TINY_MODELS, "aoti")
    assert len(swaps) == 1


def test_a_package_written_in_place_while_it_loads_is_refused(package_path, tmp_path, monkeypatch):
    """A write into the checked file itself after its check (one byte of the models' code changed): what is open
    is checked again before any code of it loads, the load is refused with one line, and no model's folder is
    left."""
    monkeypatch.setenv("SAM3_AOTI_CACHE", str(tmp_path / "cache"))
    package = exact_copy(package_path, tmp_path)
    time.sleep(integrity.RACY_NS / 1e9 + 0.1)

    with zipfile.ZipFile(package) as archive:  # where the model's shared object lies in the file
        entry = next(i for i in archive.infolist() if i.filename.endswith("/model/" + i.filename.split("/")[-1])
                     and i.filename.endswith(".wrapper.so"))
        offset = entry.header_offset + 30 + len(entry.filename.encode()) + len(entry.extra) + entry.compress_size // 2

    def write_in_place():
        with open(package, "r+b") as f:
            f.seek(offset)
            byte = f.read(1)
            f.seek(offset)
            f.write(bytes([byte[0] ^ 0xFF]))

    real = integrity.hash_of
    monkeypatch.setattr(integrity, "hash_of", lambda opened: (real(opened), write_in_place())[0])
    before = set(process_folder().iterdir())
    with pytest.raises(PackageError, match="does not match its digest sam3.pt2.sha256"):
        load_package(package)
    assert set(process_folder().iterdir()) == before


def test_a_fifo_in_place_of_a_package_or_its_digest_is_one_line_not_a_hang(package_path, tmp_path):
    package = exact_copy(package_path, tmp_path)
    digest_file(package).unlink()
    os.mkfifo(digest_file(package))
    with pytest.raises(PackageError, match="sam3.pt2.sha256 is not a regular file"):
        load_package(package)
    fifo = tmp_path / "fifo.pt2"
    os.mkfifo(fifo)
    with pytest.raises(PackageError, match="fifo.pt2 is not a regular file"):
        integrity.check_package(fifo)
