"""Commits: how an inode's staging content (``staging``) becomes its committed content, crash-safely.

A commit hashes the staging content (the running blake3 when writes came
in sequence; off the event loop for large files), puts the bytes into
``objects/`` and only then points the inode at the hash in one
transaction.  Content staged in memory is written under a temporary name
and renamed, and its blob row goes in that same transaction
(``Blobs.adding_data``); a staging file is hard-linked after a
transaction of its own records a refcount-0 intent row (``Blobs.add``).
A rename publishing the file joins the transaction too (``along``).
Until that transaction the inode keeps its last committed content, so a
crash never exposes a torn file.

With no close to commit at, the commit points are those the frameworks
give (``fs`` calls them): a rename of the file, fsync, link, chmod, FORGET
(no process has it open any more), and a clean unmount; and the idle timer
(``idle``): no write for ``IDLE_COMMIT_SECONDS``.  A commit nothing
confirmed (idle timer, unmount) is recorded as unconfirmed in the index,
because it may be a snapshot of a writer that only paused; an unclean stop
drops those names.  A file whose writes failed for room (``staging``)
raises ``ContentDropped`` at its next confirmed commit point, once.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Protocol, TypeVar

import trio

from mithrilfs.cache.staged import ContentDropped, Held, Staged
from mithrilfs.cache.staging import OFFLOAD_MIN, Staging
from mithrilfs.cache.write_watcher import WriteWatcher
from mithrilfs.crash_points import crash_point
from mithrilfs.observe.stats import Stats
from mithrilfs.store.blobs import Blobs
from mithrilfs.store.cas import CAS, hash_bytes, hash_file
from mithrilfs.store.namespace import Namespace

log = logging.getLogger(__name__)

T = TypeVar("T")

#: An inode with no write for this long is committed (unconfirmed) by the idle timer.
IDLE_COMMIT_SECONDS = 1.0
#: The idle timer commits at most this many files staged in memory in one batch (``commit_idle``).
COMMIT_BATCH_MAX = 512

class CommitListener(Protocol):
    """Told after every commit (the budget keeps to itself, the shared tier publishes)."""

    async def committed(self, of: Staged) -> None: ...


class WritePath(Staging):
    """Inodes being written (``Staging``), and their commits."""

    def __init__(self, ns: Namespace, blobs: Blobs, stats: Stats, limiter: trio.CapacityLimiter,
                 listeners: Sequence[CommitListener], watcher: WriteWatcher | None = None) -> None:
        super().__init__(blobs.cas, limiter, watcher)
        self.ns = ns
        self.blobs = blobs
        self.stats = stats
        #: Told after every commit (the budget, the shared tier): wiring fills the list.
        self.listeners = listeners

    def physical(self) -> int:
        """Bytes the store holds on disk: unique blobs plus content being written (what the budget counts)."""
        return self.blobs.bytes + self._bytes

    async def commit(self, of: Staged, *, confirmed: bool = True, along: Callable[[], T] | None = None) -> T | None:
        """Make the staging content the inode's committed content (see module doc).

        *confirmed*: the caller knows the content is whole (rename, fsync,
        chmod, link, forget); an idle-timer or unmount commit is not, and
        is recorded as unconfirmed.  With nothing to commit, a confirmation
        still clears an earlier unconfirmed mark.  A file whose writes
        failed for room raises ``ContentDropped`` at its next confirmed commit.
        *along*: an index change made in the transaction that points the
        inode at its content (a rename publishing the file), or in one of
        its own when there is nothing to commit; returns what it returns.
        Should it fail, the content stays uncommitted, as it was.
        """
        if of.inode.id in self.failed:
            self._settle_failed(of.inode.id, confirmed)
            return self._alone(along)
        if not of.dirty or not of.has_staging or of.inode.nlink == 0:
            # nothing written, or no name can ever show it (dropped at forget)
            self._settled(of, confirmed)
            return self._alone(along)
        async with Held(of.lock):
            if not of.dirty or not of.has_staging or of.inode.nlink == 0:
                self._settled(of, confirmed)
                return self._alone(along)
            gen, size, path, mem = of.write_gen, of.size, of.staging_path, of.mem
            if of.hasher is not None and of.hashed == size:
                digest = of.hasher.digest()
            elif mem is not None:
                digest = hash_bytes(mem)
            elif size >= OFFLOAD_MIN:
                assert path is not None
                digest = await trio.to_thread.run_sync(hash_file, path, limiter=self._limiter)
                if of.write_gen != gen or of.staging_path != path or of.inode.nlink == 0:
                    return self._alone(along)  # changed meanwhile: a later commit point takes the newer content
            else:
                assert path is not None
                digest = hash_file(path)
            crash_point("before_intent")
            old = of.inode.hash
            if mem is not None:
                # the blob's row goes in the transaction that points the inode at it
                with self.blobs.adding_data(mem, digest, between=crash_point) as new:
                    result = self._point(of, digest, size, confirmed, along)
            else:
                new = self.blobs.add(path, digest, size, between=crash_point)  # type: ignore[arg-type]
                crash_point("after_adopt")
                # until this transaction succeeds the staging file stays, so a
                # failed attempt (disk full) can simply be retried
                try:
                    with self.ns.txn():
                        result = self._point(of, digest, size, confirmed, along)
                except BaseException:
                    self._unshare(of)
                    raise
            if not new:
                self.stats.add(of.top, "dedup_hits")
            of.deduped = not new
            crash_point("after_set_content")
            self.stats.add(of.top, "commits")
            self._drop_staging(of)
            self._clean(of)
            self._forget_if_settled(of)
            if old != digest:
                self.blobs.collect(old)
        await self._tell_committed(of)
        return result

    def _point(self, of: Staged, digest: bytes, size: int, confirmed: bool, along: Callable[[], T] | None) -> T | None:
        """Inside a commit's transaction: the inode's content is the blob *digest*, then *along*."""
        self.ns.set_content(of.inode, digest, size, of.mtime_ns, confirmed=confirmed)
        return along() if along is not None else None

    def _alone(self, along: Callable[[], T] | None) -> T | None:
        """*along* of a commit with nothing to commit: in a transaction of its own."""
        if along is None:
            return None
        with self.ns.txn():
            return along()

    async def _tell_committed(self, of: Staged) -> None:
        for listener in self.listeners:
            await listener.committed(of)

    def _settled(self, of: Staged, confirmed: bool) -> None:
        if confirmed and of.inode.nlink > 0:
            self.ns.confirm(of.inode.id)
        self._forget_if_settled(of)

    async def commit_inode(self, ino: int, *, confirmed: bool = True, along: Callable[[], T] | None = None) -> T | None:
        """Commit an inode's uncommitted writes, if it has any; confirm its content either way.

        *along*: as for ``commit``, in a transaction of its own when the inode has nothing to commit.
        """
        of = self.staged.get(ino)
        if of is not None:
            return await self.commit(of, confirmed=confirmed, along=along)
        if ino in self.failed:
            self._settle_failed(ino, confirmed)
        elif confirmed:
            self.ns.confirm(ino)
        return self._alone(along)

    def _settle_failed(self, ino: int, confirmed: bool) -> None:
        """A commit point of a file whose writes failed for room: a confirmed one tells the writer, once."""
        if confirmed:
            code = self.failed.pop(ino)
            self.watcher.settled(ino)
            raise ContentDropped(ino, code)

    async def commit_idle(self, ofs: list[Staged]) -> list[Staged]:
        """Commit idle files staged in memory in batches, unconfirmed; returns the rest (committed one by one).

        The idle timer finds many small files at once (thousands while a
        compile writes its cache): their intent rows go in one transaction,
        their blob files are written by one worker thread while the event
        loop goes on answering requests, and the inodes point at them in one
        more transaction: two transactions per batch instead of two per
        file, and no blob creation on the event loop.  The order of each
        file's steps, and so what a crash can leave, is that of ``commit``.
        Each file's lock is held throughout, so writes to it wait.
        """
        rest = []
        for start in range(0, len(ofs), COMMIT_BATCH_MAX):
            rest.extend(await self._commit_batch(ofs[start:start + COMMIT_BATCH_MAX]))
        return rest

    async def _commit_batch(self, ofs: list[Staged]) -> list[Staged]:
        """``commit_idle`` of one batch: files not staged in memory (or busy meanwhile) are returned."""
        batch: list[tuple[Staged, bytearray, bytes]] = []
        rest = []
        for of in ofs:
            if of.mem is None or not of.dirty or of.inode.nlink == 0 or of.busy():
                rest.append(of)
                continue
            of.lock.acquire_nowait()
            digest = of.hasher.digest() if of.hasher is not None and of.hashed == of.size else hash_bytes(of.mem)
            batch.append((of, of.mem, digest))
        if not batch:
            return rest
        done: list[tuple[Staged, bytearray, bytes]] = []
        try:
            for _ in batch:
                crash_point("before_intent")
            self.blobs.intend([(digest, len(mem)) for _, mem, digest in batch])
            for _ in batch:
                crash_point("after_intent")
            jobs = [(digest, mem, digest in self.blobs.verified) for _, mem, digest in batch]
            written, error = await trio.to_thread.run_sync(_write_blobs, self.cas, jobs, limiter=self._limiter)
            if error is not None:
                log.warning("idle commit: writing a blob failed (%s); committing one by one", error)
            for (of, mem, digest), new in zip(batch, written):
                self.blobs.written(digest, len(mem), new)
                crash_point("after_adopt")
                if not new:
                    self.stats.add(of.top, "dedup_hits")
                of.deduped = not new
                if of.mem is mem and of.inode.nlink > 0:  # else dropped meanwhile: its blob is collected below
                    done.append((of, mem, digest))
            rest.extend(of for of, _, _ in batch[len(written):])
            olds = [of.inode.hash for of, _, _ in done]
            with self.ns.txn():
                for of, mem, digest in done:
                    self.ns.set_content(of.inode, digest, len(mem), of.mtime_ns, confirmed=False)
            for of, _, _ in done:
                crash_point("after_set_content")
                self.stats.add(of.top, "commits")
                self._drop_staging(of)
                self._clean(of)
        finally:
            for of, _, _ in batch:
                of.lock.release()
        for (of, _, digest), old in zip(done, olds):
            self._forget_if_settled(of)
            if old != digest:
                self.blobs.collect(old)
        for _, _, digest in batch[:len(written)]:
            self.blobs.collect(digest)  # only when nothing points at it (its inode went meanwhile)
        for of, _, _ in done:
            await self._tell_committed(of)
        return rest

    async def commit_all(self) -> None:
        """A clean unmount (or the ``commit`` control file): commit everything written, unconfirmed
        (a writer may have been cut off)."""
        for of in list(self.staged.values()):
            await self.commit(of, confirmed=False)


def _write_blobs(cas: CAS, jobs: list[tuple[bytes, bytearray, bool]]) -> tuple[list[bool], BaseException | None]:
    """Write (digest, data, trust_existing) blobs in a worker thread; (new per blob written, the error that
    stopped it, if any)."""
    written = []
    for digest, data, trust in jobs:
        try:
            written.append(cas.write_blob(digest, data, trust_existing=trust))
        except OSError as e:
            return written, e
    return written, None
