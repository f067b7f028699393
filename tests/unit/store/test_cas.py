"""The blob store: blobs added through the one blob API (index row + file), open, exists, dedup, verify, staging."""

from __future__ import annotations

import os
import stat

import blake3
import pytest

from mithrilfs.store.blobs import Blobs
from mithrilfs.store.cas import CAS, EMPTY_DIGEST, hash_file
from mithrilfs.store.namespace import Namespace


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
