"""Staging and commit: how written bytes become an inode's committed content, crash-safely.

The kernel opens and closes files itself (the filesystem answers OPEN and
FLUSH with ENOSYS), so there are no handles here: WRITE, SETATTR and READ
carry the inode, and the write state is per inode (``Staged``).  Content of
a regular file is either a committed blob (``Inode.hash``; None means empty)
or, while it is being written, a staging file.  Staging is created on the
first write or truncate (a copy of the blob unless the write starts from
empty).  A commit hashes it (a running blake3 while writes arrive in
sequence; off the event loop for large files), records a refcount-0 intent
row, hard-links it into ``objects/`` (``Blobs.add``), and only then points
the inode at the hash in one transaction.  Until that transaction the inode
keeps its last committed content, so a crash never exposes a torn file.

With no close to commit at, the commit points are those the frameworks
give (``fs`` calls them): a rename of the file, fsync, link, chmod, FORGET
(no process has it open any more), and a clean unmount; and the idle timer
(``idle``): no write for ``IDLE_COMMIT_SECONDS``.  A commit nothing
confirmed (idle timer, unmount) is recorded as unconfirmed in the index,
because it may be a snapshot of a writer that only paused; an unclean stop
drops those names.

A write that finds no room on the store's disk even after one slice of
the cache was evicted for its file (``fs``) fails the file (``fail``): its
staging and write state are dropped at once, so a writer that can never
fit gives back what it took instead of leaving the disk full, and the inode
keeps its last committed content.  The inode is then in ``failed`` (not a
``Staged``: it neither pins the inode against eviction nor counts as being
written): its next writes fail at once (no more eviction for a file that
already failed; a write that was waiting for the file's lock too), its next
confirmed commit point fails once with ENOSPC (``ContentDropped``) so the
writer learns its content was not kept, unconfirmed commits (idle timer,
unmount, ``commit``) leave it alone, and a truncate to empty starts it over.

Writes of ``WRITE_OFFLOAD_MIN`` and more copy and hash in a worker thread;
a file's own lock orders them against truncates and commits and keeps the
running hash in arrival order.  The code re-checks what it relies on after
every ``await``.
"""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import time
from dataclasses import dataclass
from typing import Any, AsyncIterator, Awaitable, Callable

import blake3
import trio

from .blobs import Blobs
from .cas import hash_file
from .namespace import Inode, Namespace
from .stats import ROOT_KEY, Stats

#: Files at least this large are hashed and copied off the event loop.
OFFLOAD_MIN = 1 << 20
#: Writes this big copy and hash off the event loop.
WRITE_OFFLOAD_MIN = 256 << 10
#: An inode with no write for this long is committed (unconfirmed) by the idle timer.
IDLE_COMMIT_SECONDS = 1.0

#: Crash-safety tests set MITHRILFS_TEST_CRASH_AT=POINT:N to SIGKILL the
#: daemon the Nth time the write path reaches POINT.
_CRASH_AT = os.environ.get("MITHRILFS_TEST_CRASH_AT")
_crash_hits: dict[str, int] = {}


def crash_point(name: str) -> None:
    if _CRASH_AT is None:
        return
    point, _, nth = _CRASH_AT.partition(":")
    if point == name:
        _crash_hits[name] = _crash_hits.get(name, 0) + 1
        if _crash_hits[name] >= int(nth or 1):
            os.kill(os.getpid(), signal.SIGKILL)


class ContentDropped(OSError):
    """A commit point of a file whose writes failed for room: its content was dropped, not committed.

    An ENOSPC that must not make room again: the file already had its slice.
    """

    def __init__(self, ino: int) -> None:
        super().__init__(errno.ENOSPC, f"inode {ino}: its writes failed for room and its content was dropped")


async def _acquire(lock: trio.Lock) -> None:
    """Take a free lock without yielding to trio.

    ``trio.Lock.acquire`` always checkpoints; here almost every acquire finds
    the lock free, and a handler that never yields is answered without a
    task switch (see ``kernel.session``).
    """
    try:
        lock.acquire_nowait()
    except trio.WouldBlock:
        await lock.acquire()


