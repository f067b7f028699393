"""Changes to names, with everything that follows from them.

A new name, a second name, a removed name, a rename or an exchange changes
more than a row: link counts (a directory counts its subdirectories), the
parents' mtime and ctime, the kernel's references (every reply that hands
out an inode counts one), a setgid directory's group, the per-directory
attribution of stats, and what the shared tier is told (``NameListener``:
a new name is published, a name a user removes gets a tombstone).  Each
change is one index transaction and never awaits, so what it checked still
holds when it writes; a regular file's create commits with the next
transaction, or when the event loop is idle, kept until then in a journal
a successor replays (``create_journal``).  Errors are ``OSError`` with
the errno the request is answered with.
"""

from __future__ import annotations

import errno
import logging
import os
import sqlite3
import stat
import time
from collections.abc import Callable
from typing import Protocol

from mithrilfs.cache.create_journal import CreateJournal
from mithrilfs.cache.lifetime import Lifetimes
from mithrilfs.cache.writepath import WritePath
from mithrilfs.crash_points import crash_point
from mithrilfs.observe.tops import TopDirs
from mithrilfs.store.namespace import ROOT_INODE, Inode, Namespace

log = logging.getLogger(__name__)


class NameListener(Protocol):
    """Told of names users make and remove (the shared tier; evictions never come here)."""

    def publish(self, ino: Inode) -> None: ...

    def tombstone(self, parent: int, name: bytes) -> None: ...


def _error(code: int) -> OSError:
    return OSError(code, os.strerror(code))


