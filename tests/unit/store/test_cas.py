"""The blob store: blobs added through the one blob API (index row + file), open, exists, dedup, verify, staging."""

from __future__ import annotations

import os
import stat

import blake3
import pytest
from conftest import wait_for

from mithrilfs.store.blobs import Blobs
from mithrilfs.store.cas import CAS, EMPTY_DIGEST, hash_file
from mithrilfs.store.namespace import Namespace
from mithrilfs.store.spare_files import SPARE_FILES


@pytest.fixture
def cas(tmp_path):
    return CAS(tmp_path / "store")


@pytest.fixture
def blobs(cas, tmp_path):
    return Blobs(Namespace(str(tmp_path / "index.sqlite3")), cas)


def test_added_blob_is_named_by_blake3(cas, blobs):
    digest, new = blobs.add_bytes(b"kernel code")
    assert new
    assert digest == blake3.blake3(b"kernel code").digest()
    assert cas.path(digest).name == digest.hex()
    assert cas.path(digest).parent.name == digest.hex()[:2]
    assert cas.read(digest) == b"kernel code"
    assert cas.exists(digest)


def test_blobs_are_read_only_and_private(cas, blobs):
    digest, _ = blobs.add_bytes(b"x")
    assert stat.S_IMODE(os.stat(cas.path(digest)).st_mode) == 0o400


def test_identical_content_is_stored_once(cas, blobs):
    d1, new1 = blobs.add_bytes(b"same")
    d2, new2 = blobs.add_bytes(b"same")
    assert d1 == d2 and new1 and not new2
    assert list(cas.iter_digests()) == [d1]
    assert os.listdir(cas.staging) == []


def test_adopt_links_staging_or_reports_duplicate(cas):
    fd, path = cas.new_staging()
    os.write(fd, b"payload")
    os.close(fd)
    digest = hash_file(path)
    assert cas.adopt(path, digest) is True
    # the staging name stays until the caller has recorded the blob
    assert os.path.samefile(path, cas.path(digest))
    fd, path2 = cas.new_staging()
    os.write(fd, b"payload")
    os.close(fd)
    assert cas.adopt(path2, digest) is False
    assert not os.path.samefile(path2, cas.path(digest))
    assert cas.read(digest) == b"payload"


def test_open_and_missing_blob(cas, blobs):
    digest, _ = blobs.add_bytes(b"abc")
    fd = cas.open(digest)
    try:
        assert os.pread(fd, 10, 1) == b"bc"
    finally:
        os.close(fd)
    cas.delete(digest)
    assert not cas.exists(digest)
    with pytest.raises(FileNotFoundError):
        cas.open(digest)


def test_verify_detects_altered_blob(cas, blobs):
    digest, _ = blobs.add_bytes(b"good bytes")
    assert cas.verify(digest)
    p = cas.path(digest)
    os.chmod(p, 0o644)
    p.write_bytes(b"evil bytes")
    assert not cas.verify(digest)
    cas.delete(digest)
    assert not cas.verify(digest)


def test_large_file_hash_matches_streaming_hash(cas, blobs, tmp_path):
    data = os.urandom(3 << 20)
    src = tmp_path / "big"
    src.write_bytes(data)
    assert hash_file(src) == blake3.blake3(data).digest()
    digest, new = blobs.add_bytes(src.read_bytes())
    assert new and cas.read(digest) == data


def test_empty_digest(tmp_path):
    p = tmp_path / "e"
    p.write_bytes(b"")
    assert hash_file(p) == EMPTY_DIGEST == blake3.blake3(b"").digest()


def test_clear_staging_removes_leftovers(cas):
    for _ in range(3):
        fd, _ = cas.new_staging()
        os.close(fd)
    assert cas.clear_staging() == 3
    assert os.listdir(cas.staging) == []


def test_blobs_are_written_into_spare_files_made_ahead_and_none_outlive_close(cas):
    """``write_blob`` takes an empty file a thread made ahead when one is ready (its first call finds none
    and starts the thread); the blob is whole and private either way, and ``close`` and the next mount's
    ``clear_staging`` leave no spare behind."""
    first, second = b"first blob" * 100, b"second blob" * 100
    try:
        assert cas.write_blob(blake3.blake3(first).digest(), first, spare=True)
        wait_for(lambda: len(os.listdir(cas.spare)) == SPARE_FILES, what="the spare files")
        spares = set(os.listdir(cas.spare))
        assert cas.write_blob(blake3.blake3(second).digest(), second, spare=True)
        left = set(os.listdir(cas.spare))
        assert len(left) == SPARE_FILES - 1 and left < spares  # one was taken; none made for so few gone
        for data in (first, second):
            digest = blake3.blake3(data).digest()
            assert cas.read(digest) == data and stat.S_IMODE(os.stat(cas.path(digest)).st_mode) == 0o400
        assert os.listdir(cas.staging) == []
        third = b"from a worker thread" * 100  # makes its own file: the spares stay for the event loop
        assert cas.write_blob(blake3.blake3(third).digest(), third)
        assert set(os.listdir(cas.spare)) == left
    finally:
        cas.spares.close()
    assert os.listdir(cas.spare) == []
    (cas.spare / "left-by-a-crash").write_bytes(b"")
    assert cas.clear_staging() == 0 and os.listdir(cas.spare) == []
