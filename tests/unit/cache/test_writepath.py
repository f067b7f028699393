"""WritePath on its own: staging, the running hash, commits, unconfirmed marks, files failed for room.

Built as ``daemon.wiring`` builds it, on a real store (CAS + SQLite index in
a temporary directory); no filesystem, no kernel.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterator

import blake3
import pytest
import trio

from mithrilfs.cache.staged import ContentDropped, Staged
from mithrilfs.cache.staging import MEM_STAGING_MAX
from mithrilfs.cache.writepath import WritePath
from mithrilfs.observe.stats import ROOT_KEY, Stats
from mithrilfs.store.namespace import ROOT_INODE, Inode, Namespace
from mithrilfs.store.open import Store

#: A size staged in a file rather than in memory (past ``MEM_STAGING_MAX``).
BIG = MEM_STAGING_MAX + (64 << 10)


class RecordingListener:
    """A commit listener (the protocol the budget and the shared tier implement) that remembers each call."""

    def __init__(self) -> None:
        self.commits: list[tuple[int, bytes | None, int]] = []

    async def committed(self, of: Staged) -> None:
        self.commits.append((of.inode.id, of.inode.hash, of.inode.size))


@pytest.fixture
def listener() -> RecordingListener:
    return RecordingListener()


@pytest.fixture
def writes(store: Store, listener: RecordingListener) -> Iterator[WritePath]:
    """The write path as wiring builds it, with a recording listener in the commit-listener list."""
    w = WritePath(store.ns, store.blobs, Stats(), trio.CapacityLimiter(2), [listener])
    try:
        yield w
    finally:
        w.shutdown()  # closes staging fds of a test that failed half way


def new_file(ns: Namespace, name: bytes) -> Inode:
    """A named, empty regular file in the root (what CREATE leaves before any write)."""
    with ns.txn():
        ino = ns.create_inode(stat.S_IFREG | 0o644, os.getuid(), os.getgid())
        ns.link(ROOT_INODE, name, ino.id)
    return ino


async def committed_file(writes: WritePath, name: bytes, data: bytes) -> Inode:
    """A file whose content *data* is committed (confirmed), through the write path itself."""
    ino = new_file(writes.ns, name)
    of = writes.staged_for(ino, ROOT_KEY)
    await writes.write(of, 0, data)
    await writes.commit(of)
    return ino


def unconfirmed_rows(ns: Namespace) -> set[int]:
    """The ``unconfirmed`` table as stored (not only its in-memory mirror)."""
    return {r[0] for r in ns.db.execute("SELECT inode FROM unconfirmed")}


@pytest.mark.parametrize("total", [3000, BIG], ids=["in-memory", "staging-file"])
def test_sequential_writes_commit_the_blob_named_by_its_hash_and_tell_listeners_once(
        store: Store, writes: WritePath, listener: RecordingListener, total: int) -> None:
    """Writes in sequence keep a running hash that names the blob; each commit is told to listeners once."""
    data = os.urandom(total)

    async def t() -> None:
        ino = new_file(store.ns, b"f")
        of = writes.staged_for(ino, ROOT_KEY)
        step = 1000 if total < 10000 else 64 << 10
        for off in range(0, total, step):
            assert await writes.write(of, off, data[off:off + step]) == len(data[off:off + step])
        # the running-hash path: nothing needs reading back at commit
        assert of.hasher is not None and of.hashed == total
        assert (of.mem is None) == (total > MEM_STAGING_MAX)
        assert writes.staging_bytes() == total
        await writes.commit(of)
        digest = blake3.blake3(data).digest()
        assert ino.hash == digest and ino.size == total
        assert store.ns.get(ino.id).hash == digest
        assert store.cas.read(digest) == data
        assert store.ns.refcount(digest) == 1
        assert listener.commits == [(ino.id, digest, total)]
        assert ino.id not in writes.staged and writes.staging_bytes() == 0
        assert os.listdir(store.cas.staging) == []
        # a commit point with nothing written commits nothing and tells nobody
        await writes.commit_inode(ino.id)
        assert listener.commits == [(ino.id, digest, total)]

    trio.run(t)


@pytest.mark.parametrize("total", [3000, BIG], ids=["in-memory", "staging-file"])
def test_out_of_order_writes_still_commit_the_right_hash(store: Store, writes: WritePath, total: int) -> None:
    """A write that lands before the running hash's end drops it: the commit hashes the staged bytes."""
    data = os.urandom(total)
    half = total // 2

    async def t() -> None:
        ino = new_file(store.ns, b"f")
        of = writes.staged_for(ino, ROOT_KEY)
        await writes.write(of, half, data[half:])  # the second half first: a hole before it
        assert of.hasher is None
        await writes.write(of, 0, data[:half])
        await writes.commit(of)
        assert ino.hash == blake3.blake3(data).digest()
        assert store.cas.read(ino.hash) == data

    trio.run(t)


