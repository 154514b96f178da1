"""A passed digest check is remembered per file identity, so a service's next start does not hash 1.7 GB again;
any write to the file brings the hash back."""

import os
import time
import zipfile

import pytest

from sam3_aoti.runtime import integrity
from sam3_aoti.errors import PackageError


@pytest.fixture
def package(tmp_path, monkeypatch):
    monkeypatch.setenv("SAM3_AOTI_CACHE", str(tmp_path / "cache"))
    path = tmp_path / "sam3.pt2"
    with zipfile.ZipFile(path, "w") as archive:  # the names a package has; random bytes as its code
        archive.writestr("sam3/archive_format", "pt2")
        archive.writestr("sam3/data/aotinductor/model/code.wrapper.so", os.urandom(1 << 16))
    integrity.write_digest(path)
    return path


def count_hashes(monkeypatch) -> list:
    """Every hash of a package: of the open file, or of a private copy as it is made (a file just written)."""
    calls = []
    real_hash, real_copy = integrity.hash_of, integrity.PackageFile.private_copy
    monkeypatch.setattr(integrity, "hash_of", lambda package: calls.append(package) or real_hash(package))
    monkeypatch.setattr(integrity.PackageFile, "private_copy", lambda package: calls.append(package) or real_copy(package))
    return calls


def test_a_passed_check_is_remembered_until_the_file_changes(package, monkeypatch):
    hashes = count_hashes(monkeypatch)
    assert integrity.check_package(package) == "matches sam3.pt2.sha256"  # just written: hashed, not remembered
    time.sleep(integrity.RACY_NS / 1e9 + 0.1)
    integrity.check_package(package)
    assert "checked before" in integrity.check_package(package)
    assert len(hashes) == 2

    st = package.stat()  # one byte changed in place, size and mtime put back: ctime still moves
    data = bytearray(package.read_bytes())
    data[100] ^= 1
    package.write_bytes(bytes(data))
    os.utime(package, ns=(st.st_atime_ns, st.st_mtime_ns))
    with pytest.raises(PackageError, match="does not match its digest"):
        integrity.check_package(package)
    assert len(hashes) == 3


def test_a_new_digest_file_is_checked_again(package, monkeypatch):
    time.sleep(integrity.RACY_NS / 1e9 + 0.1)
    integrity.check_package(package)
    integrity.digest_file(package).write_text("0" * 64 + "  sam3.pt2\n")
    with pytest.raises(PackageError, match="does not match its digest"):
        integrity.check_package(package)


def test_an_unwritable_cache_only_costs_the_hash(package, monkeypatch, tmp_path):
    blocker = tmp_path / "not-a-folder"
    blocker.write_text("")
    monkeypatch.setenv("SAM3_AOTI_CACHE", str(blocker))
    hashes = count_hashes(monkeypatch)
    time.sleep(integrity.RACY_NS / 1e9 + 0.1)
    for _ in range(2):
        assert integrity.check_package(package) == "matches sam3.pt2.sha256"
    assert len(hashes) == 2
