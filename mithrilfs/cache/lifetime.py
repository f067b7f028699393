"""Inode lifetime: kernel references, names removed, content freed.

An inode lives while it has a name, while the kernel holds references to it
(every positive LOOKUP, CREATE, MKNOD, MKDIR, SYMLINK, LINK reply and every
READDIRPLUS entry counts one; FORGET gives them back), or while it has
uncommitted writes.  The kernel opens files itself, so its references are
the in-use protection: it keeps an inode while a process has it open or
mapped.  Removing the last name of an inode still referenced (unlink,
eviction) keeps its row and content until the last FORGET, so open files
and mmapped ``.so`` files keep working; only then are its row and blob
reference dropped.

Deleting at FORGET writes to the index.  On a full disk that write can fail
(the SQLite WAL cannot grow) where the request that removed the name did
not, and FORGET has no reply to carry an error.  Then the content, which
nothing can reach any more, is freed first (``Blobs.free_early``) so the
index has room; should it still fail, the inode is kept in ``doomed`` and
retried, and a clean unmount or the next mount's recovery removes whatever
is still left.

The counts live in shared memory (``cache.lookups``), so a daemon that
takes over a live mount (``daemon.supervisor``) knows exactly which inodes
the kernel holds.
"""

from __future__ import annotations

import logging
import sqlite3
import time
from collections.abc import Callable
from typing import Protocol

from mithrilfs.cache.lookups import LookupCounts
from mithrilfs.cache.recency import Recency
from mithrilfs.store.blobs import Blobs
from mithrilfs.store.namespace import Inode, Namespace
from mithrilfs.store.open import is_disk_full

log = logging.getLogger(__name__)

#: (parent, name, inode) of a name the daemon removed on its own.
Removed = tuple[int, bytes, int]


class KernelCaches(Protocol):
    """The kernel's caches of names and inodes, told what the daemon changed on its own (``kernel.Notifier``)."""

    def delete(self, parent: int, child: int, name: bytes) -> None: ...

    def invalidate_inode(self, inode: int, off: int = 0, length: int = 0) -> None: ...


class NoKernelCaches:
    """Nobody to tell (tools and tests that use the cache without a mount)."""

    def delete(self, parent: int, child: int, name: bytes) -> None:
        pass

    def invalidate_inode(self, inode: int, off: int = 0, length: int = 0) -> None:
        pass


class Lifetimes:
    def __init__(self, ns: Namespace, blobs: Blobs, recency: Recency, is_written: Callable[[int], bool],
                 kernel: KernelCaches, counts: LookupCounts | None = None) -> None:
        self.ns = ns
        self.blobs = blobs
        self.recency = recency
        #: The inode has uncommitted writes (``WritePath.staged``).
        self.is_written = is_written
        #: Kernel references per inode.
        self.counts = counts if counts is not None else LookupCounts()
        #: Inodes due for deletion whose index write failed (disk full): retried later.
        self.doomed: set[int] = set()
        #: Inodes the kernel still holds whose content had to go (corrupt, lost by the shared
        #: tier): their reads fail with EIO until FORGET, never read as empty.
        self.unreadable: set[int] = set()
        #: Told of names the daemon removed, and of inodes whose content changed under the kernel.
        self.kernel = kernel

    def ref(self, ino: int) -> None:
        self.counts.set(ino, self.counts.get(ino) + 1)

    def referenced(self, ino: int) -> bool:
        return self.counts.get(ino) > 0

    def unref(self, ino: int, n: int) -> bool:
        """The kernel dropped *n* references; True when none is left."""
        left = self.counts.get(ino) - n
        self.counts.set(ino, max(left, 0))
        return left <= 0

    def delete_if_unused(self, ino: int) -> int:
        """Drop an inode that has no names, no kernel references and no uncommitted writes; returns bytes freed."""
        if self.is_written(ino) or self.referenced(ino):
            return 0
        inode = self.ns.get(ino)
        if inode is None or inode.nlink > 0:
            self.doomed.discard(ino)
            return 0
        try:
            with self.ns.txn():
                self.ns.delete_inode(ino)
        except (sqlite3.Error, OSError) as e:
            # a full disk: free the unreachable content first, then the index has room to say so
            if not (is_disk_full(e) and inode.hash is not None and self.blobs.free_early(inode.hash)):
                raise
            with self.ns.txn():
                self.ns.delete_inode(ino)
        self.doomed.discard(ino)
        self.unreadable.discard(ino)
        self.recency.forget(ino)
        return self.blobs.collect(inode.hash)

    def retry_doomed(self) -> None:
        for ino in list(self.doomed):
            try:
                self.delete_if_unused(ino)
            except (sqlite3.Error, OSError) as e:
                log.debug("inode %d still cannot be deleted: %s", ino, e)
                return

    def drop_name(self, parent: Inode, name: bytes, ino: Inode, *, touch: bool = True) -> None:
        """Remove one name of *ino* from the directory *parent* (inside a transaction); without *touch* (the
        shared tier's change, not one made here) *parent*'s ctime stays (``Namespace.add_link``)."""
        self.ns.unlink(parent.id, name)
        if ino.is_dir:
            self.ns.update_attrs(ino, nlink=0, ctime_ns=time.time_ns())
            self.ns.add_link(parent, -1, touch=touch)
        else:
            self.ns.add_link(ino, -1)

    def remove_all_names(self, inodes: list[Inode], removed: list[Removed], *, keep_content: bool) -> set[bytes]:
        """Unlink every name of *inodes* (inside a transaction); returns the blobs they no longer hold.

        An inode the kernel still references (open, mapped, or only cached)
        keeps its row until ``forget``, and with *keep_content* (eviction)
        its content too, so a process using it goes on working.  Without it
        (content that must not be served) the content goes at once.
        """
        dropped: set[bytes] = set()
        for ino in inodes:
            for parent, name in self.ns.names_of(ino.id):
                self.ns.unlink(parent, name)
                removed.append((parent, name, ino.id))
            self.ns.update_attrs(ino, nlink=0, ctime_ns=time.time_ns())
            if self.is_written(ino.id) or (keep_content and self.referenced(ino.id)):
                continue
            if ino.hash is not None:
                dropped.add(ino.hash)
            if self.referenced(ino.id):
                self.ns.drop_content(ino)
                self.unreadable.add(ino.id)
            else:
                self.ns.delete_inode(ino.id)
                self.recency.forget(ino.id)
        return dropped

    def forget_content(self, digest: bytes, inodes: list[Inode]) -> None:
        """Remove every name of a blob that must not or cannot be served (*inodes*: those pointing at it)."""
        removed: list[Removed] = []
        with self.ns.txn():
            self.remove_all_names(inodes, removed, keep_content=False)
        self.blobs.collect(digest)
        self.tell_kernel(removed)

    def tell_kernel(self, removed: list[Removed]) -> None:
        for parent, name, ino_id in removed:
            self.kernel.delete(parent, ino_id, name)

    def clear(self) -> None:
        self.counts.clear()
        self.unreadable.clear()
