"""Integrity on its own: verify before serving, quarantine bad blobs, ask a blob source for missing ones.

Built as ``daemon.wiring.build`` builds it, on a real store (CAS + SQLite
index in a temporary directory).  The blob source (the shared tier in a
mount) is a small implementation of the ``BlobSource`` protocol that
answers as told and, when it has the bytes, really puts the blob back
through ``Blobs.add``.
"""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest
import trio

from mithrilfs.cache.budget import Budget
from mithrilfs.cache.integrity import BlobSource, Fetched, Integrity
from mithrilfs.cache.lifetime import Lifetimes, NoKernelCaches
from mithrilfs.cache.policy import EvictionPolicy
from mithrilfs.cache.readahead import ReadAhead
from mithrilfs.cache.recency import Recency
from mithrilfs.cache.writepath import WritePath
from mithrilfs.kernel import FUSEError
from mithrilfs.observe.events import EventLog
from mithrilfs.observe.stats import Stats
from mithrilfs.observe.tops import TopDirs
from mithrilfs.shared.tier import NullTier
from mithrilfs.store.cas import hash_bytes
from mithrilfs.store.namespace import ROOT_INODE, DirPaths, Inode
from mithrilfs.store.open import Store, open_store

POLICY_MAX = 1 << 30


class AnsweringSource:
    """A ``BlobSource`` that answers a fixed ``Fetched`` and, for YES, adds the bytes it holds as the blob."""

    def __init__(self, store: Store, answer: Fetched, holds: dict[bytes, bytes] | None = None) -> None:
        self.store = store
        self.answer = answer
        self.holds = holds or {}
        self.asked: list[tuple[int, int]] = []

    async def fetch(self, ino: Inode, max_bytes: int) -> Fetched:
        self.asked.append((ino.id, max_bytes))
        if self.answer is Fetched.YES:
            assert ino.hash is not None
            data = self.holds[ino.hash]
            fd, path = self.store.cas.new_staging()
            try:
                with os.fdopen(fd, "wb") as f:
                    f.write(data)
                self.store.blobs.add(path, hash_bytes(data), len(data), trusted=True)
            finally:
                os.unlink(path)
        return self.answer


@dataclass
class Checked:
    """A store with one file ``inductor/k.py``, and the Integrity that guards its reads."""

    store: Store
    stats: Stats
    lifetimes: Lifetimes
    ino: Inode
    data: bytes
    dir: int

    def add_file(self, name: bytes, data: bytes) -> Inode:
        """One more committed file beside ``k.py``, its blob not verified yet."""
        store = self.store
        digest, _ = store.blobs.add_bytes(data)
        with store.ns.txn():
            ino = store.ns.create_inode(stat.S_IFREG | 0o644, os.getuid(), os.getgid())
            store.ns.link(self.dir, name, ino.id)
            store.ns.set_content(ino, digest, len(data), ino.mtime_ns)
        store.blobs.verified.discard(digest)
        return ino

    def integrity(self, source: BlobSource) -> Integrity:
        """Integrity wired as in a mount, asking *source* for missing blobs."""
        store = self.store
        writes = WritePath(store.ns, store.blobs, self.stats, trio.CapacityLimiter(2), [])
        tops = TopDirs(store.ns, DirPaths(store.ns))
        budget = Budget(store, EvictionPolicy(max_bytes=POLICY_MAX), writes, self.lifetimes, Recency(store.ns),
                        self.stats, EventLog(None), tops, evicted=NullTier())
        return Integrity(store, self.lifetimes, budget, source, self.stats, EventLog(None), tops,
                         trio.CapacityLimiter(2), ReadAhead(store.blobs, self.stats))


@pytest.fixture
def checked(tmp_path: Path) -> Iterator[Checked]:
    """One committed file; its blob is not yet verified in this mount (as after a remount)."""
    store = open_store(tmp_path / "store")
    try:
        ns = store.ns
        data = b"def kernel(): return 42\n" * 10
        digest, _ = store.blobs.add_bytes(data)
        with ns.txn():
            d = ns.create_inode(stat.S_IFDIR | 0o755, os.getuid(), os.getgid(), nlink=2)
            ns.link(ROOT_INODE, b"inductor", d.id)
            ino = ns.create_inode(stat.S_IFREG | 0o644, os.getuid(), os.getgid())
            ns.link(d.id, b"k.py", ino.id)
            ns.set_content(ino, digest, len(data), ino.mtime_ns)
        store.blobs.verified.clear()  # a new mount has verified nothing yet
        lifetimes = Lifetimes(ns, store.blobs, Recency(ns), lambda ino: False, NoKernelCaches())
        yield Checked(store, Stats(), lifetimes, ino, data, d.id)
    finally:
        store.close()


