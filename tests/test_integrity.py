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


@pytest.mark.parametrize("compression", [zipfile.ZIP_STORED, zipfile.ZIP_DEFLATED])
def test_an_entry_is_copied_out_byte_for_byte_by_the_kernel_only_when_stored_and_vouched_for(
        tmp_path, monkeypatch, compression):
    """The loader's unpack (`PackageFile.copy_entry`): a stored entry of a package whose digest matched is copied
    by the kernel from the package's own bytes (its local header found behind prepended bytes, as zipfile finds
    it); a compressed one, or one of a package no digest vouched for, through zipfile. Same bytes either way."""
    from sam3_aoti.runtime import reader

    monkeypatch.setenv("SAM3_AOTI_CACHE", str(tmp_path / "cache"))
    blob, path = os.urandom(3 * (1 << 20) + 5), tmp_path / "sam3.pt2"
    with open(path, "wb") as f:
        f.write(b"prepended bytes")
        with zipfile.ZipFile(f, "w", compression) as archive:
            archive.writestr("sam3/archive_format", "pt2")
            archive.writestr("sam3/data/aotinductor/model/x_weights.blob", blob)
    integrity.write_digest(path)
    real_copy_range, ranges = reader.copy_range, []
    monkeypatch.setattr(reader, "copy_range", lambda *a: ranges.append(a) or real_copy_range(*a))
    for trust in (False, True):
        with integrity.PackageFile(path) as package:
            if trust:
                os.unlink(integrity.digest_file(path))
                monkeypatch.setattr(integrity, "_check_parts", lambda package: None)
            integrity.check_package(package, trust=trust)
            with open(tmp_path / "out", "wb") as out:
                package.copy_entry("data/aotinductor/model/x_weights.blob", out)
        assert (tmp_path / "out").read_bytes() == blob
    assert len(ranges) == (1 if compression == zipfile.ZIP_STORED else 0)


def test_a_kernel_copy_falls_back_to_blocks_across_file_systems(tmp_path, monkeypatch):
    import errno

    from sam3_aoti.runtime import reader

    data = os.urandom(1 << 20)
    (tmp_path / "src").write_bytes(b"head" + data + b"tail")

    def cross_device(*args):
        raise OSError(errno.EXDEV, "Invalid cross-device link")

    monkeypatch.setattr(os, "copy_file_range", cross_device)
    with open(tmp_path / "src", "rb") as src, open(tmp_path / "dst", "wb") as dst:
        reader.copy_range(src.fileno(), dst.fileno(), 4, len(data))
        with pytest.raises(EOFError):
            reader.copy_range(src.fileno(), dst.fileno(), 9, len(data))  # one byte past the end
    assert (tmp_path / "dst").read_bytes()[:len(data)] == data
