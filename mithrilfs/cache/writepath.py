"""Staging and commit: how written bytes become an inode's committed content, crash-safely.

The kernel opens and closes files itself (the filesystem answers OPEN and
FLUSH with ENOSYS), so there are no handles here: WRITE, SETATTR and READ
carry the inode, and the write state is per inode (``Staged``).  Content of
a regular file is either a committed blob (``Inode.hash``; None means empty)
or, while it is being written, staging content.  Staging is created on the
first write or truncate (a copy of the blob unless the write starts from
empty).  Small files are staged in memory (``MEM_STAGING_MAX``): a compile
cache writes thousands of them, and a staging file is an inode to allocate,
link and unlink on the backing filesystem for each; a file that grows past
it (or past the memory cap) moves to a staging file in ``staging/``.  A
commit hashes it (a running blake3 while writes arrive in sequence; off the
event loop for large files), records a refcount-0 intent row, puts the
bytes into ``objects/`` (``Blobs.add_data``: written under a temporary name
and renamed; ``Blobs.add``: the staging file hard-linked), and only then
points the inode at the hash in one transaction.  Until that transaction the inode
keeps its last committed content, so a crash never exposes a torn file.

With no close to commit at, the commit points are those the frameworks
give (``fs`` calls them): a rename of the file, fsync, link, chmod, FORGET
(no process has it open any more), and a clean unmount; and the idle timer
(``idle``): no write for ``IDLE_COMMIT_SECONDS``.  A commit nothing
confirmed (idle timer, unmount) is recorded as unconfirmed in the index,
because it may be a snapshot of a writer that only paused; an unclean stop
drops those names.

A write that finds no room on the store's disk even after one slice of
the cache was evicted for its file (``Budget.write``) fails the file (``fail``): its
staging and write state are dropped at once, so a writer that can never
fit gives back what it took instead of leaving the disk full, and the inode
keeps its last committed content.  The inode is then in ``failed`` (not a
``Staged``: it neither pins the inode against eviction nor counts as being
written): its next writes fail at once (no more eviction for a file that
already failed; a write that was waiting for the file's lock too), its next
confirmed commit point fails once with ENOSPC (``ContentDropped``) so the
writer learns its content was not kept, unconfirmed commits (idle timer,
unmount, ``commit``) leave it alone, and a truncate to empty starts it over.
Staging outlives the daemon.  With a supervisor (``WriteWatcher`` with
``keeps_content``) every inode's staging content is also in a file
descriptor the supervisor holds: the staging file itself, or, for content
staged in memory, a memfd mirror that every write and truncate updates
before its reply.  A daemon that takes over after a crash adopts them
(``adopt``): they hold exactly what the kernel was told was written (a
request the dead daemon had not answered is resent and done again, and
writes and truncates are idempotent).  Only a file whose content the old
daemon had already dropped (failed for room) is left ``torn``: the same
state as a file that failed, with EIO.

Writes of ``WRITE_OFFLOAD_MIN`` and more copy and hash in a worker thread;
a file's own lock orders them against truncates and commits and keeps the
running hash in arrival order.  The code re-checks what it relies on after
every ``await``.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import signal
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import blake3
import trio

from mithrilfs.observe.stats import ROOT_KEY, Stats
from mithrilfs.store.blobs import Blobs
from mithrilfs.store.cas import CAS, hash_bytes, hash_file
from mithrilfs.store.namespace import Inode, Namespace

log = logging.getLogger(__name__)

#: Files at least this large are hashed and copied off the event loop.
OFFLOAD_MIN = 1 << 20
#: Writes this big copy and hash off the event loop.
WRITE_OFFLOAD_MIN = 256 << 10
#: An inode with no write for this long is committed (unconfirmed) by the idle timer.
IDLE_COMMIT_SECONDS = 1.0
#: Files up to this size are staged in memory rather than in a staging file (see module doc).
MEM_STAGING_MAX = WRITE_OFFLOAD_MIN
#: At most this many bytes are staged in memory at once; beyond, staging goes to files.
MEM_STAGING_TOTAL = 64 << 20
#: The idle timer commits at most this many files staged in memory in one batch (``commit_idle``).
COMMIT_BATCH_MAX = 512

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
    """A commit point of a file whose uncommitted content was dropped: the writer learns it here, once.

    ENOSPC for writes that failed for room (an error that must not make
    room again: the file already had its slice); EIO for content that died
    with a previous daemon (``torn``).
    """

    def __init__(self, ino: int, code: int = errno.ENOSPC) -> None:
        why = "its writes failed for room" if code == errno.ENOSPC else "its writes died with the previous daemon"
        super().__init__(code, f"inode {ino}: {why} and its content was dropped")


class WriteWatcher(Protocol):
    """Told what is being written, so that a daemon taking over after a crash can go on (module doc).

    ``staging``: the inode's staging content now lives in *fd* (the staging
    file at *path*, or a memfd mirror when *path* is None), which also means
    it is being written; ``writing``: it has uncommitted writes (said only
    when ``staging`` was not); ``lost``: its uncommitted content was dropped
    and its writer not told yet; ``settled``: nothing uncommitted is left.
    """

    #: Whether staging content must be kept where it outlives the daemon (memfd mirrors).
    keeps_content: bool

    def staging(self, ino: int, fd: int, path: str | None) -> None: ...

    def writing(self, ino: int) -> None: ...

    def lost(self, ino: int) -> None: ...

    def settled(self, ino: int) -> None: ...


class NoWriteWatcher:
    """Nobody keeps anything (no supervisor: tools, tests, a daemon that detaches on a crash)."""

    keeps_content = False

    def staging(self, ino: int, fd: int, path: str | None) -> None:
        pass

    def writing(self, ino: int) -> None:
        pass

    def lost(self, ino: int) -> None:
        pass

    def settled(self, ino: int) -> None:
        pass


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
    #: Staging content held in memory (a small file), instead of a staging file.
    mem: bytearray | None = None
    #: A memfd with the same content as ``mem``, kept for a successor daemon (``WriteWatcher.keeps_content``).
    mirror_fd: int | None = None
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
    #: Its last commit found the blob already in the store (``recompiles`` asks).
    deduped: bool = False
    _lock: trio.Lock | None = None

    @property
    def lock(self) -> trio.Lock:
        """Orders staging changes made from worker threads; made on first use (most opens only read)."""
        if self._lock is None:
            self._lock = trio.Lock()
        return self._lock

    @property
    def has_staging(self) -> bool:
        """The inode has staging content (in memory or in a staging file)."""
        return self.staging_fd is not None or self.mem is not None

    def read(self, off: int, size: int) -> bytes:
        """Read the staging content."""
        if self.mem is not None:
            return bytes(self.mem[off:off + size])
        assert self.staging_fd is not None
        return os.pread(self.staging_fd, size, off)

    def busy(self) -> bool:
        return self._lock is not None and self._lock.locked()

    def awaited(self) -> bool:
        """Another request waits for this file's lock (and so still holds this object)."""
        return self._lock is not None and self._lock.statistics().tasks_waiting > 0