def test_a_good_blob_verifies_and_is_remembered(checked: Checked) -> None:
    """The first read hashes the blob; once right it is in ``verified`` and served without a re-read."""
    integrity = checked.integrity(NullTier())
    digest = checked.ino.hash
    assert digest not in checked.store.blobs.verified
    assert trio.run(integrity.verify, checked.ino) is True
    assert digest in checked.store.blobs.verified
    assert integrity.read(checked.ino.id, digest, 0, 9) == checked.data[:9]  # type: ignore[arg-type]
    assert checked.stats.by_dir["inductor"]["corrupt_blobs"] == 0


def test_a_tampered_blob_is_quarantined_and_its_names_removed(checked: Checked) -> None:
    """Bytes that do not hash to the blob's name are never served: quarantine, names gone, counted."""
    store = checked.store
    digest = checked.ino.hash
    assert digest is not None
    path = store.cas.path(digest)
    os.chmod(path, 0o600)
    with open(path, "r+b") as f:
        f.write(b"X")  # same size, different content
    integrity = checked.integrity(NullTier())
    assert trio.run(integrity.verify, checked.ino) is False
    assert digest not in store.blobs.verified
    assert not store.cas.exists(digest)
    quarantined = os.listdir(store.cas.quarantine)
    assert len(quarantined) == 1 and quarantined[0].startswith(digest.hex())
    assert store.ns.lookup(checked.dir, b"k.py") is None
    assert store.ns.get(checked.ino.id) is None
    assert checked.stats.by_dir["inductor"]["corrupt_blobs"] == 1


def test_a_missing_blob_with_no_tier_is_corruption(checked: Checked) -> None:
    """With nobody to ask (Fetched.NO_TIER), a lost blob is treated as corrupt: counted, names removed."""
    store = checked.store
    digest = checked.ino.hash
    store.cas.delete(digest)  # type: ignore[arg-type]
    source = AnsweringSource(store, Fetched.NO_TIER)
    assert trio.run(checked.integrity(source).verify, checked.ino) is False
    assert source.asked == [(checked.ino.id, POLICY_MAX)]
    assert store.ns.lookup(checked.dir, b"k.py") is None
    assert checked.stats.by_dir["inductor"]["corrupt_blobs"] == 1


def test_a_missing_blob_the_tier_cannot_give_is_a_miss_not_corruption(checked: Checked) -> None:
    """Fetched.NO: the name is forgotten (the next open is a miss), nothing is quarantined or counted."""
    store = checked.store
    digest = checked.ino.hash
    store.cas.delete(digest)  # type: ignore[arg-type]
    source = AnsweringSource(store, Fetched.NO)
    assert trio.run(checked.integrity(source).verify, checked.ino) is False
    assert len(source.asked) == 1
    assert store.ns.lookup(checked.dir, b"k.py") is None
    assert store.ns.blob_info(digest) is None  # type: ignore[arg-type]
    assert checked.stats.by_dir["inductor"]["corrupt_blobs"] == 0
    assert os.listdir(store.cas.quarantine) == []


def test_a_missing_blob_the_tier_puts_back_is_served(checked: Checked) -> None:
    """Fetched.YES after the source added the blob: verify says it may be served and the name stays."""
    store = checked.store
    digest = checked.ino.hash
    assert digest is not None
    store.cas.delete(digest)
    source = AnsweringSource(store, Fetched.YES, {digest: checked.data})
    integrity = checked.integrity(source)
    assert trio.run(integrity.verify, checked.ino) is True
    assert len(source.asked) == 1
    assert store.ns.lookup(checked.dir, b"k.py") == checked.ino.id
    assert store.cas.read(digest) == checked.data
    assert integrity.read(checked.ino.id, digest, 0, len(checked.data)) == checked.data
    assert checked.stats.by_dir["inductor"]["corrupt_blobs"] == 0
    # verified now: a second read neither hashes nor asks again
    assert trio.run(integrity.verify, checked.ino) is True
    assert len(source.asked) == 1


