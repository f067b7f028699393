"""The write state of one inode, and what is told of it: ``Staged``, its lock, ``ContentDropped``.

Shared by the two halves of the write path, ``staging`` (where written
bytes wait) and ``writepath`` (commits), and by what looks at files being
written (the budget, the shared tier, recompiles): the data and its
lock, no behaviour of the write path itself (who is told what is being
written: ``write_watcher``).
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass
from typing import Any

import trio

from mithrilfs.observe.stats import ROOT_KEY
from mithrilfs.store.namespace import Inode


class ContentDropped(OSError):
    """A commit point of a file whose uncommitted content was dropped: the writer learns it here, once.

    ENOSPC for writes that failed for room (an error that must not make
    room again: the file already had its slice); EIO for content that died
    with a previous daemon (``torn``).
    """

    def __init__(self, ino: int, code: int = errno.ENOSPC) -> None:
        why = "its writes failed for room" if code == errno.ENOSPC else "its writes died with the previous daemon"
        super().__init__(code, f"inode {ino}: {why} and its content was dropped")

async def acquire(lock: trio.Lock) -> None:
    """Take a free lock without yielding to trio.

    ``trio.Lock.acquire`` always checkpoints; here almost every acquire finds
    the lock free, and a handler that never yields is answered without a
    task switch (see ``kernel.session``).
    """
    try:
        lock.acquire_nowait()
    except trio.WouldBlock:
        await lock.acquire()


class Held:
    """``async with Held(lock)``: the lock, taken by ``acquire``."""

    __slots__ = ("lock",)

    def __init__(self, lock: trio.Lock) -> None:
        self.lock = lock

    async def __aenter__(self) -> None:
        await acquire(self.lock)

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
    #: A memory file with the same content as ``mem``, kept for a successor daemon (``WriteWatcher.mirror``).
    mirror_fd: int | None = None
    #: The watcher was told of this file (``staging``, ``writing``): its commit tells it ``settled``.
    told: bool = False
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
