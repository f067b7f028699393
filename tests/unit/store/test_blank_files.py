"""Blobs written into empty nameless files made ahead by a thread: whole under their names, private, one
link each; nothing left in staging; filesystems that refuse nameless files or their links fall back to a
create of the writer's own."""

from __future__ import annotations

import os
import stat
import time
from pathlib import Path

import pytest

from mithrilfs.store.blank_files import FIRST_KEPT, BlankFiles
from mithrilfs.store.cas import CAS, hash_bytes


def blank_inodes(directory: Path) -> set[int]:
    """The inodes of the nameless files in *directory* this process holds open (``O_TMPFILE``: their
    links in /proc read "#<inode> (deleted)")."""
    prefix = f"{directory}/#"
    held = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            target = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if target.startswith(prefix) and target.endswith(" (deleted)"):
            held.add(int(target[len(prefix):-len(" (deleted)")]))
    return held


def blanks_held(directory: Path) -> int:
    return len(blank_inodes(directory))


def wait_until(condition, what: str, timeout: float = 10.0) -> None:
    end = time.monotonic() + timeout
    while not condition():
        if time.monotonic() > end:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.005)


@pytest.fixture
def cas(tmp_path: Path):
    cas = CAS(tmp_path / "store")
    cas.blanks = BlankFiles(cas.staging, depth=8, burst=cas.make_shards)
    yield cas
    cas.blanks.close()


def drain(blanks: BlankFiles) -> None:
    """Take blanks until one is missing, as a burst of commits outrunning the thread does."""
    while (fd := blanks.take()) is not None:
        os.close(fd)


def test_blobs_are_written_into_blanks_made_ahead_and_appear_whole(cas: CAS):
    assert blanks_held(cas.staging) == 0  # none made before a first write asks
    first = os.urandom(100)
    assert cas.write_blob(hash_bytes(first), first)
    wait_until(lambda: blanks_held(cas.staging) == FIRST_KEPT, "the thread to make its first blanks")
    blanks = blank_inodes(cas.staging)
    blobs = [os.urandom(n) for n in (0, 1, 4096, 70_000)]
    for data in blobs:
        assert cas.write_blob(hash_bytes(data), data)
    # the blobs are the blanks, oldest first (the thread makes more meanwhile), not files the writer made
    assert {cas.path(hash_bytes(data)).stat().st_ino for data in blobs} == blanks
    for data in [first, *blobs]:
        path = cas.path(hash_bytes(data))
        st = path.stat()
        assert path.read_bytes() == data
        assert stat.S_IMODE(st.st_mode) == 0o400 and st.st_nlink == 1
    assert os.listdir(cas.staging) == []
    assert not cas.write_blob(hash_bytes(blobs[0]), blobs[0])  # there already: kept, not written


def test_a_burst_of_blobs_gets_more_blanks_and_every_directory_made_ahead(cas: CAS):
    """A few blobs make a few blanks and only their own directories; takes that find none keep twice
    as many, up to the most (8 here), and then the thread makes every directory of ``objects/``."""
    data = os.urandom(100)
    cas.write_blob(hash_bytes(data), data)
    wait_until(lambda: blanks_held(cas.staging) == FIRST_KEPT, "the first blanks")
    assert len(os.listdir(cas.objects)) == 1
    drain(cas.blanks)
    wait_until(lambda: blanks_held(cas.staging) == 8, "twice as many blanks")
    wait_until(lambda: len(os.listdir(cas.objects)) == 256, "every directory a blob goes to")


def test_a_damaged_blob_is_replaced_through_a_blank(cas: CAS):
    data = os.urandom(5000)
    digest = hash_bytes(data)
    cas.write_blob(digest, data)
    wait_until(lambda: blanks_held(cas.staging) > 0, "a blank")
    path = cas.path(digest)
    inode = path.stat().st_ino
    os.chmod(path, 0o600)
    path.write_bytes(b"rot" * 10)
    assert not cas.write_blob(digest, data, trust_existing=False)  # not new: replaced in place
    assert path.read_bytes() == data and path.stat().st_ino != inode and path.stat().st_nlink == 1
    assert os.listdir(cas.staging) == []


def test_a_blob_not_trusted_is_linked_first_and_one_trusted_spends_no_blank(cas: CAS):
    """Content the caller has not verified (a commit's, as a rule new) goes straight into a blank's link,
    no stat first, and is new; the same bytes again, not trusted, replace the file (it may be damaged);
    trusted, they are kept and no blank is taken."""
    data = os.urandom(3000)
    digest = hash_bytes(data)
    first = os.urandom(10)
    assert cas.write_blob(hash_bytes(first), first)  # the first write asks for blanks
    wait_until(lambda: blanks_held(cas.staging) > 2, "blanks")
    assert cas.write_blob(digest, data, trust_existing=False)  # new
    inode = cas.path(digest).stat().st_ino
    assert not cas.write_blob(digest, data, trust_existing=False)  # there: replaced, not new
    assert cas.path(digest).read_bytes() == data and cas.path(digest).stat().st_ino != inode
    held = blank_inodes(cas.staging)
    assert not cas.write_blob(digest, data)  # trusted and there: kept
    assert blank_inodes(cas.staging) >= held  # none taken (the thread may have made more)
    assert os.listdir(cas.staging) == []


def test_close_leaves_nothing_open_or_named(cas: CAS):
    data = os.urandom(10)
    cas.write_blob(hash_bytes(data), data)
    wait_until(lambda: blanks_held(cas.staging) == FIRST_KEPT, "the blanks")
    cas.blanks.close()
    assert blanks_held(cas.staging) == 0 and os.listdir(cas.staging) == []
    more = os.urandom(10)
    assert cas.write_blob(hash_bytes(more), more)  # a closed pool finds none: the writer creates its own
    assert cas.path(hash_bytes(more)).read_bytes() == more


def test_a_filesystem_without_nameless_files_gets_blobs_written_as_before(tmp_path: Path):
    blanks = BlankFiles("/proc")  # O_TMPFILE: EOPNOTSUPP
    try:
        assert blanks.take() is None
        wait_until(lambda: not blanks._thread.is_alive(), "the thread to give up")
        assert blanks.take() is None
    finally:
        blanks.close()


def test_blanks_that_cannot_be_linked_are_given_up_and_the_blob_written_anyway(tmp_path: Path):
    """Nameless files made on another filesystem (tmpfs) than the blobs' link nowhere (EXDEV), as a
    filesystem refusing such links would: the blob is written with a create of its own, and no blank is
    taken again."""
    cas = CAS(tmp_path / "store")
    shm = Path("/dev/shm") / f"blanks-{os.getpid()}"
    shm.mkdir()
    cas.blanks = BlankFiles(shm, depth=4)
    try:
        warm = os.urandom(10)
        cas.write_blob(hash_bytes(warm), warm)  # found none: asks for them
        wait_until(lambda: blanks_held(shm) == 4, "the blanks")
        data = os.urandom(3000)
        assert cas.write_blob(hash_bytes(data), data)
        assert cas.path(hash_bytes(data)).read_bytes() == data
        assert cas.blanks.take() is None
        assert os.listdir(cas.staging) == []
    finally:
        cas.blanks.close()
        shm.rmdir()
    assert blanks_held(shm) == 0
