"""The kernel's lookup count of every inode, in shared memory that outlives the daemon.

The kernel holds an inode from the reply that names it (LOOKUP, CREATE,
MKNOD, MKDIR, SYMLINK, LINK, each READDIRPLUS entry) until FORGET gives the
count back, and only the daemon can keep that count.  A daemon that takes
over a live mount (``daemon.supervisor``) needs it exactly: an inode the
kernel holds may be open or mapped and must keep its content, and one it
does not hold must be freed when evicted or unlinked, else a long-lived
mount stops freeing space after its first takeover.  So the counts are an
array of 32-bit integers indexed by inode id in a memfd: the daemon
updates it before the reply that hands a reference out, the supervisor
holds a descriptor of it, and a successor maps the same memory.

Inode ids are never reused and only grow; the file is sparse, so memory
is spent on the pages of ids the kernel has seen (4 bytes an id).  A
request the dead daemon counted but never answered leaves its inode one
too high, which only keeps it until the next mount.
"""

from __future__ import annotations

import mmap
import os
import struct

_COUNT = struct.Struct("<I")


class LookupCounts:
    def __init__(self, fd: int | None = None) -> None:
        """A new, empty table; or, with *fd*, the one a previous daemon kept (its descriptor is ours now)."""
        self.fd = fd if fd is not None else os.memfd_create("mithrilfs-lookups", os.MFD_CLOEXEC)
        os.set_inheritable(self.fd, False)
        size = os.fstat(self.fd).st_size
        self._map: mmap.mmap | None = mmap.mmap(self.fd, size) if size else None
        self._capacity = size // _COUNT.size

    def get(self, ino: int) -> int:
        if ino >= self._capacity or self._map is None:
            return 0
        return _COUNT.unpack_from(self._map, ino * _COUNT.size)[0]

    def set(self, ino: int, count: int) -> None:
        if ino >= self._capacity:
            if count == 0:
                return
            self._grow(ino)
        assert self._map is not None
        _COUNT.pack_into(self._map, ino * _COUNT.size, count)

    def _grow(self, ino: int) -> None:
        capacity = max(4096, self._capacity)
        while capacity <= ino:
            capacity *= 2
        os.ftruncate(self.fd, capacity * _COUNT.size)
        if self._map is not None:
            self._map.close()
        self._map = mmap.mmap(self.fd, capacity * _COUNT.size)
        self._capacity = capacity

    def clear(self) -> None:
        """Every count back to zero (a clean unmount: the kernel holds nothing any more)."""
        if self._map is not None:
            self._map.close()
            self._map = None
        os.ftruncate(self.fd, 0)
        self._capacity = 0