def test_truncate_to_zero_then_write_replaces_the_content(store: Store, writes: WritePath) -> None:
    """O_TRUNC then a write commits only the new bytes, and the old blob is collected."""
    async def t() -> None:
        ino = await committed_file(writes, b"f", b"old content, longer than the new")
        old = ino.hash
        assert old is not None and store.cas.exists(old)
        of = writes.staged_for(ino, ROOT_KEY)
        await writes.truncate(of, 0)
        assert of.size == 0 and of.hasher is not None  # starts a fresh running hash
        await writes.write(of, 0, b"new")
        await writes.commit(of)
        assert ino.hash == blake3.blake3(b"new").digest() and ino.size == 3
        assert store.cas.read(ino.hash) == b"new"
        assert not store.cas.exists(old) and store.ns.blob_info(old) is None

    trio.run(t)


def test_unconfirmed_commit_is_recorded_until_a_confirmed_commit_point(store: Store, writes: WritePath) -> None:
    """An idle-timer commit marks the inode unconfirmed (index and mirror); a later fsync/rename clears it."""
    async def t() -> None:
        ino = new_file(store.ns, b"f")
        of = writes.staged_for(ino, ROOT_KEY)
        await writes.write(of, 0, b"maybe a paused writer")
        await writes.commit(of, confirmed=False)
        assert ino.hash == blake3.blake3(b"maybe a paused writer").digest()
        assert ino.id in store.ns.unconfirmed and ino.id in unconfirmed_rows(store.ns)
        # a confirmed commit point with nothing new to commit still confirms
        await writes.commit_inode(ino.id, confirmed=True)
        assert ino.id not in store.ns.unconfirmed and ino.id not in unconfirmed_rows(store.ns)

    trio.run(t)


def test_fail_drops_staging_and_the_next_confirmed_commit_point_says_enospc_once(
        store: Store, writes: WritePath, listener: RecordingListener) -> None:
    """A file failed for room gives its staging back, keeps its old content, and reports ENOSPC exactly once."""
    async def t() -> None:
        ino = await committed_file(writes, b"f", b"v1")
        v1 = ino.hash
        listener.commits.clear()
        of = writes.staged_for(ino, ROOT_KEY)
        await writes.write(of, 0, os.urandom(BIG))
        assert writes.staging_bytes() == BIG and of.staging_path is not None
        await writes.fail(of)
        assert writes.staging_bytes() == 0
        assert writes.physical() == store.blobs.bytes
        assert ino.id in writes.failed and ino.id not in writes.staged
        assert os.listdir(store.cas.staging) == []
        # its next writes fail at once (no second slice of the cache for it)
        with pytest.raises(ContentDropped):
            await writes.write(writes.staged_for(ino, ROOT_KEY), 0, b"more")
        # unconfirmed commit points (idle timer, unmount) leave it failed
        await writes.commit_inode(ino.id, confirmed=False)
        await writes.commit_all()
        assert ino.id in writes.failed
        # the first confirmed one tells the writer, with ENOSPC ...
        with pytest.raises(ContentDropped) as e:
            await writes.commit_inode(ino.id, confirmed=True)
        assert e.value.errno == errno.ENOSPC
        assert ino.id not in writes.failed
        # ... and only once
        await writes.commit_inode(ino.id, confirmed=True)
        assert ino.hash == v1 and store.cas.read(v1) == b"v1"
        assert listener.commits == []

    trio.run(t)


def test_truncate_to_zero_starts_a_failed_file_over(store: Store, writes: WritePath) -> None:
    """After a failure for room, O_TRUNC clears the failed state and the file can be written and committed."""
    async def t() -> None:
        ino = new_file(store.ns, b"f")
        of = writes.staged_for(ino, ROOT_KEY)
        await writes.write(of, 0, b"x" * 100)
        await writes.fail(of)
        assert ino.id in writes.failed
        of = writes.staged_for(ino, ROOT_KEY)
        await writes.truncate(of, 0)
        assert ino.id not in writes.failed
        of = writes.staged_for(ino, ROOT_KEY)
        await writes.write(of, 0, b"second try")
        await writes.commit_inode(ino.id, confirmed=True)  # no ContentDropped
        assert ino.hash == blake3.blake3(b"second try").digest()

    trio.run(t)