class _Held:
    """``async with _Held(lock)``: the lock, taken by ``_acquire``."""

    __slots__ = ("lock",)

    def __init__(self, lock: trio.Lock) -> None:
        self.lock = lock

    async def __aenter__(self) -> None:
        await _acquire(self.lock)

    async def __aexit__(self, *exc: object) -> None:
        self.lock.release()


@dataclass(eq=False)
class Staged:
    """Write state of an inode from its first write or truncate until its commit."""

    inode: Inode
    #: Top-level directory the file lives under, for per-directory stats.
    top: str = ROOT_KEY
    size: int = 0
    mtime_ns: int = 0
    staging_fd: int | None = None
    staging_path: str | None = None
    dirty: bool = False
    #: Bumped by every change to staging; a commit whose hash was computed
    #: before the latest change is abandoned.
    write_gen: int = 0
    #: blake3 of the staging content while it is written strictly in
    #: sequence from offset 0 (``hashed`` bytes so far), so a commit need not
    #: read it back; None once a write or truncate lands anywhere else.
    hasher: Any = None
    hashed: int = 0
    #: time.monotonic() of the last write or truncate, for the idle timer.
    changed: float = 0.0
    #: The file already had a slice of the cache evicted for it (a full disk): never a second.
    room_made: bool = False
    _lock: trio.Lock | None = None

    @property
    def lock(self) -> trio.Lock:
        """Orders staging changes made from worker threads; made on first use (most opens only read)."""
        if self._lock is None:
            self._lock = trio.Lock()
        return self._lock

    def busy(self) -> bool:
        return self._lock is not None and self._lock.locked()

    def awaited(self) -> bool:
        """Another request waits for this file's lock (and so still holds this object)."""
        return self._lock is not None and self._lock.statistics().tasks_waiting > 0


