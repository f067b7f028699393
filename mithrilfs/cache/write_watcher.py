"""Who is told what is being written: ``WriteWatcher``, and ``NoWriteWatcher`` when nobody is.

The daemon's supervisor is the watcher of a mount (``daemon.channel``): it
keeps every file's staging content where it outlives the daemon.  A module
of its own, apart from the write state (``staged``), so that the supervisor,
a small process that lives as long as the mount, loads neither the write
path nor trio.
"""

from __future__ import annotations

import errno
import os
from typing import Protocol


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