def test_physical_is_blob_bytes_plus_staging_bytes(store: Store, writes: WritePath) -> None:
    """What the budget counts: unique committed blobs plus every byte being written, in memory or in files."""
    async def t() -> None:
        await committed_file(writes, b"a", b"A" * 1000)
        await committed_file(writes, b"dup", b"A" * 1000)  # the same blob: counted once
        assert store.blobs.bytes == 1000
        small = writes.staged_for(new_file(store.ns, b"small"), ROOT_KEY)
        await writes.write(small, 0, b"s" * 300)
        big = writes.staged_for(new_file(store.ns, b"big"), ROOT_KEY)
        await writes.write(big, 0, b"b" * BIG)
        assert writes.staging_bytes() == 300 + BIG
        assert writes.physical() == store.blobs.bytes + writes.staging_bytes() == 1000 + 300 + BIG
        await writes.truncate(big, 10)  # shrinking staging shrinks the total
        assert writes.physical() == 1000 + 300 + 10
        await writes.commit(small)
        assert writes.physical() == 1000 + 300 + 10 and store.blobs.bytes == 1300
        on_disk = sum(os.path.getsize(store.cas.path(d)) for d in store.cas.iter_digests())
        assert on_disk == store.blobs.bytes

    trio.run(t)


class KeepingWatcher:
    """A supervisor's view (``WriteWatcher`` with ``keeps_content``): the descriptor of each file's staging
    (a mirror's path is None)."""

    keeps_content = True

    def __init__(self) -> None:
        self.kept: dict[int, tuple[int, str | None]] = {}
        self.written: set[int] = set()
        self.lost_inodes: set[int] = set()
        self._mirrors: dict[int, int] = {}

    def staging(self, ino: int, fd: int, path: str) -> None:
        kept = self.kept.pop(ino, None)
        if kept is not None:
            os.close(kept[0])
        self.kept[ino] = (os.dup(fd), path)  # the supervisor's own copy, as SCM_RIGHTS gives it
        self.written.add(ino)

    def mirror(self, ino: int, content: bytes | bytearray | memoryview) -> int:
        fd = os.memfd_create("mirror")
        os.pwrite(fd, content, 0)
        self._mirrors[fd] = ino
        self.kept[ino] = (os.dup(fd), None)
        self.written.add(ino)
        return fd

    def unmirror(self, fd: int) -> None:
        ino = self._mirrors.pop(fd)
        os.close(fd)
        if ino in self.kept and self.kept[ino][1] is None:  # what was said of the inode since wins
            os.close(self.kept.pop(ino)[0])
            self.written.discard(ino)

    def writing(self, ino: int) -> None:
        self.written.add(ino)

    def lost(self, ino: int) -> None:
        self.lost_inodes.add(ino)

    def settled(self, ino: int) -> None:
        self.written.discard(ino)
        kept = self.kept.pop(ino, None)
        if kept is not None:
            os.close(kept[0])


@pytest.mark.parametrize("total", [3000, BIG], ids=["in-memory", "staging-file"])
def test_staging_outlives_the_daemon_and_a_successor_goes_on_from_it(store: Store, total: int) -> None:
    """Every write and truncate reaches the descriptor the watcher holds before it returns; a successor's
    write path adopts it and the file goes on as if nothing happened."""
    watcher = KeepingWatcher()
    dead = WritePath(store.ns, store.blobs, Stats(), trio.CapacityLimiter(2), [], watcher)
    first, rest = os.urandom(total), os.urandom(999)

    async def t() -> None:
        ino = new_file(store.ns, b"f")
        of = dead.staged_for(ino, ROOT_KEY)
        await dead.write(of, 0, first + b"to be cut")
        await dead.truncate(of, total)
        assert watcher.written == {ino.id}
        fd, path = watcher.kept[ino.id]
        assert os.pread(fd, total + 100, 0) == first and (path is None) == (total <= MEM_STAGING_MAX)
        # the daemon dies here (its own descriptors with it); a successor adopts what the watcher kept
        successor_watcher = KeepingWatcher()
        successor = WritePath(store.ns, store.blobs, Stats(), trio.CapacityLimiter(2), [], successor_watcher)
        successor.adopt(store.ns.get(ino.id), ROOT_KEY, fd, path)  # type: ignore[arg-type]
        of2 = successor.staged[ino.id]
        assert of2.size == total and of2.read(0, total + 10) == first
        await successor.write(of2, total, rest)
        await successor.commit(of2)
        committed = store.ns.get(ino.id)
        assert committed is not None and committed.size == total + len(rest)
        assert store.cas.read(committed.hash) == first + rest  # type: ignore[arg-type]
        assert successor_watcher.written == set() and successor_watcher.kept == {}

    trio.run(t)


