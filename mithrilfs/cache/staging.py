"""Staging: where an inode's written bytes wait for their commit, and what becomes of them if they cannot.

Content of a regular file is either a committed blob (``Inode.hash``;
None means empty) or, while it is being written, staging content.  The
kernel opens and closes files itself (the filesystem answers OPEN and
FLUSH with ENOSYS), so there are no handles: WRITE, SETATTR and READ carry
the inode, and the write state is per inode (``staged.Staged``).  Staging
is created on the first write or truncate (a copy of the blob unless the
write starts from empty).  Small files are staged in memory
(``MEM_STAGING_MAX``): a compile cache writes thousands of them, and a
staging file is an inode to allocate, link and unlink on the backing
filesystem for each; a file that grows past it (or past the memory cap)
moves to a staging file in ``staging/``.  While writes arrive in sequence
a running blake3 follows them, so the commit (``writepath``, which builds
on this class) need not read the content back.

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
staged in memory, a mirror (a memory file the supervisor holds too, reused
from file to file: ``WriteWatcher.mirror``) that every write and truncate
updates before its reply; no staging file or mirror to be had (no memory
files left, a supervisor of older code), the content goes to a staging file.  A daemon that takes over after a crash adopts them
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
import time
from collections.abc import AsyncIterator
from typing import Any

import blake3
import trio

from mithrilfs.cache.staged import ContentDropped, Held, Staged, acquire
from mithrilfs.cache.write_watcher import NoWriteWatcher, WriteWatcher
from mithrilfs.store.cas import CAS
from mithrilfs.store.namespace import Inode

log = logging.getLogger(__name__)

#: Files at least this large are hashed and copied off the event loop.
OFFLOAD_MIN = 1 << 20
#: Writes this big copy and hash off the event loop.
WRITE_OFFLOAD_MIN = 256 << 10
#: Files up to this size are staged in memory rather than in a staging file (see module doc).
MEM_STAGING_MAX = WRITE_OFFLOAD_MIN
#: At most this many bytes are staged in memory at once; beyond, staging goes to files.
MEM_STAGING_TOTAL = 64 << 20


class Staging:
    """The staging content of every inode being written, its byte totals, and the files that failed.

    ``writepath.WritePath`` is a ``Staging`` that commits: one object to
    the filesystem, the budget and the daemon, two jobs in two modules.
    """

    def __init__(self, cas: CAS, limiter: trio.CapacityLimiter, watcher: WriteWatcher | None = None) -> None:
        self.cas = cas
        self._limiter = limiter
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
        async with Held(of.lock):
            self.failed[of.inode.id] = errno.ENOSPC
            self.watcher.lost(of.inode.id)  # its writer has not been told yet; said before its mirror goes
            self._drop_staging(of)
            of.dirty = False
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
            self.watcher.unmirror(of.mirror_fd)
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
        of.staging_fd, of.staging_path = fd, path
        self._kept(of)  # the watcher holds the staging file before the mirror goes
        if of.mirror_fd is not None:
            self.watcher.unmirror(of.mirror_fd)
            of.mirror_fd = None

    async def ensure_staging(self, of: Staged, *, empty: bool = False) -> None:
        """Give the inode staging content, starting as a copy of its blob unless *empty*."""
        if of.has_staging:
            return
        async with Held(of.lock):
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
                of.mirror_fd = self.watcher.mirror(of.inode.id, of.mem)
                return
            except OSError as e:
                if of.mirror_fd is not None:
                    self.watcher.unmirror(of.mirror_fd)
                    of.mirror_fd = None
                why = e
            try:
                self._spill(of)  # a staging file the watcher holds instead
                return
            except OSError as e:  # out of descriptors or room: this file is lost if the daemon dies
                log.warning("no mirror for inode %d (%s) nor staging file (%s): a crash before its commit loses "
                            "its writes", of.inode.id, why, e)
                return
        if of.staging_fd is not None:
            self.watcher.staging(of.inode.id, of.staging_fd, of.staging_path)  # type: ignore[arg-type]
            of.told = True

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
            await acquire(of.lock)
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

    def _forget_if_settled(self, of: Staged) -> None:
        """Drop the write state of an inode with nothing uncommitted, unless a request waits on its lock."""
        if not of.has_staging and not of.awaited() and self.staged.get(of.inode.id) is of:
            del self.staged[of.inode.id]

    def _dirty(self, of: Staged) -> None:
        if not of.dirty:
            of.dirty = True
            if of.mirror_fd is None and (of.staging_fd is None or not self.watcher.keeps_content):
                self.watcher.writing(of.inode.id)  # a watcher told of its staging (or mirror) knows it is written
                of.told = True

    def _clean(self, of: Staged) -> None:
        if of.dirty:
            of.dirty = False
            if of.told and of.inode.id not in self.failed:
                self.watcher.settled(of.inode.id)  # a mirror needs no word: its slot was cleared
            of.told = False

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
        when it no longer fits).  Content the inode's commit already holds
        (the previous daemon died after the commit's transaction, before it
        let go of its staging) is not staged again: its idle commit would
        turn a confirmed commit into an unconfirmed one, which the next
        unclean stop drops.
        """
        st = os.fstat(fd)
        size = st.st_size
        content = (bytearray(os.pread(fd, size, 0)) if size else bytearray()) if path is None else None
        if self._committed_already(inode, st, content):
            os.close(fd)
            return
        of = self.staged_for(inode, top)
        if content is not None:
            os.close(fd)
            of.mem = content
            of.size = 0
            self._set_size(of, len(content))
            if not self._fits_in_memory(of, of.size):
                self._spill(of)
            else:
                self._kept(of)
        else:
            assert path is not None
            of.staging_fd, of.staging_path = fd, path
            of.size = 0
            self._set_size(of, size)
            if st.st_nlink == 1 and _same_file(path, fd):
                self._kept(of)
            else:  # the dead daemon's commit had linked it into objects/ (or got further): a blob now
                self._unshare(of)
                if of.inode.id in self.failed:
                    return
        of.hasher = None
        of.mtime_ns = time.time_ns()
        of.changed = time.monotonic()
        self._dirty(of)

    def _committed_already(self, inode: Inode, st: os.stat_result, content: bytearray | None) -> bool:
        """The staging left (*st*; a mirror's *content*, None for a staging file) is exactly what *inode*'s commit
        names: its blob file itself (a staging file the commit linked into ``objects/``), or a mirror whose
        bytes hash to it."""
        if inode.hash is None or st.st_size != inode.size:
            return False
        if content is None:
            try:
                blob = os.stat(self.cas.path(inode.hash))
            except FileNotFoundError:
                return False
            return (blob.st_dev, blob.st_ino) == (st.st_dev, st.st_ino)
        return blake3.blake3(content).digest() == inode.hash

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
