"""Disk blocks held back so that, when the store's disk fills up, the index still has room to say so.

A full disk is cured by recording evictions (and undoing the rows of blobs
that could not be written); SQLite needs room for that.  ``Reserve`` holds
``RESERVE_BYTES`` of real blocks in ``STORE/reserve``; whoever must write
the index on a full disk releases it, writes, and takes it back when there
is room again.  ``NoReserve`` is for an index with no store around it (unit
tests): nothing held, nothing to release.
"""

from __future__ import annotations

import errno
import os
import sqlite3
from pathlib import Path

RESERVE_BYTES = 1 << 20


def disk_room(path: str | os.PathLike[str]) -> int:
    """Bytes an unprivileged writer may still put on the disk holding *path*.

    A read-ahead asks before it starts: what it brings in the background
    must never take the room the read that started it needs (a read-ahead
    racing a 9 MiB fetch for the last megabytes of a full disk made the read
    fail with ENOSPC).  A full disk's retry asks whether the room its
    eviction made has come (``cache.budget``).
    """
    st = os.statvfs(path)
    return st.f_bavail * st.f_frsize


def is_disk_full(e: BaseException) -> bool:
    """The store's disk (or the index's room on it) ran out."""
    if isinstance(e, OSError):
        return e.errno in (errno.ENOSPC, errno.EDQUOT)
    return isinstance(e, sqlite3.OperationalError) and "full" in str(e)


class NoReserve:
    def ensure(self) -> bool:
        """Hold the reserve (best effort); True when held."""
        return False

    def release(self) -> None:
        """Give the reserve's blocks back to the disk."""


class Reserve(NoReserve):
    def __init__(self, path: Path) -> None:
        self.path = path

    def ensure(self) -> bool:
        try:
            if self.path.stat().st_size == RESERVE_BYTES:
                return True
        except FileNotFoundError:
            pass
        try:
            with open(self.path, "wb") as f:
                f.write(b"\0" * RESERVE_BYTES)
            return True
        except OSError:
            self.path.unlink(missing_ok=True)
            return False

    def release(self) -> None:
        self.path.unlink(missing_ok=True)


#: The reserve of an index with no store around it.
NO_RESERVE = NoReserve()