class WritePath:
    """Inodes being written, their staging files, and commits."""

    def __init__(self, ns: Namespace, blobs: Blobs, stats: Stats, limiter: trio.CapacityLimiter,
                 committed: Callable[[Staged], Awaitable[None]]) -> None:
        self.ns = ns
        self.blobs = blobs
        self.cas = blobs.cas
        self.stats = stats
        self._limiter = limiter
        #: Called after every commit (shared-tier upload, budget check).
        self._committed = committed
        self.staged: dict[int, Staged] = {}
        #: Inodes whose writes failed for room (see the module doc).
        self.failed: set[int] = set()

    def staged_for(self, ino: Inode, top: str) -> Staged:
        of = self.staged.get(ino.id)
        if of is None:
            of = Staged(inode=ino, top=top, size=ino.size, mtime_ns=ino.mtime_ns)
            self.staged[ino.id] = of
        return of

    def staging_bytes(self) -> int:
        return sum(of.size for of in self.staged.values() if of.staging_fd is not None)

    def drop(self, ino: int) -> None:
        """Forget an inode's uncommitted content (it lost its last name and the kernel forgot it)."""
        self.failed.discard(ino)
        of = self.staged.pop(ino, None)
        if of is not None:
            self._drop_staging_file(of)
            of.dirty = False

    def idle(self, quiet_since: float) -> list[Staged]:
        """Written inodes with no write or truncate since *quiet_since* (monotonic), not busy."""
        return [of for of in self.staged.values() if of.dirty and of.changed < quiet_since and not of.busy()]

    async def fail(self, of: Staged) -> None:
        """A write found no room even after a slice of the cache went: drop what was staged (module doc)."""
        async with _Held(of.lock):
            self.failed.add(of.inode.id)
            self._drop_staging_file(of)
            of.dirty = False
            of.write_gen += 1
            if self.staged.get(of.inode.id) is of:
                del self.staged[of.inode.id]

    @staticmethod
    def _drop_staging_file(of: Staged) -> None:
        of.hasher = None
        if of.staging_fd is not None:
            os.close(of.staging_fd)
            try:
                os.unlink(of.staging_path)  # type: ignore[arg-type]
            except FileNotFoundError:
                pass
        of.staging_fd = of.staging_path = None

    async def ensure_staging(self, of: Staged, *, empty: bool = False) -> int:
        """The inode's staging fd, starting as a copy of its blob unless *empty*."""
        if of.staging_fd is not None:
            return of.staging_fd
        async with _Held(of.lock):
            if of.staging_fd is not None:
                return of.staging_fd
            if of.inode.id in self.failed:  # it failed while this request waited for the lock
                self._forget_if_settled(of)
                raise ContentDropped(of.inode.id)
            digest, size = of.inode.hash, of.inode.size
            copy = digest is not None and size > 0 and not empty
            fd, path = self.cas.new_staging()
            try:
                if copy:
                    src = self.cas.open(digest)  # type: ignore[arg-type]
                    try:
                        if size >= OFFLOAD_MIN:
                            await trio.to_thread.run_sync(_copy_fd, src, fd, size, limiter=self._limiter)
                        else:
                            _copy_fd(src, fd, size)
                    finally:
                        os.close(src)
            except BaseException:
                os.close(fd)
                os.unlink(path)
                raise
            of.staging_fd, of.staging_path = fd, path
            of.size = size if copy else 0
            of.hasher = None if copy else blake3.blake3(max_threads=blake3.blake3.AUTO)
            of.hashed = 0
            return fd

    @contextlib.asynccontextmanager
    async def staging_locked(self, of: Staged, *, empty: bool = False) -> AsyncIterator[int]:
        """Hold the file lock with a staging file in place (a commit may drop it while we wait)."""
        while True:
            await self.ensure_staging(of, empty=empty)
            await _acquire(of.lock)
            if of.staging_fd is not None:
                break
            of.lock.release()
        try:
            yield of.staging_fd
        finally:
            of.lock.release()

    async def write(self, of: Staged, off: int, buf: Any) -> int:
        """Write *buf* at *off* into the inode's staging file (the kernel already placed O_APPEND writes)."""
        if of.staging_fd is None:
            await self.ensure_staging(of)
        offload = len(buf) >= WRITE_OFFLOAD_MIN
        if offload or of.busy():
            # big writes copy and hash in a worker thread, so the event loop
            # takes the next request meanwhile; the file lock keeps this
            # file's writes, truncates and commits (and the running hash) in order
            async with self.staging_locked(of):
                return await self._write_staging(of, off, buf, offload=offload)
        return await self._write_staging(of, off, buf, offload=False)

    async def _write_staging(self, of: Staged, off: int, buf: Any, *, offload: bool) -> int:
        fd = of.staging_fd
        assert fd is not None
        hasher = of.hasher if of.hasher is not None and off == of.hashed else None
        if hasher is None:
            of.hasher = None
        if offload:
            n = await trio.to_thread.run_sync(_pwrite_hash, fd, buf, off, hasher)
        else:
            n = _pwrite_hash(fd, buf, off, hasher)
        if hasher is not None and of.hasher is hasher:
            of.hashed += n
        if off + n > of.size:
            of.size = off + n
        of.mtime_ns = time.time_ns()
        of.changed = time.monotonic()
        of.dirty = True
        of.write_gen += 1
        return n

    async def truncate(self, of: Staged, size: int) -> None:
        if size == 0:  # starting over (O_TRUNC): a file whose writes failed for room may try again
            self.failed.discard(of.inode.id)
        if size == of.size and of.staging_fd is None:
            self._forget_if_settled(of)
            return  # no change (O_TRUNC of an empty lock file): nothing to commit
        async with self.staging_locked(of, empty=size == 0) as fd:
            os.ftruncate(fd, size)
            if size == 0:
                of.hasher, of.hashed = blake3.blake3(max_threads=blake3.blake3.AUTO), 0
            elif size != of.hashed:
                of.hasher = None
            of.size = size
            of.mtime_ns = time.time_ns()
            of.changed = time.monotonic()
            of.dirty = True
            of.write_gen += 1

    async def commit(self, of: Staged, *, confirmed: bool = True) -> None:
        """Make the staging content the inode's committed content (see module doc).

        *confirmed*: the caller knows the content is whole (rename, fsync,
        chmod, link, forget); an idle-timer or unmount commit is not, and
        is recorded as unconfirmed.  With nothing to commit, a confirmation
        still clears an earlier unconfirmed mark.  A file whose writes
        failed for room raises ``ContentDropped`` at its next confirmed commit.
        """
        if of.inode.id in self.failed:
            self._settle_failed(of.inode.id, confirmed)
            return
        if not of.dirty or of.staging_fd is None or of.inode.nlink == 0:
            # nothing written, or no name can ever show it (dropped at forget)
            self._settled(of, confirmed)
            return
        async with _Held(of.lock):
            if not of.dirty or of.staging_fd is None or of.inode.nlink == 0:
                self._settled(of, confirmed)
                return
            gen, size, path = of.write_gen, of.size, of.staging_path
            assert path is not None
            if of.hasher is not None and of.hashed == size:
                digest = of.hasher.digest()
            elif size >= OFFLOAD_MIN:
                digest = await trio.to_thread.run_sync(hash_file, path, limiter=self._limiter)
                if of.write_gen != gen or of.staging_path != path or of.inode.nlink == 0:
                    return  # changed meanwhile: a later commit point takes the newer content
            else:
                digest = hash_file(path)
            crash_point("before_intent")
            if not self.blobs.add(path, digest, size, between=crash_point):
                self.stats.add(of.top, "dedup_hits")
            crash_point("after_adopt")
            old = of.inode.hash
            # until this transaction succeeds the staging file stays, so a
            # failed attempt (disk full) can simply be retried
            with self.ns.txn():
                self.ns.set_content(of.inode, digest, size, of.mtime_ns, confirmed=confirmed)
            crash_point("after_set_content")
            self.stats.add(of.top, "commits")
            self._drop_staging_file(of)
            of.dirty = False
            self._forget_if_settled(of)
            if old != digest:
                self.blobs.collect(old)
        await self._committed(of)

    def _settled(self, of: Staged, confirmed: bool) -> None:
        if confirmed and of.inode.nlink > 0:
            self.ns.confirm(of.inode.id)
        self._forget_if_settled(of)

    def _forget_if_settled(self, of: Staged) -> None:
        """Drop the write state of an inode with nothing uncommitted, unless a request waits on its lock."""
        if of.staging_fd is None and not of.awaited() and self.staged.get(of.inode.id) is of:
            del self.staged[of.inode.id]

    async def commit_inode(self, ino: int, *, confirmed: bool = True) -> None:
        """Commit an inode's uncommitted writes, if it has any; confirm its content either way."""
        of = self.staged.get(ino)
        if of is not None:
            await self.commit(of, confirmed=confirmed)
        elif ino in self.failed:
            self._settle_failed(ino, confirmed)
        elif confirmed:
            self.ns.confirm(ino)

    def _settle_failed(self, ino: int, confirmed: bool) -> None:
        """A commit point of a file whose writes failed for room: a confirmed one tells the writer, once."""
        if confirmed:
            self.failed.discard(ino)
            raise ContentDropped(ino)

    async def commit_all(self) -> None:
        """A clean unmount (or the ``commit`` control file): commit everything written, unconfirmed
        (a writer may have been cut off)."""
        for of in list(self.staged.values()):
            await self.commit(of, confirmed=False)

    def shutdown(self) -> None:
        """Drop staging that could not be committed; the next mount clears leftover files anyway."""
        for ino in list(self.staged):
            self.drop(ino)


def _pwrite_hash(fd: int, buf: Any, off: int, hasher: Any) -> int:
    """Write *buf* at *off* and feed what was written to the running *hasher* (if any)."""
    n = os.pwrite(fd, buf, off)
    if hasher is not None:
        hasher.update(buf if n == len(buf) else memoryview(buf)[:n])
    return n


def _copy_fd(src: int, dst: int, size: int) -> None:
    off = 0
    while off < size:
        n = os.copy_file_range(src, dst, size - off, off, off)
        if n == 0:
            break
        off += n
