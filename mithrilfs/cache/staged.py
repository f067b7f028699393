"""The write state of one inode, and what is told of it: ``Staged``, its lock, the watcher, ``ContentDropped``.

Shared by the two halves of the write path, ``staging`` (where written
bytes wait) and ``writepath`` (commits), and by what looks at files being
written (the budget, the shared tier, recompiles): the data and the
interfaces, no behaviour of the write path itself.
"""

from __future__ import annotations

import errno
import os
from dataclasses import dataclass
from typing import Any, Protocol

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

class WriteWatcher(Protocol):
    """Told what is being written, so that a daemon taking over after a crash can go on (``staging``'s module doc).

    ``staging``: the inode's staging content now lives in the staging
    file *path*, open on *fd*, which also means it is being written;
    ``mirror``: a memory file the watcher holds too, for an inode's content
    staged in memory, holding *content* (what is staged so far) before it
    is named the inode's; it stays the inode's until ``unmirror``, with
    no other word, and OSError when none can be had; ``writing``: it has
    uncommitted writes (said only when there is no staging file nor mirror
    to keep); ``lost``: its uncommitted content was dropped and its writer
    not told yet; ``settled``: nothing uncommitted is left (said only of an
    inode one of ``staging``, ``writing`` or ``lost`` was said of).  What
    was said of an inode wins over a mirror still naming it.
    """

    #: Whether staging content must be kept where it outlives the daemon (staging files, mirrors).
    keeps_content: bool

    def staging(self, ino: int, fd: int, path: str) -> None: ...

    def mirror(self, ino: int, content: bytes | bytearray | memoryview) -> int: ...

    def unmirror(self, fd: int) -> None: ...

    def writing(self, ino: int) -> None: ...

    def lost(self, ino: int) -> None: ...

    def settled(self, ino: int) -> None: ...


class NoWriteWatcher:
    """Nobody keeps anything (no supervisor: tools, tests, a daemon that detaches on a crash)."""

    keeps_content = False

    def staging(self, ino: int, fd: int, path: str) -> None:
        pass

    def mirror(self, ino: int, content: bytes | bytearray | memoryview) -> int:
        raise OSError(errno.ENOTSUP, "nobody keeps mirrors")

    def unmirror(self, fd: int) -> None:
        os.close(fd)

    def writing(self, ino: int) -> None:
        pass

    def lost(self, ino: int) -> None:
        pass

    def settled(self, ino: int) -> None:
        pass

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