def test_a_small_blob_is_hashed_and_served_from_one_read(checked: Checked) -> None:
    """The first read of a small blob serves the very bytes it hashed (issue 17); bytes that do not
    hash to the name, or a file longer than the blob, are not served from it."""
    store = checked.store
    digest = checked.ino.hash
    assert digest is not None
    integrity = checked.integrity(NullTier())
    served = integrity.read_small(checked.ino, 3, 5)
    assert served is not None and bytes(served) == checked.data[3:8]
    assert digest in store.blobs.verified
    store.blobs.verified.discard(digest)
    path = store.cas.path(digest)
    os.chmod(path, 0o600)
    with open(path, "ab") as f:
        f.write(b"more")  # a longer file: the first bytes still hash right, the whole does not
    assert integrity.read_small(checked.ino, 0, 4096) is None
    assert digest not in store.blobs.verified
    os.unlink(path)
    assert integrity.read_small(checked.ino, 0, 4096) is None  # missing: ``verify`` decides


def test_a_blob_read_ahead_after_its_lookup_serves_its_read_from_memory(checked: Checked) -> None:
    """``ReadAhead.after_lookup`` hashes the blob once and keeps the verified bytes; the READs that follow
    are answered from them (the blob file is not read again: here it is gone), and once the end is read
    they are let go."""
    integrity = checked.integrity(NullTier())
    digest = checked.ino.hash
    assert digest is not None
    integrity.read_ahead.after_lookup(checked.ino, "inductor")
    assert digest in checked.store.blobs.verified
    assert checked.stats.by_dir["inductor"]["read_ahead"] == 1
    os.unlink(checked.store.cas.path(digest))  # only the bytes read ahead can answer now
    assert bytes(integrity.read(checked.ino.id, digest, 0, 9)) == checked.data[:9]
    assert bytes(integrity.read(checked.ino.id, digest, 9, 1 << 20)) == checked.data[9:]
    assert checked.stats.by_dir["inductor"]["read_ahead_served"] == 2
    with pytest.raises(FUSEError):  # its end was read: let go, and the file is missing
        integrity.read(checked.ino.id, digest, 0, 9)


def test_a_tampered_blob_is_not_read_ahead_and_its_read_still_finds_it(checked: Checked) -> None:
    """Read-ahead keeps only bytes that hash to the blob's name; a wrong blob is left for the READ's
    verification, which quarantines it as before."""
    digest = checked.ino.hash
    assert digest is not None
    path = checked.store.cas.path(digest)
    os.chmod(path, 0o600)
    with open(path, "r+b") as f:
        f.write(b"X")
    integrity = checked.integrity(NullTier())
    integrity.read_ahead.after_lookup(checked.ino, "inductor")
    assert checked.stats.by_dir["inductor"]["read_ahead"] == 0
    assert digest not in checked.store.blobs.verified
    assert integrity.read_ahead.take(digest, 0, 9) is None
    assert trio.run(integrity.verify, checked.ino) is False
    assert checked.stats.by_dir["inductor"]["corrupt_blobs"] == 1


def test_read_ahead_keeps_at_most_its_bytes_oldest_dropped_first(checked: Checked) -> None:
    ahead = ReadAhead(checked.store.blobs, checked.stats, max_bytes=700)
    inodes = [checked.add_file(f"f{i}".encode(), bytes([i]) * 300) for i in range(3)]
    for ino in inodes:
        ahead.after_lookup(ino, "inductor")
    assert checked.stats.by_dir["inductor"]["read_ahead"] == 3
    assert ahead._bytes == 600  # two of 300 kept, the oldest dropped
    assert ahead.take(inodes[0].hash, 0, 10) is None  # type: ignore[arg-type]
    assert bytes(ahead.take(inodes[2].hash, 0, 10) or b"") == b"\2" * 10  # type: ignore[arg-type]
    assert bytes(ahead.take(inodes[2].hash, 290, 100) or b"") == b"\2" * 10  # type: ignore[arg-type]
    assert ahead._bytes == 300  # its end was read: let go
    ahead.after_lookup(inodes[1], "inductor")  # kept already: not read again
    assert checked.stats.by_dir["inductor"]["read_ahead"] == 3