class NoMirrors(KeepingWatcher):
    """A watcher that keeps content but has no mirror to give (a supervisor of older code, no memory files left)."""

    def mirror(self, ino: int, content: bytes | bytearray | memoryview) -> int:
        raise OSError(errno.ENOTSUP, "no mirrors here")


def test_content_staged_in_memory_goes_to_a_staging_file_when_no_mirror_can_be_had(store: Store) -> None:
    """A small file whose mirror cannot be had is staged in a staging file the watcher holds instead (never
    left where a crash loses it), and a successor goes on from that file."""
    watcher = NoMirrors()
    dead = WritePath(store.ns, store.blobs, Stats(), trio.CapacityLimiter(2), [], watcher)
    data = os.urandom(3000)

    async def t() -> None:
        ino = new_file(store.ns, b"f")
        of = dead.staged_for(ino, ROOT_KEY)
        await dead.write(of, 0, data[:1000])
        await dead.write(of, 1000, data[1000:])
        fd, path = watcher.kept[ino.id]
        assert path is not None and of.mem is None and os.pread(fd, 4000, 0) == data
        successor = WritePath(store.ns, store.blobs, Stats(), trio.CapacityLimiter(2), [], KeepingWatcher())
        successor.adopt(store.ns.get(ino.id), ROOT_KEY, fd, path)  # type: ignore[arg-type]
        await successor.commit(successor.staged[ino.id])
        assert store.cas.read(store.ns.get(ino.id).hash) == data  # type: ignore[union-attr,arg-type]

    trio.run(t)


def test_a_torn_file_keeps_its_content_and_its_writer_gets_eio_once(writes: WritePath) -> None:
    """A successor that got no content for a written file: writes fail, one commit point fails, O_TRUNC heals."""

    async def t() -> None:
        ino = await committed_file(writes, b"f", b"last committed")
        writes.torn({ino.id})
        assert writes.failed[ino.id] == errno.EIO
        with pytest.raises(ContentDropped) as e:
            await writes.commit_inode(ino.id)
        assert e.value.errno == errno.EIO
        await writes.commit_inode(ino.id)  # told once
        inode = writes.ns.get(ino.id)
        assert inode is not None and writes.cas.read(inode.hash) == b"last committed"  # type: ignore[arg-type]
        writes.torn({ino.id})
        of = writes.staged_for(inode, ROOT_KEY)
        await writes.truncate(of, 0)  # starting over
        assert ino.id not in writes.failed

    trio.run(t)


def test_a_successor_never_writes_into_a_blob_the_dead_daemons_commit_had_linked(store: Store) -> None:
    """A commit links a staging file into objects/; a daemon that dies before telling the supervisor hands
    on a descriptor of what is now a blob.  The successor goes on in a copy: the blob keeps its bytes."""
    watcher = KeepingWatcher()
    dead = WritePath(store.ns, store.blobs, Stats(), trio.CapacityLimiter(2), [], watcher)
    data = os.urandom(BIG)

    async def t() -> None:
        ino = new_file(store.ns, b"f")
        of = dead.staged_for(ino, ROOT_KEY)
        await dead.write(of, 0, data)
        fd, path = watcher.kept[ino.id]
        digest = blake3.blake3(data).digest()
        store.blobs.add(path, digest, len(data))  # the commit's link, then the daemon dies ("after_adopt")
        successor = WritePath(store.ns, store.blobs, Stats(), trio.CapacityLimiter(2), [], KeepingWatcher())
        successor.adopt(store.ns.get(ino.id), ROOT_KEY, fd, path)  # type: ignore[arg-type]
        of2 = successor.staged[ino.id]
        await successor.write(of2, 0, b"X" * 4096)  # the writer goes on
        assert store.cas.read(digest) == data
        await successor.commit(of2)
        assert store.cas.read(store.ns.get(ino.id).hash) == b"X" * 4096 + data[4096:]  # type: ignore[union-attr,arg-type]
        successor.shutdown()

    trio.run(t)