class Names:
    def __init__(self, ns: Namespace, writes: WritePath, lifetimes: Lifetimes, tops: TopDirs,
                 listener: NameListener, journal: CreateJournal | None = None,
                 when_idle: Callable[[Callable[[], None]], None] = lambda job: job()) -> None:
        """*journal*: where a create whose transaction is deferred is kept, for a successor and to redo it
        after a failed transaction (``create_journal``; default: one of its own, shared with nobody).
        *when_idle*: runs a job once the event loop has nothing to do (``kernel.AfterReply.when_idle``);
        the deferred transactions commit there at the latest (default: at once)."""
        self.ns = ns
        self.writes = writes
        self.lifetimes = lifetimes
        self.tops = tops
        self.listener = listener
        self.journal = journal if journal is not None else CreateJournal()
        self._when_idle = when_idle
        self._commit_queued = False
        ns.on_deferred(committed=self.journal.clear, lost=self._put_back_lost)

    def commit_deferred(self) -> None:
        """Commit the creates whose transactions were deferred (the event loop's first idle moment)."""
        self._commit_queued = False
        if self.ns.deferred:
            crash_point("before_deferred_commit")
        try:
            self.ns.commit_deferred()
        except (sqlite3.Error, OSError) as e:  # still pending (or put back): the next transaction retries
            log.warning("could not commit deferred creates: %s", e)

    def _put_back_lost(self) -> None:
        """A failed transaction rolled deferred creates back: put them back from the journal, deferred
        again (``CreateJournal.put_back``)."""
        self.journal.put_back(self.ns)

    def inode(self, ino: int) -> Inode:
        """An inode by number (one being written is the write path's object); ENOENT when gone."""
        of = self.writes.staged.get(ino)
        if of is not None:
            return of.inode
        inode = self.ns.get(ino)
        if inode is None:
            raise _error(errno.ENOENT)
        return inode

    def existing(self, parent: int, name: bytes) -> Inode:
        ino = self.ns.lookup(parent, name)
        if ino is None:
            raise _error(errno.ENOENT)
        return self.inode(ino)

    def _touch_dir(self, parent: int) -> None:
        now = time.time_ns()
        self.ns.update_attrs(self.inode(parent), mtime_ns=now, ctime_ns=now)

    def create(self, parent: int, name: bytes, mode: int, uid: int, gid: int, *, target: bytes | None = None,
               rdev: int = 0) -> Inode:
        """A new inode under a new name; the kernel holds one reference to it (the reply's)."""
        if self.ns.lookup(parent, name) is not None:
            raise _error(errno.EEXIST)
        parent_ino = self.inode(parent)
        if not parent_ino.is_dir:
            raise _error(errno.ENOTDIR)
        is_dir = stat.S_ISDIR(mode)
        if parent_ino.mode & stat.S_ISGID:
            # a setgid directory: new entries take its group, new subdirectories its setgid bit
            gid = parent_ino.gid
            if is_dir:
                mode |= stat.S_ISGID
        # a regular file's transaction commits with the next one (its RENAME, for a file written to a
        # temporary name) or when the loop is idle, kept in the journal until then (``create_journal``)
        defer = stat.S_ISREG(mode) and self.journal.room()
        with self.ns.txn(defer=defer):
            ino = self.ns.create_inode(mode, uid, gid, target=target, nlink=2 if is_dir else 1, rdev=rdev)
            self.ns.link(parent, name, ino.id)
            if is_dir:
                self.ns.add_link(parent_ino, +1)
            self._touch_dir(parent)
        if defer and self.ns.deferred:
            self.journal.record(ino, parent, name)
            if not self._commit_queued:
                self._commit_queued = True
                self._when_idle(self.commit_deferred)
        self.lifetimes.ref(ino.id)
        if stat.S_ISLNK(mode):
            self.listener.publish(ino)
        return ino

    def link(self, ino_id: int, parent: int, name: bytes) -> Inode:
        """A second name for a file (its content committed by the caller)."""
        ino = self.inode(ino_id)
        if ino.nlink == 0:
            raise _error(errno.ENOENT)
        if self.ns.lookup(parent, name) is not None:
            raise _error(errno.EEXIST)
        with self.ns.txn():
            self.ns.link(parent, name, ino_id)
            self.ns.add_link(ino, +1)
            self._touch_dir(parent)
        self.lifetimes.ref(ino_id)
        return ino

    def remove(self, parent: int, name: bytes, *, is_dir: bool) -> int:
        """unlink or rmdir; returns the inode, for its caller to delete once nothing holds it."""
        ino = self.existing(parent, name)
        if ino.is_dir != is_dir:
            raise _error(errno.ENOTDIR if is_dir else errno.EISDIR)
        if is_dir and self.ns.has_children(ino.id):
            raise _error(errno.ENOTEMPTY)
        with self.ns.txn():
            self.listener.tombstone(parent, name)
            self.lifetimes.drop_name(self.inode(parent), name, ino)
            self._touch_dir(parent)
        return ino.id

    def _is_ancestor(self, ancestor: int, ino: int) -> bool:
        while ino != ROOT_INODE:
            if ino == ancestor:
                return True
            parent = self.ns.parent_of(ino)
            if parent is None:
                return False
            ino = parent
        return ancestor == ROOT_INODE

    def rename(self, parent_old: int, name_old: bytes, parent_new: int, name_new: bytes, *, exchange: bool,
               noreplace: bool) -> int | None:
        """A rename (or an exchange), once the files involved are committed.

        Returns the inode whose name it replaced, to be deleted once nothing holds it.
        """
        src = self.existing(parent_old, name_old)
        dst_id = self.ns.lookup(parent_new, name_new)
        dst = self.inode(dst_id) if dst_id is not None else None
        if src.is_dir and self._is_ancestor(src.id, parent_new):
            raise _error(errno.EINVAL)
        if exchange:
            if dst is None:
                raise _error(errno.ENOENT)
            if dst.is_dir and self._is_ancestor(dst.id, parent_old):
                raise _error(errno.EINVAL)
            self._exchange(parent_old, name_old, src, parent_new, name_new, dst)
            self.tops.moved(src.id, is_dir=src.is_dir or dst.is_dir)
            self.listener.publish(src)
            self.listener.publish(dst)
            return None
        if dst is not None:
            if noreplace:
                raise _error(errno.EEXIST)
            if dst.id == src.id:
                return None
            if dst.is_dir:
                if not src.is_dir:
                    raise _error(errno.EISDIR)
                if self.ns.has_children(dst.id):
                    raise _error(errno.ENOTEMPTY)
            elif src.is_dir:
                raise _error(errno.ENOTDIR)
        with self.ns.txn():
            self.listener.tombstone(parent_old, name_old)
            if dst is not None:
                self.lifetimes.drop_name(self.inode(parent_new), name_new, dst)
            self.ns.move(parent_old, name_old, parent_new, name_new)
            if src.is_dir and parent_old != parent_new:
                self.ns.add_link(self.inode(parent_old), -1)
                self.ns.add_link(self.inode(parent_new), +1)
            self.ns.update_attrs(src, ctime_ns=time.time_ns())
            self._touch_dir(parent_old)
            if parent_new != parent_old:
                self._touch_dir(parent_new)
        self.tops.moved(src.id, is_dir=src.is_dir)  # a subtree moved: its paths are recomputed lazily
        self.listener.publish(src)
        return dst.id if dst is not None else None

    def _exchange(self, p_a: int, n_a: bytes, a: Inode, p_b: int, n_b: bytes, b: Inode) -> None:
        with self.ns.txn():
            self.ns.retarget(p_a, n_a, b.id)
            self.ns.retarget(p_b, n_b, a.id)
            if p_a != p_b and a.is_dir != b.is_dir:
                moved_to_b = +1 if a.is_dir else -1
                self.ns.add_link(self.inode(p_b), moved_to_b)
                self.ns.add_link(self.inode(p_a), -moved_to_b)
            self._touch_dir(p_a)
            if p_b != p_a:
                self._touch_dir(p_b)