def test_a_blob_verified_in_this_mount_is_read_ahead_and_its_read_served_from_memory(checked: Checked) -> None:
    """A blob a prefetch verified as it arrived is read ahead after its lookup too (without hashing it
    again), so its READ does not open and read the file while the client waits."""
    digest = checked.ino.hash
    assert digest is not None
    assert checked.store.blobs.verify(digest) is True  # as a prefetch's blob is
    integrity = checked.integrity(NullTier())
    integrity.read_ahead.after_lookup(checked.ino, "inductor")
    assert checked.stats.by_dir["inductor"]["read_ahead"] == 1
    os.unlink(checked.store.cas.path(digest))  # only the bytes read ahead can answer now
    assert bytes(integrity.read(checked.ino.id, digest, 0, 1 << 20)) == checked.data
    assert checked.stats.by_dir["inductor"]["read_ahead_served"] == 1


def test_a_blob_not_in_memory_is_not_read_ahead_but_fetched_from_disk_in_the_background(checked: Checked) -> None:
    """A head start never holds the event loop on the disk: a blob whose pages are not cached is left to
    its READ (read with RWF_NOWAIT, nothing kept), and asked of the disk in the background, so that a
    later attempt, or the READ, finds it in memory."""
    digest = checked.ino.hash
    assert digest is not None
    path = checked.store.cas.path(digest)
    os.sync()  # clean pages can be dropped
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    integrity = checked.integrity(NullTier())
    integrity.read_ahead.after_lookup(checked.ino, "inductor")
    assert checked.stats.by_dir["inductor"]["read_ahead"] == 0
    assert digest not in checked.store.blobs.verified
    # the background read brings the pages in; the next head start finds them
    deadline = time.monotonic() + 10
    while checked.stats.by_dir["inductor"]["read_ahead"] == 0 and time.monotonic() < deadline:
        time.sleep(0.01)
        integrity.read_ahead.after_lookup(checked.ino, "inductor")
    assert checked.stats.by_dir["inductor"]["read_ahead"] == 1
    assert bytes(integrity.read(checked.ino.id, digest, 0, 1 << 20)) == checked.data


def test_read_ahead_pauses_when_what_it_reads_goes_unread(checked: Checked) -> None:
    """Lookups that no read follows (``stat`` after ``stat``): past UNREAD_MAX blobs waiting, read-ahead
    drops them and skips the next PAUSE lookups, so such a client pays for a few, not for every one."""
    from mithrilfs.cache.readahead import PAUSE, UNREAD_MAX

    store = checked.store
    ahead = ReadAhead(store.blobs, checked.stats)
    inodes = [checked.add_file(f"g{i}".encode(), i.to_bytes(4, "big") * 100) for i in range(UNREAD_MAX + PAUSE + 2)]
    for ino in inodes[:UNREAD_MAX + 1]:
        ahead.after_lookup(ino, "inductor")
    assert checked.stats.by_dir["inductor"]["read_ahead"] == UNREAD_MAX + 1
    assert ahead.take(inodes[0].hash, 0, 10) is None  # type: ignore[arg-type]  # dropped
    assert ahead._bytes == 0
    for ino in inodes[UNREAD_MAX + 1:UNREAD_MAX + 1 + PAUSE]:
        ahead.after_lookup(ino, "inductor")
    assert checked.stats.by_dir["inductor"]["read_ahead"] == UNREAD_MAX + 1  # paused
    ahead.after_lookup(inodes[-1], "inductor")
    assert checked.stats.by_dir["inductor"]["read_ahead"] == UNREAD_MAX + 2  # and on again
    # a client that reads what it looks up never gets there
    reader = ReadAhead(store.blobs, checked.stats)
    store.blobs.verified.clear()
    for ino in inodes[:UNREAD_MAX * 2]:
        reader.after_lookup(ino, "inductor")
        assert reader.take(ino.hash, 0, 1 << 20) is not None  # type: ignore[arg-type]