def test_writes_after_a_failed_commit_never_reach_the_blob_it_linked(store: Store, writes: WritePath,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """The index transaction of a commit fails after the staging file became a blob: the file goes on in a
    copy, and a retried commit stores what was written since."""
    data = os.urandom(BIG)

    async def t() -> None:
        ino = new_file(store.ns, b"f")
        of = writes.staged_for(ino, ROOT_KEY)
        await writes.write(of, 0, data)
        real = store.ns.set_content

        def full_disk(*args, **kwargs):
            monkeypatch.setattr(store.ns, "set_content", real)
            raise OSError(errno.ENOSPC, "No space left on device")

        monkeypatch.setattr(store.ns, "set_content", full_disk)
        with pytest.raises(OSError):
            await writes.commit(of)
        digest = blake3.blake3(data).digest()
        assert store.cas.read(digest) == data
        await writes.write(of, 0, b"Y" * 10)
        assert store.cas.read(digest) == data  # the blob did not change under its name
        await writes.commit(of)
        assert store.cas.read(store.ns.get(ino.id).hash) == b"Y" * 10 + data[10:]  # type: ignore[union-attr,arg-type]

    trio.run(t)


@pytest.mark.parametrize("total", [3000, BIG], ids=["in-memory", "staging-file"])
def test_a_change_made_along_a_commit_is_in_its_transaction(store: Store, writes: WritePath, total: int) -> None:
    """``along`` (a rename publishing the file) runs in the commit's own transaction: when it fails, the
    content stays uncommitted and staged, and no blob file or row is left for it; when it succeeds, the
    content and the change are in the index together, and its result is returned."""
    data = os.urandom(total)
    digest = blake3.blake3(data).digest()

    def refused() -> None:
        with store.ns.txn():
            store.ns.link(ROOT_INODE, b"other", ino.id)
        raise OSError(errno.EEXIST, "refused")

    def renamed() -> str:
        store.ns.move(ROOT_INODE, b"tmp", ROOT_INODE, b"final")
        return "renamed"

    async def t() -> None:
        nonlocal ino
        ino = new_file(store.ns, b"tmp")
        of = writes.staged_for(ino, ROOT_KEY)
        await writes.write(of, 0, data)
        with pytest.raises(OSError):
            await writes.commit(of, along=refused)
        assert store.ns.get(ino.id).hash is None and ino.hash is None
        assert store.ns.lookup(ROOT_INODE, b"other") is None  # rolled back with the content
        assert of.dirty and of.has_staging and writes.staged[ino.id] is of
        if total <= MEM_STAGING_MAX:  # the file written ahead of its row went with the transaction
            assert not store.cas.exists(digest) and store.ns.refcount(digest) is None
        assert await writes.commit_inode(ino.id, along=renamed) == "renamed"
        assert store.ns.lookup(ROOT_INODE, b"final") == ino.id and store.ns.lookup(ROOT_INODE, b"tmp") is None
        assert store.ns.get(ino.id).hash == digest and store.cas.read(digest) == data
        assert store.ns.refcount(digest) == 1
        # nothing left to commit: the change still happens, in a transaction of its own
        assert await writes.commit_inode(ino.id, along=lambda: store.ns.move(ROOT_INODE, b"final", ROOT_INODE,
                                                                            b"again")) is None
        assert store.ns.lookup(ROOT_INODE, b"again") == ino.id

    ino: Inode
    trio.run(t)


def test_a_blob_written_from_memory_with_no_row_is_deleted_by_the_first_collection_after_a_crash(
        tmp_path, store: Store) -> None:
    """Content staged in memory is written as a blob file before its row: a crash between the two leaves a
    file no row names, which the collection after the unclean stop deletes (and counts nothing for)."""
    from mithrilfs.store.open import open_store

    data = b"written, never recorded" * 100
    digest = blake3.blake3(data).digest()
    store.cas.write_blob(digest, data)  # the commit's first step; the daemon dies before its transaction
    root = store.root
    os.close(store.lock_fd)
    store.lock_fd = -1
    store.ns.close()
    again = open_store(root)
    try:
        assert again.unclean
        again.collect_garbage()
        assert not again.cas.exists(digest) and again.blobs.bytes == 0
    finally:
        again.close()
