"""An inode's attributes as the kernel is told them, and how long it may keep them.

Every answer that carries attributes (LOOKUP, GETATTR, SETATTR, the
entries of READDIRPLUS, a new name) builds them here: a file being written
shows its staging content's size and mtime, not its last committed ones,
and its atime is recency's (batched, newer than the row).
"""

from __future__ import annotations

from mithrilfs.cache.recency import Recency
from mithrilfs.cache.writepath import WritePath
from mithrilfs.control.node import BLKSIZE
from mithrilfs.kernel import EntryAttributes
from mithrilfs.store.namespace import Inode

#: Kernel caching of names and attributes.  Changes made through the kernel
#: keep its caches right by themselves; the daemon invalidates what it
#: changes on its own.  The kernel revalidates a name or attributes it uses
#: after a minute, and that LOOKUP or GETATTR is the daemon's only sign of
#: use (reads are served from the page cache), so a minute is the grain of
#: eviction's recency: fine for a compile cache, where a working set lives
#: for hours.
ENTRY_TIMEOUT = 60.0


class Attributes:
    """Builds ``EntryAttributes`` for the filesystem's answers (``of``)."""

    def __init__(self, writes: WritePath, recency: Recency, idle_ttl: float | None) -> None:
        self.writes = writes
        self.recency = recency
        #: Entry and attribute timeout: revalidations are the only sign of use, so an idle TTL
        #: shorter than the timeouts needs them sooner.
        self.timeout = min(ENTRY_TIMEOUT, idle_ttl / 4) if idle_ttl else ENTRY_TIMEOUT

    def of(self, ino: Inode) -> EntryAttributes:
        e = EntryAttributes()
        e.st_ino = ino.id
        e.generation = 0
        e.entry_timeout = e.attr_timeout = self.timeout
        e.st_mode = ino.mode
        e.st_nlink = ino.nlink
        e.st_uid = ino.uid
        e.st_gid = ino.gid
        e.st_rdev = ino.rdev
        size, mtime = ino.size, ino.mtime_ns
        of = self.writes.staged.get(ino.id)
        if of is not None:
            size, mtime = of.size, of.mtime_ns
        e.st_size = size
        e.st_blksize = BLKSIZE
        e.st_blocks = (size + 511) // 512
        e.st_atime_ns = self.recency.get(ino.id, ino.atime_ns)
        e.st_mtime_ns = mtime
        e.st_ctime_ns = ino.ctime_ns
        return e