class CommitListener(Protocol):
    """Told after every commit (the budget keeps to itself, the shared tier publishes)."""

    async def committed(self, of: Staged) -> None: ...


class WritePath:
    """Inodes being written, their staging files, and commits."""

    def __init__(self, ns: Namespace, blobs: Blobs, stats: Stats, limiter: trio.CapacityLimiter,
                 listeners: Sequence[CommitListener], watcher: WriteWatcher | None = None) -> None:
        self.ns = ns
        self.blobs = blobs
        self.cas = blobs.cas
        self.stats = stats
        self._limiter = limiter
        #: Told after every commit (the budget, the shared tier): wiring fills the list.
        self.listeners = listeners
        self.staged: dict[int, Staged] = {}
        #: Inodes whose uncommitted content was dropped, and the errno their writer gets (see the module doc).
        self.failed: dict[int, int] = {}
        self.watcher: WriteWatcher = watcher if watcher is not None else NoWriteWatcher()
        #: Bytes of all staging content (``staging_bytes``), and of the part held in memory;
        #: kept as running totals: every commit asks, with thousands of files being written.
        self._bytes = 0
        self._mem_bytes = 0

    def staged_for(self, ino: Inode, top: str) -> Staged:
        of = self.staged.get(ino.id)
        if of is None:
            of = Staged(inode=ino, top=top, size=ino.size, mtime_ns=ino.mtime_ns)
            self.staged[ino.id] = of
        return of

    def staging_bytes(self) -> int:
        return self._bytes

    def physical(self) -> int:
        """Bytes the store holds on disk: unique blobs plus content being written (what the budget counts)."""
        return self.blobs.bytes + self._bytes

    def _set_size(self, of: Staged, size: int) -> None:
        """Change the size of an inode's staging content, keeping the totals."""
        delta = size - of.size
        of.size = size
        self._bytes += delta
        if of.mem is not None:
            self._mem_bytes += delta

    def drop(self, ino: int) -> None:
        """Forget an inode's uncommitted content (it lost its last name and the kernel forgot it)."""
        failed = self.failed.pop(ino, None)
        of = self.staged.pop(ino, None)
        if of is not None:
            self._drop_staging(of)
            of.dirty = False
        if of is not None or failed is not None:  # only what the watcher may have been told of
            self.watcher.settled(ino)

    def idle(self, quiet_since: float) -> list[Staged]:
        """Written inodes with no write or truncate since *quiet_since* (monotonic), not busy."""
        return [of for of in self.staged.values() if of.dirty and of.changed < quiet_since and not of.busy()]

    async def fail(self, of: Staged) -> None:
        """A write found no room even after a slice of the cache went: drop what was staged (module doc)."""
        async with _Held(of.lock):
            self.failed[of.inode.id] = errno.ENOSPC
            self._drop_staging(of)
            of.dirty = False
            self.watcher.lost(of.inode.id)  # its writer has not been told yet
            of.write_gen += 1
            if self.staged.get(of.inode.id) is of:
                del self.staged[of.inode.id]

    def _drop_staging(self, of: Staged) -> None:
        of.hasher = None
        if of.has_staging:
            self._bytes -= of.size
        if of.mem is not None:
            self._mem_bytes -= of.size
            of.mem = None
        if of.mirror_fd is not None:
            os.close(of.mirror_fd)
            of.mirror_fd = None
        if of.staging_fd is not None:
            os.close(of.staging_fd)
            try:
                os.unlink(of.staging_path)  # type: ignore[arg-type]
            except FileNotFoundError:
                pass
        of.staging_fd = of.staging_path = None

    def _fits_in_memory(self, of: Staged, size: int) -> bool:
        """Whether *of*'s staging content may be (or stay) in memory at *size* bytes."""
        held = of.size if of.mem is not None else 0
        return size <= MEM_STAGING_MAX and self._mem_bytes - held + size <= MEM_STAGING_TOTAL

    def _spill(self, of: Staged) -> None:
        """Move staging content from memory to a staging file (it grew past ``MEM_STAGING_MAX``)."""
        mem = of.mem
        assert mem is not None
        fd, path = self.cas.new_staging()
        try:
            if mem:
                os.pwrite(fd, mem, 0)
        except BaseException:
            os.close(fd)
            os.unlink(path)
            raise
        self._mem_bytes -= of.size
        of.mem = None
        if of.mirror_fd is not None:
            os.close(of.mirror_fd)
            of.mirror_fd = None
        of.staging_fd, of.staging_path = fd, path
        self._kept(of)

    async def ensure_staging(self, of: Staged, *, empty: bool = False) -> None:
        """Give the inode staging content, starting as a copy of its blob unless *empty*."""
        if of.has_staging:
            return
        async with _Held(of.lock):
            if of.has_staging:
                return
            if of.inode.id in self.failed:  # it failed while this request waited for the lock
                self._forget_if_settled(of)
                raise ContentDropped(of.inode.id, self.failed[of.inode.id])
            digest, size = of.inode.hash, of.inode.size
            copy = digest is not None and size > 0 and not empty
            if self._fits_in_memory(of, size if copy else 0):
                mem = bytearray()
                if copy:
                    src = self.cas.open(digest)  # type: ignore[arg-type]
                    try:
                        mem = bytearray(os.pread(src, size, 0))
                    finally:
                        os.close(src)
                of.mem = mem
                self._start(of, len(mem), copy)
                self._kept(of)
                return
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
            self._start(of, size if copy else 0, copy)
            self._kept(of)

    def _kept(self, of: Staged) -> None:
        """New staging content is in place: give the watcher a descriptor of it (see the module doc)."""
        if not self.watcher.keeps_content:
            return
        if of.mem is not None:
            try:
                of.mirror_fd = os.memfd_create("mithrilfs-staging", os.MFD_CLOEXEC)
                if of.mem:
                    os.pwrite(of.mirror_fd, of.mem, 0)
            except OSError as e:  # out of descriptors or memory: this file is lost if the daemon dies
                if of.mirror_fd is not None:
                    os.close(of.mirror_fd)
                    of.mirror_fd = None
                log.warning("no mirror for inode %d (%s): a crash before its commit loses its writes",
                            of.inode.id, e)
                return
            self.watcher.staging(of.inode.id, of.mirror_fd, None)
        elif of.staging_fd is not None:
            self.watcher.staging(of.inode.id, of.staging_fd, of.staging_path)

    def _unshare(self, of: Staged) -> None:
        """The staging file may be a blob too (a commit linked it into ``objects/``): go on in a copy.

        Writes into the linked file would change a blob under its name (a
        commit whose transaction failed after the link; a daemon killed
        after it, whose successor adopts the file).  Should the copy fail
        too (a full disk), the file fails as when its writes find no room.
        """
        assert of.staging_fd is not None and of.staging_path is not None
        fd, path = self.cas.new_staging()
        try:
            _copy_fd(of.staging_fd, fd, of.size)
        except OSError as e:
            os.close(fd)
            os.unlink(path)
            log.error("inode %d: cannot copy its staging off a blob (%s): its writes are dropped", of.inode.id, e)
            self.failed[of.inode.id] = e.errno or errno.EIO
            self._drop_staging(of)
            of.dirty = False
            if self.staged.get(of.inode.id) is of:
                del self.staged[of.inode.id]
            self.watcher.lost(of.inode.id)
            return
        if _same_file(of.staging_path, of.staging_fd):
            os.unlink(of.staging_path)  # the blob keeps its own name
        os.close(of.staging_fd)
        of.staging_fd, of.staging_path = fd, path
        self._kept(of)

    def _start(self, of: Staged, size: int, copy: bool) -> None:
        """Staging content of *size* bytes is in place (a copy of the blob, or empty)."""
        of.size = 0
        self._set_size(of, size)
        of.hasher = None if copy else blake3.blake3(max_threads=blake3.blake3.AUTO)
        of.hashed = 0

    @contextlib.asynccontextmanager
    async def staging_locked(self, of: Staged, *, empty: bool = False) -> AsyncIterator[None]:
        """Hold the file lock with staging content in place (a commit may drop it while we wait)."""
        while True:
            await self.ensure_staging(of, empty=empty)
            await _acquire(of.lock)
            if of.has_staging:
                break
            of.lock.release()
        try:
            yield
        finally:
            of.lock.release()

    async def write(self, of: Staged, off: int, buf: Any) -> int:
        """Write *buf* at *off* into the inode's staging content (the kernel already placed O_APPEND writes)."""
        if not of.has_staging:
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
        end = off + len(buf)
        if of.mem is not None and (offload or not self._fits_in_memory(of, max(end, of.size))):
            self._spill(of)
        hasher = of.hasher if of.hasher is not None and off == of.hashed else None
        if hasher is None:
            of.hasher = None
        mem = of.mem
        if mem is not None:
            if off > len(mem):
                mem.extend(bytes(off - len(mem)))  # a hole
            mem[off:end] = buf
            if of.mirror_fd is not None:
                os.pwrite(of.mirror_fd, buf, off)
            if hasher is not None:
                hasher.update(buf)
            n = len(buf)
        else:
            fd = of.staging_fd
            assert fd is not None
            if offload:
                n = await trio.to_thread.run_sync(_pwrite_hash, fd, buf, off, hasher)
            else:
                n = _pwrite_hash(fd, buf, off, hasher)
        if hasher is not None and of.hasher is hasher:
            of.hashed += n
        if off + n > of.size:
            self._set_size(of, off + n)
        of.mtime_ns = time.time_ns()
        of.changed = time.monotonic()
        self._dirty(of)
        of.write_gen += 1
        return n

    async def truncate(self, of: Staged, size: int) -> None:
        if size == 0 and self.failed.pop(of.inode.id, None) is not None:
            self.watcher.settled(of.inode.id)  # starting over (O_TRUNC): a file whose writes failed may try again
        if size == of.size and not of.has_staging:
            self._forget_if_settled(of)
            return  # no change (O_TRUNC of an empty lock file): nothing to commit
        async with self.staging_locked(of, empty=size == 0):
            if of.mem is not None and not self._fits_in_memory(of, size):
                self._spill(of)
            if of.mem is not None:
                if size < len(of.mem):
                    del of.mem[size:]
                else:
                    of.mem.extend(bytes(size - len(of.mem)))
                if of.mirror_fd is not None:
                    os.ftruncate(of.mirror_fd, size)
            else:
                os.ftruncate(of.staging_fd, size)  # type: ignore[arg-type]
            if size == 0:
                of.hasher, of.hashed = blake3.blake3(max_threads=blake3.blake3.AUTO), 0
            elif size != of.hashed:
                of.hasher = None
            self._set_size(of, size)
            of.mtime_ns = time.time_ns()
            of.changed = time.monotonic()
            self._dirty(of)
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
        if not of.dirty or not of.has_staging or of.inode.nlink == 0:
            # nothing written, or no name can ever show it (dropped at forget)
            self._settled(of, confirmed)
            return
        async with _Held(of.lock):
            if not of.dirty or not of.has_staging or of.inode.nlink == 0:
                self._settled(of, confirmed)
                return
            gen, size, path, mem = of.write_gen, of.size, of.staging_path, of.mem
            if of.hasher is not None and of.hashed == size:
                digest = of.hasher.digest()
            elif mem is not None:
                digest = hash_bytes(mem)
            elif size >= OFFLOAD_MIN:
                assert path is not None
                digest = await trio.to_thread.run_sync(hash_file, path, limiter=self._limiter)
                if of.write_gen != gen or of.staging_path != path or of.inode.nlink == 0:
                    return  # changed meanwhile: a later commit point takes the newer content
            else:
                assert path is not None
                digest = hash_file(path)
            crash_point("before_intent")
            if mem is not None:
                new = self.blobs.add_data(mem, digest, between=crash_point)
            else:
                new = self.blobs.add(path, digest, size, between=crash_point)  # type: ignore[arg-type]
            if not new:
                self.stats.add(of.top, "dedup_hits")
            of.deduped = not new
            crash_point("after_adopt")
            old = of.inode.hash
            # until this transaction succeeds the staging file stays, so a
            # failed attempt (disk full) can simply be retried
            try:
                with self.ns.txn():
                    self.ns.set_content(of.inode, digest, size, of.mtime_ns, confirmed=confirmed)
            except BaseException:
                if mem is None:
                    self._unshare(of)
                raise
            crash_point("after_set_content")
            self.stats.add(of.top, "commits")
            self._drop_staging(of)
            self._clean(of)
            self._forget_if_settled(of)
            if old != digest:
                self.blobs.collect(old)
        await self._tell_committed(of)

    async def _tell_committed(self, of: Staged) -> None:
        for listener in self.listeners:
            await listener.committed(of)

    def _settled(self, of: Staged, confirmed: bool) -> None:
        if confirmed and of.inode.nlink > 0:
            self.ns.confirm(of.inode.id)
        self._forget_if_settled(of)

    def _forget_if_settled(self, of: Staged) -> None:
        """Drop the write state of an inode with nothing uncommitted, unless a request waits on its lock."""
        if not of.has_staging and not of.awaited() and self.staged.get(of.inode.id) is of:
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
            code = self.failed.pop(ino)
            self.watcher.settled(ino)
            raise ContentDropped(ino, code)

    def _dirty(self, of: Staged) -> None:
        if not of.dirty:
            of.dirty = True
            if of.mirror_fd is None and (of.staging_fd is None or not self.watcher.keeps_content):
                self.watcher.writing(of.inode.id)  # a watcher told of its staging knows it is written

    def _clean(self, of: Staged) -> None:
        if of.dirty:
            of.dirty = False
            if of.inode.id not in self.failed:
                self.watcher.settled(of.inode.id)

    def torn(self, inodes: set[int]) -> None:
        """A daemon that took over: these inodes had uncommitted writes whose content the previous one lost.

        Each keeps its last committed content and its writer learns it as
        for a file whose writes failed for room, with EIO: its writes fail,
        its next confirmed commit point fails once, a truncate to empty
        starts over.
        """
        for ino in inodes:
            self.failed[ino] = errno.EIO
            self.watcher.lost(ino)

    def adopt(self, inode: Inode, top: str, fd: int, path: str | None) -> None:
        """A daemon that took over: *fd* holds the staging content the previous one left (module doc).

        *path*: the staging file *fd* is open on; None: a memfd mirror,
        whose content is staged in memory again (or in a new staging file
        when it no longer fits).
        """
        size = os.fstat(fd).st_size
        of = self.staged_for(inode, top)
        if path is None:
            content = bytearray(os.pread(fd, size, 0)) if size else bytearray()
            os.close(fd)
            of.mem = content
            of.size = 0
            self._set_size(of, len(content))
            if not self._fits_in_memory(of, of.size):
                self._spill(of)
            else:
                self._kept(of)
        else:
            of.staging_fd, of.staging_path = fd, path
            of.size = 0
            self._set_size(of, size)
            if os.fstat(fd).st_nlink == 1 and _same_file(path, fd):
                self._kept(of)
            else:  # the dead daemon's commit had linked it into objects/ (or got further): a blob now
                self._unshare(of)
                if of.inode.id in self.failed:
                    return
        of.hasher = None
        of.mtime_ns = time.time_ns()
        of.changed = time.monotonic()
        self._dirty(of)

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


def _same_file(path: str, fd: int) -> bool:
    """*path* still names the file open on *fd*."""
    try:
        named, st = os.stat(path), os.fstat(fd)
    except FileNotFoundError:
        return False
    return (named.st_dev, named.st_ino) == (st.st_dev, st.st_ino)


def _copy_fd(src: int, dst: int, size: int) -> None:
    off = 0
    while off < size:
        n = os.copy_file_range(src, dst, size - off, off, off)
        if n == 0:
            break
        off += n
