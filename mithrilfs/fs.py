"""The filesystem's answers to kernel requests: it translates requests, nothing else.

Each handler looks things up in the namespace, hands content to the write
path (``writepath``: staging and commits), inode lifetimes to ``lifetime``
(kernel references, names removed, content freed), blobs to ``blobs``, and
records what happened in ``stats``.  Everything runs on one trio event
loop, so namespace access needs no locks; the code re-checks what it relies
on after every ``await``.

The kernel opens and closes files itself: OPEN and FLUSH are answered
ENOSYS (the base class's answer), so a cached open, read and close never
reaches the daemon, and READ, WRITE and SETATTR carry the inode.  Commit
points (``writepath``): a rename of a written file, fsync, link, chmod,
FORGET, a clean unmount and the idle timer.  Content stays while the kernel
holds the inode (an open file, an mmapped ``.so``) and goes at FORGET.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import sqlite3
import stat
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from mithrilfs import kernel
from mithrilfs.cache.budget import Budget, room_would_help
from mithrilfs.cache.integrity import Integrity
from mithrilfs.cache.lifetime import Lifetimes
from mithrilfs.cache.recency import Recency
from mithrilfs.cache.writepath import ContentDropped, Staged, WritePath
from mithrilfs.control.files import CONTROL_DIR_INODE, CONTROL_NAME, ControlFiles
from mithrilfs.kernel import DirBuffer, EntryAttributes, FileInfo, FUSEError, SetattrFields, StatvfsData
from mithrilfs.observe.events import EventLog
from mithrilfs.observe.stats import Stats
from mithrilfs.observe.tops import TopDirs
from mithrilfs.shared.tier import Tier
from mithrilfs.store.namespace import NAME_MAX, ROOT_INODE, DirPaths, Inode
from mithrilfs.store.open import Store, is_disk_full

log = logging.getLogger(__name__)

#: Kernel caching of names and attributes.  Changes made through the kernel
#: keep its caches right by themselves; the daemon invalidates what it
#: changes on its own.  The kernel revalidates a name or attributes it uses
#: after a minute, and that LOOKUP or GETATTR is the daemon's only sign of
#: use (reads are served from the page cache), so a minute is the grain of
#: eviction's recency: fine for a compile cache, where a working set lives
#: for hours.
ENTRY_TIMEOUT = 60.0
_BLKSIZE = 128 * 1024

F = TypeVar("F", bound=Callable[..., Awaitable[Any]])

def _sqlite_errno(e: sqlite3.Error) -> int:
    """The errno a failed index operation means for the caller."""
    if is_disk_full(e):
        return errno.ENOSPC
    text = str(e)
    if "readonly" in text or "read-only" in text:
        return errno.EROFS
    return errno.EIO


def _error_policy(*, data: bool) -> Callable[[F], F]:
    """Error policy of the request handlers.

    A full backing disk gets one eviction pass to make room and one retry
    (handlers are written so that a failed attempt changes nothing); *data*
    says the handler writes file data (see ``Budget.retry_after_room``).  Stray
    OSErrors become their errno and anything else EIO, logged here with
    the operation's name and counted in the event log.
    """

    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        async def wrapper(self: Operations, *args: Any, **kwargs: Any) -> Any:
            try:
                # Budget.retry_when_full, with its first attempt inlined: no closure or extra coroutine
                # per request
                try:
                    return await fn(self, *args, **kwargs)
                except (OSError, sqlite3.OperationalError) as e:
                    if not room_would_help(e):
                        raise
                return await self.budget.retry_after_room(lambda: fn(self, *args, **kwargs), data=data)
            except FUSEError:
                raise
            except OSError as e:
                if e.errno in (None, errno.EIO, errno.ENOSPC, errno.EROFS):
                    log.warning("%s failed: %s", fn.__name__, e)
                    self.events.emit("error", op=fn.__name__, error=str(e))
                raise FUSEError(e.errno or errno.EIO) from None
            except sqlite3.Error as e:
                code = _sqlite_errno(e)
                if code == errno.EIO:
                    log.exception("%s failed", fn.__name__)
                else:
                    log.warning("%s failed: %s", fn.__name__, e)
                self.events.emit("error", op=fn.__name__, error=str(e))
                raise FUSEError(code) from None
            except Exception as e:
                log.exception("%s failed", fn.__name__)
                self.events.emit("error", op=fn.__name__, error=repr(e))
                raise FUSEError(errno.EIO) from None

        return wrapper  # type: ignore[return-value]

    return wrap


_request = _error_policy(data=False)
#: Handlers that write file data into staging: ``write``, and ``setattr`` (a truncate copies the blob).
_data_request = _error_policy(data=True)


def _timed(op: str) -> Callable[[F], F]:
    """Record the handler's latency (success or not) under *op* for the stats' percentiles."""

    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        async def wrapper(self: Operations, *args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter_ns()
            try:
                return await fn(self, *args, **kwargs)
            finally:
                self.stats.record_latency(op, time.perf_counter_ns() - start)

        return wrapper  # type: ignore[return-value]

    return wrap


def _err(code: int) -> FUSEError:
    return FUSEError(code)


def _check_name_length(name: bytes) -> None:
    if len(name) > NAME_MAX:
        raise _err(errno.ENAMETOOLONG)


@dataclass
class Parts:
    """What the filesystem's handlers hand work to; built in one place (``daemon.wiring``)."""

    store: Store
    writes: WritePath
    lifetimes: Lifetimes
    recency: Recency
    budget: Budget
    integrity: Integrity
    tier: Tier
    control: ControlFiles
    stats: Stats
    events: EventLog
    paths: DirPaths
    tops: TopDirs


class Operations(kernel.Operations):
    """The kernel's requests, answered (see the module doc)."""

    def __init__(self, parts: Parts) -> None:
        super().__init__()
        self.store = parts.store
        self.ns = parts.store.ns
        self.writes = parts.writes
        self.lifetimes = parts.lifetimes
        self.recency = parts.recency
        self.budget = parts.budget
        self.policy = parts.budget.policy
        self.integrity = parts.integrity
        self.tier = parts.tier
        self.control = parts.control
        self.stats = parts.stats
        self.events = parts.events
        self.paths = parts.paths
        self.tops = parts.tops
        # revalidations are the only sign of use: an idle TTL shorter than the timeouts needs them sooner
        self.cache_timeout = min(ENTRY_TIMEOUT, self.policy.idle_ttl / 4) if self.policy.idle_ttl else ENTRY_TIMEOUT

    # ------------------------------------------------------------------
    # attributes
    # ------------------------------------------------------------------
    def _attr(self, ino: Inode) -> EntryAttributes:
        e = EntryAttributes()
        e.st_ino = ino.id
        e.generation = 0
        e.entry_timeout = e.attr_timeout = self.cache_timeout
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
        e.st_blksize = _BLKSIZE
        e.st_blocks = (size + 511) // 512
        e.st_atime_ns = self.recency.get(ino.id, ino.atime_ns)
        e.st_mtime_ns = mtime
        e.st_ctime_ns = ino.ctime_ns
        return e

    async def _fresh_control_attr(self, ino: int) -> EntryAttributes:
        """A control file's attributes with its content produced afresh (a LOOKUP or GETATTR)."""
        if ino != CONTROL_DIR_INODE:
            await self.control.refresh(ino)
        return self._control_attr(ino)

    def _control_attr(self, ino: int) -> EntryAttributes:
        """A control file's attributes as of its last production."""
        e = EntryAttributes()
        e.st_ino = ino
        e.entry_timeout = 0
        e.attr_timeout = 0
        now = time.time_ns()
        e.st_atime_ns = e.st_mtime_ns = e.st_ctime_ns = now
        e.st_uid, e.st_gid = os.getuid(), os.getgid()
        e.st_blksize = _BLKSIZE
        if ino == CONTROL_DIR_INODE:
            e.st_mode = stat.S_IFDIR | 0o555
            e.st_nlink = 2
        else:
            e.st_mode = stat.S_IFREG | (0o644 if self.control.is_command(ino) else 0o444)
            e.st_nlink = 1
            # a new size or mtime makes the kernel drop the pages it cached of the last content
            e.st_size, e.st_mtime_ns = self.control.shown(ino)
        return e

    def _inode(self, ino: int) -> Inode:
        of = self.writes.staged.get(ino)
        if of is not None:
            return of.inode
        inode = self.ns.get(ino)
        if inode is None:
            raise _err(errno.ENOENT)
        return inode

    def _touch_dir(self, parent: int) -> None:
        now = time.time_ns()
        self.ns.update_attrs(self._inode(parent), mtime_ns=now, ctime_ns=now)

    def _check_not_control(self, parent: int, name: bytes) -> None:
        _check_name_length(name)
        if self.control.is_control(parent) or (parent == ROOT_INODE and name == CONTROL_NAME):
            raise _err(errno.EPERM)

    # ------------------------------------------------------------------
    # lookups
    # ------------------------------------------------------------------
    @_timed("lookup")
    @_request
    async def lookup(self, parent_inode: int, name: bytes, ctx: Any = None) -> EntryAttributes:
        _check_name_length(name)
        if self.control.is_control(parent_inode):
            control_ino = self.control.lookup(name) if parent_inode == CONTROL_DIR_INODE else None
            if control_ino is None:
                raise _err(errno.ENOENT)
            return await self._fresh_control_attr(control_ino)
        if parent_inode == ROOT_INODE and name == CONTROL_NAME:
            return self._control_attr(CONTROL_DIR_INODE)
        if name == b".":
            ino: int | None = parent_inode
        elif name == b"..":
            ino = self.ns.parent_of(parent_inode) or ROOT_INODE
        else:
            ino = self.ns.lookup(parent_inode, name)
            if ino is None:
                ino = await self.tier.lookup(parent_inode, name)
        if ino is None:
            self.stats.add(self.tops.of_child(parent_inode, False, name), "misses")
            e = EntryAttributes()
            e.st_ino = 0
            e.entry_timeout = self.tier.negative_timeout
            return e
        self.recency.touch(ino)
        inode = self._inode(ino)
        if not inode.is_dir:
            top = self.tops.of_child(parent_inode, False, name)
            self.tops.remember(ino, top)
            self.stats.add(top, "hits")
        attr = self._attr(inode)
        self.lifetimes.ref(ino)
        return attr

    async def forget(self, inode_list: Sequence[tuple[int, int]]) -> None:
        for ino, n in inode_list:
            if self.lifetimes.unref(ino, n):
                self.tops.forget(ino)
                await self._forgotten(ino)

    async def _forgotten(self, ino: int) -> None:
        """The kernel dropped the inode: no process has it open or mapped, so what it holds is final.

        Written content is committed and confirmed; an inode with no name
        left loses its uncommitted content and then its row and blob.
        """
        inode = self.ns.get(ino)
        if inode is not None and inode.nlink > 0:
            try:
                await self.budget.retry_when_full(lambda: self.writes.commit_inode(ino))
            except ContentDropped:
                pass  # its writes failed for room: it keeps its last content, and its writer is gone
            except (sqlite3.Error, OSError) as e:
                # no reply carries this: the writes stay staged for the idle timer or unmount
                log.warning("cannot commit inode %d at forget: %s", ino, e)
                return
        else:
            self.writes.drop(ino)
        await self._delete_if_unused(ino)

    async def _delete_if_unused(self, ino: int) -> None:
        """Drop an inode nothing holds any more; on failure (disk full even after making room) retry later."""

        async def attempt() -> None:
            self.lifetimes.delete_if_unused(ino)

        try:
            await self.budget.retry_when_full(attempt)
        except (sqlite3.Error, OSError) as e:
            log.warning("cannot delete inode %d yet: %s", ino, e)
            self.lifetimes.doomed.add(ino)

    @_timed("getattr")
    @_request
    async def getattr(self, inode: int, ctx: Any = None) -> EntryAttributes:
        if self.control.is_control(inode):
            return await self._fresh_control_attr(inode)
        ino = self._inode(inode)
        if ino.is_reg:
            # the kernel revalidates attributes of a file in use once per cache timeout: a use, for eviction
            self.recency.touch(inode)
        return self._attr(ino)

    @_data_request
    async def setattr(
        self, inode: int, attr: EntryAttributes, fields: SetattrFields, fh: int | None, ctx: Any
    ) -> EntryAttributes:
        if self.control.is_control(inode):
            # a shell's ``echo run > .mithrilfs/gc`` opens with O_TRUNC, which arrives as a size of 0
            if (self.control.is_command(inode) and not (fields.update_mode or fields.update_uid or fields.update_gid)
                    and (not fields.update_size or attr.st_size == 0)):
                return self._control_attr(inode)
            raise _err(errno.EPERM)
        ino = self._inode(inode)
        now = time.time_ns()
        if fields.update_size:
            if ino.is_dir:
                raise _err(errno.EISDIR)
            if not ino.is_reg:
                raise _err(errno.EINVAL)
            # not a commit point: O_TRUNC arrives here too (with no file handle, like
            # truncate(2)), and its writer is only starting
            await self.writes.truncate(self._staged(inode), attr.st_size)
        changes: dict[str, int] = {}
        if fields.update_mode:
            # GNU ld chmods its output last: the content is whole
            with self.budget.using(inode):
                await self.writes.commit_inode(inode)
            ino = self._inode(inode)
            changes["mode"] = stat.S_IFMT(ino.mode) | stat.S_IMODE(attr.st_mode)
        if fields.update_uid:
            changes["uid"] = attr.st_uid
        if fields.update_gid:
            changes["gid"] = attr.st_gid
        if fields.update_atime:
            changes["atime_ns"] = attr.st_atime_ns
        if fields.update_mtime:
            changes["mtime_ns"] = attr.st_mtime_ns
            of = self.writes.staged.get(inode)
            if of is not None:
                of.mtime_ns = attr.st_mtime_ns
        changes["ctime_ns"] = now
        with self.ns.txn():
            self.ns.update_attrs(ino, **changes)
        return self._attr(ino)

    @_request
    async def readlink(self, inode: int, ctx: Any = None) -> bytes:
        ino = self._inode(inode)
        if not stat.S_ISLNK(ino.mode) or ino.target is None:
            raise _err(errno.EINVAL)
        return ino.target

    # ------------------------------------------------------------------
    # creating and removing names
    # ------------------------------------------------------------------
    def _new_entry(self, parent: int, name: bytes, mode: int, ctx: Any, *, target: bytes | None = None,
                   rdev: int = 0) -> Inode:
        self._check_not_control(parent, name)
        if self.ns.lookup(parent, name) is not None:
            raise _err(errno.EEXIST)
        parent_ino = self._inode(parent)
        if not parent_ino.is_dir:
            raise _err(errno.ENOTDIR)
        is_dir = stat.S_ISDIR(mode)
        gid = ctx.gid
        if parent_ino.mode & stat.S_ISGID:
            # a setgid directory: new entries take its group, new subdirectories its setgid bit
            gid = parent_ino.gid
            if is_dir:
                mode |= stat.S_ISGID
        with self.ns.txn():
            ino = self.ns.create_inode(mode, ctx.uid, gid, target=target, nlink=2 if is_dir else 1, rdev=rdev)
            self.ns.link(parent, name, ino.id)
            if is_dir:
                self.ns.add_link(parent_ino, +1)
            self._touch_dir(parent)
        self.lifetimes.ref(ino.id)
        return ino

    @_request
    async def mknod(self, parent_inode: int, name: bytes, mode: int, rdev: int, ctx: Any) -> EntryAttributes:
        # device nodes are stored with their device number; the mount is nodev, so none can be opened
        if not (stat.S_ISREG(mode) or stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode) or stat.S_ISCHR(mode)
                or stat.S_ISBLK(mode)):
            raise _err(errno.EINVAL)
        dev = rdev if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else 0
        return self._attr(self._new_entry(parent_inode, name, mode, ctx, rdev=dev))

    @_request
    async def mkdir(self, parent_inode: int, name: bytes, mode: int, ctx: Any) -> EntryAttributes:
        return self._attr(self._new_entry(parent_inode, name, stat.S_IFDIR | stat.S_IMODE(mode), ctx))

    @_request
    async def symlink(self, parent_inode: int, name: bytes, target: bytes, ctx: Any) -> EntryAttributes:
        ino = self._new_entry(parent_inode, name, stat.S_IFLNK | 0o777, ctx, target=target)
        self.tier.publish(ino)
        return self._attr(ino)

    @_request
    async def link(self, inode: int, new_parent_inode: int, new_name: bytes, ctx: Any) -> EntryAttributes:
        self._check_not_control(new_parent_inode, new_name)
        if self.control.is_control(inode):
            raise _err(errno.EPERM)
        if self._inode(inode).is_dir:
            raise _err(errno.EPERM)
        with self.budget.using(inode):
            await self.writes.commit_inode(inode)  # a second name: the content is whole
        ino = self._inode(inode)
        if ino.nlink == 0:
            raise _err(errno.ENOENT)
        if self.ns.lookup(new_parent_inode, new_name) is not None:
            raise _err(errno.EEXIST)
        with self.ns.txn():
            self.ns.link(new_parent_inode, new_name, inode)
            self.ns.add_link(ino, +1)
            self._touch_dir(new_parent_inode)
        self.lifetimes.ref(inode)
        return self._attr(ino)

    def _lookup_existing(self, parent: int, name: bytes) -> Inode:
        self._check_not_control(parent, name)
        ino = self.ns.lookup(parent, name)
        if ino is None:
            raise _err(errno.ENOENT)
        return self._inode(ino)

    @_request
    async def unlink(self, parent_inode: int, name: bytes, ctx: Any) -> None:
        ino = self._lookup_existing(parent_inode, name)
        if ino.is_dir:
            raise _err(errno.EISDIR)
        with self.ns.txn():
            self.tier.tombstone(parent_inode, name)
            self.lifetimes.drop_name(self._inode(parent_inode), name, ino)
            self._touch_dir(parent_inode)
        await self._delete_if_unused(ino.id)

    @_request
    async def rmdir(self, parent_inode: int, name: bytes, ctx: Any) -> None:
        ino = self._lookup_existing(parent_inode, name)
        if not ino.is_dir:
            raise _err(errno.ENOTDIR)
        if self.ns.has_children(ino.id):
            raise _err(errno.ENOTEMPTY)
        with self.ns.txn():
            self.tier.tombstone(parent_inode, name)
            self.lifetimes.drop_name(self._inode(parent_inode), name, ino)
            self._touch_dir(parent_inode)
        await self._delete_if_unused(ino.id)

    def _is_ancestor(self, ancestor: int, ino: int) -> bool:
        while ino != ROOT_INODE:
            if ino == ancestor:
                return True
            parent = self.ns.parent_of(ino)
            if parent is None:
                return False
            ino = parent
        return ancestor == ROOT_INODE

    @_request
    async def rename(
        self, parent_inode_old: int, name_old: bytes, parent_inode_new: int, name_new: bytes, flags: int, ctx: Any
    ) -> None:
        self._check_not_control(parent_inode_new, name_new)
        source = self._lookup_existing(parent_inode_old, name_old).id
        other = self.ns.lookup(parent_inode_new, name_new) if flags & kernel.RENAME_EXCHANGE else None
        # a rename the kernel sent completes whatever the budget: the commits below may start an
        # eviction, which must not take the files being renamed
        with self.budget.using(source, *([other] if other is not None else [])):
            # the frameworks publish by rename: what the source holds is whole; commit it first
            await self.writes.commit_inode(source)
            if other is not None:
                await self.writes.commit_inode(other)
            replaced = self._rename(parent_inode_old, name_old, parent_inode_new, name_new, flags)
        if replaced is not None:
            await self._delete_if_unused(replaced)

    def _rename(self, parent_inode_old: int, name_old: bytes, parent_inode_new: int, name_new: bytes,
                flags: int) -> int | None:
        """The rename itself, once the files involved are committed: index changes only, no await.

        Returns the inode whose name it replaced, to be deleted once nothing holds it.
        """
        src = self._lookup_existing(parent_inode_old, name_old)
        dst_id = self.ns.lookup(parent_inode_new, name_new)
        dst = self._inode(dst_id) if dst_id is not None else None
        if src.is_dir and self._is_ancestor(src.id, parent_inode_new):
            raise _err(errno.EINVAL)
        if flags & kernel.RENAME_EXCHANGE:
            if dst is None:
                raise _err(errno.ENOENT)
            if dst.is_dir and self._is_ancestor(dst.id, parent_inode_old):
                raise _err(errno.EINVAL)
            self._exchange(parent_inode_old, name_old, src, parent_inode_new, name_new, dst)
            self.tops.moved(src.id, is_dir=src.is_dir or dst.is_dir)
            self.tier.publish(src)
            self.tier.publish(dst)
            return None
        if dst is not None:
            if flags & kernel.RENAME_NOREPLACE:
                raise _err(errno.EEXIST)
            if dst.id == src.id:
                return None
            if dst.is_dir:
                if not src.is_dir:
                    raise _err(errno.EISDIR)
                if self.ns.has_children(dst.id):
                    raise _err(errno.ENOTEMPTY)
            elif src.is_dir:
                raise _err(errno.ENOTDIR)
        with self.ns.txn():
            self.tier.tombstone(parent_inode_old, name_old)
            if dst is not None:
                self.lifetimes.drop_name(self._inode(parent_inode_new), name_new, dst)
            self.ns.move(parent_inode_old, name_old, parent_inode_new, name_new)
            if src.is_dir and parent_inode_old != parent_inode_new:
                self.ns.add_link(self._inode(parent_inode_old), -1)
                self.ns.add_link(self._inode(parent_inode_new), +1)
            self.ns.update_attrs(src, ctime_ns=time.time_ns())
            self._touch_dir(parent_inode_old)
            if parent_inode_new != parent_inode_old:
                self._touch_dir(parent_inode_new)
        self.tops.moved(src.id, is_dir=src.is_dir)  # a subtree moved: its paths are recomputed lazily
        self.tier.publish(src)
        return dst.id if dst is not None else None

    def _exchange(self, p_a: int, n_a: bytes, a: Inode, p_b: int, n_b: bytes, b: Inode) -> None:
        with self.ns.txn():
            self.ns.retarget(p_a, n_a, b.id)
            self.ns.retarget(p_b, n_b, a.id)
            if p_a != p_b and a.is_dir != b.is_dir:
                moved_to_b = +1 if a.is_dir else -1
                self.ns.add_link(self._inode(p_b), moved_to_b)
                self.ns.add_link(self._inode(p_a), -moved_to_b)
            self._touch_dir(p_a)
            if p_b != p_a:
                self._touch_dir(p_b)

    # ------------------------------------------------------------------
    # file content
    # ------------------------------------------------------------------
    def _staged(self, ino: int) -> Staged:
        """The write state of a regular file (made at its first write or truncate)."""
        of = self.writes.staged.get(ino)
        if of is not None:
            return of
        inode = self._inode(ino)
        if not inode.is_reg:
            raise _err(errno.EINVAL)
        return self.writes.staged_for(inode, self.tops.of_file(ino))

    @_request
    async def create(
        self, parent_inode: int, name: bytes, mode: int, flags: int, ctx: Any
    ) -> tuple[FileInfo, EntryAttributes]:
        ino = self._new_entry(parent_inode, name, stat.S_IFREG | stat.S_IMODE(mode), ctx)
        self.tops.remember(ino.id, self.tops.of_child(parent_inode, False, name))
        # no handle: the kernel opens files itself (OPEN is answered ENOSYS) and sends no RELEASE
        return FileInfo(fh=0, keep_cache=True), self._attr(ino)

    @_timed("read")
    @_request
    async def read(self, inode: int, fh: int, off: int, size: int) -> bytes:
        if self.control.is_control(inode):
            return await self.control.read(inode, off, size)
        while True:
            of = self.writes.staged.get(inode)
            if of is not None and of.has_staging:
                data = of.read(off, size)
                break
            if inode in self.lifetimes.unreadable:
                raise _err(errno.EIO)  # its content was bad and is gone; a retried read must not see it empty
            ino = self._inode(inode)
            digest = ino.hash
            if digest is None:
                data = b""
                break
            if digest not in self.store.blobs.verified:
                if not await self.integrity.verify(ino):
                    raise _err(errno.EIO)  # never served: quarantined, or a miss from now on
                continue  # it may have been written meanwhile
            if off == 0:
                self.tier.record_read(inode)
            data = self.integrity.read(inode, digest, off, size)
            break
        counters = self.stats.by_dir[self.tops.of_file(inode)]
        counters["reads"] += 1
        counters["read_bytes"] += len(data)
        return data

    @_data_request
    async def write(self, inode: int, fh: int, off: int, buf: bytes) -> int:
        if self.control.is_control(inode):
            if not self.control.is_command(inode):
                raise _err(errno.EPERM)
            # a command: run it now; its answer is what the file reads back
            await self.control.run_command(inode, bytes(buf))
            return len(buf)
        if inode in self.writes.failed:
            raise _err(errno.ENOSPC)  # no more eviction for a file that already failed for room
        of = self._staged(inode)
        n = await self._write_with_room(of, off, buf)
        counters = self.stats.by_dir[of.top]
        counters["writes"] += 1
        counters["write_bytes"] += n
        return n

    async def _write_with_room(self, of: Staged, off: int, buf: bytes) -> int:
        """Write into staging; on a full disk, one slice of the cache per file, then the file fails.

        A file gets one eviction slice (``make_room``) for all its writes:
        a writer that still does not fit after that would otherwise evict
        the whole cache and fail anyway.  The retry runs only with the
        index's reserve in place.  A file that fails gives its staging back
        at once (``WritePath.fail``), so the disk, the reserve and unlink
        work again; its content is not kept.
        """
        try:
            return await self.writes.write(of, off, buf)
        except OSError as e:
            if not room_would_help(e):
                raise
        if not of.room_made:
            of.room_made = True
            await self.budget.make_room(len(buf))
            # the idle timer may have committed the file meanwhile: go on with its current state
            of = self._staged(of.inode.id)
            of.room_made = True
            if self.store.ensure_reserve():
                try:
                    return await self.writes.write(of, off, buf)
                except OSError as e:
                    if not room_would_help(e):
                        raise
        await self.writes.fail(of)
        self.store.ensure_reserve()
        self.lifetimes.kernel.invalidate_inode(of.inode.id)  # the kernel's size and pages are of the dropped content
        log.warning("inode %d: no room on the store's disk for its writes even after evicting: its content "
                    "is dropped (ENOSPC)", of.inode.id)
        self.events.emit("error", op="write", error="no space left on the store's disk; the file's content "
                         "was dropped")
        raise _err(errno.ENOSPC)

    @_request
    async def fsync(self, inode: int, fh: int, datasync: bool) -> None:
        if not self.control.is_control(inode):
            await self.writes.commit_inode(inode)

    # ------------------------------------------------------------------
    # directories
    # ------------------------------------------------------------------
    @_request
    async def opendir(self, inode: int, ctx: Any) -> int:
        if self.control.is_control(inode):
            if inode != CONTROL_DIR_INODE:
                raise _err(errno.ENOTDIR)
            return inode
        if not self._inode(inode).is_dir:
            raise _err(errno.ENOTDIR)
        await self.tier.list_dir(inode)
        return inode

    @_request
    async def readdir(self, fh: int, start_id: int, token: DirBuffer) -> None:
        if fh == CONTROL_DIR_INODE:
            for i, (name, ino) in enumerate(self.control.names(), start=1):
                if i > start_id and not token.add(name, self._control_attr(ino), i):
                    return
            return
        after = start_id
        while True:
            batch = self.ns.readdir(fh, after)
            if not batch:
                return
            for entry in batch:
                if not token.add(entry.name, self._attr(self._inode(entry.inode)), entry.offset):
                    return
                if token.plus:  # the kernel counts each entry of a READDIRPLUS as a lookup
                    self.lifetimes.ref(entry.inode)
                after = entry.offset

    async def releasedir(self, fh: int) -> None:
        pass

    async def fsyncdir(self, fh: int, datasync: bool) -> None:
        pass

    @_request
    async def statfs(self, ctx: Any) -> StatvfsData:
        """``df MNT``: the store's bytes are used; the size is the budget, or what the cache can reach on
        its disk (its bytes plus the disk's room) when that is less, so free is the room either leaves
        (a cache on a nearly full disk must not look roomy, nor full when it is not)."""
        st = os.statvfs(self.store.root)
        s = StatvfsData()
        s.f_bsize = st.f_bsize
        s.f_frsize = st.f_frsize
        used = -(-self.budget.physical() // st.f_frsize)
        size = min(self.policy.max_bytes // st.f_frsize, used + st.f_bavail)
        s.f_blocks = max(size, used)
        s.f_bfree = s.f_bavail = max(0, size - used)
        s.f_files = st.f_files
        s.f_ffree = st.f_ffree
        s.f_favail = st.f_favail
        s.f_namemax = NAME_MAX
        return s

    # xattrs are not stored.  ENOSYS makes the kernel answer ENOTSUP itself
    # from then on, which also spares a getxattr("security.capability")
    # round trip on every write.
    async def setxattr(self, inode: int, name: bytes, value: bytes, ctx: Any) -> None:
        raise _err(errno.ENOSYS)

    async def getxattr(self, inode: int, name: bytes, ctx: Any) -> bytes:
        raise _err(errno.ENOSYS)

    async def listxattr(self, inode: int, ctx: Any) -> list[bytes]:
        raise _err(errno.ENOSYS)

    async def removexattr(self, inode: int, name: bytes, ctx: Any) -> None:
        raise _err(errno.ENOSYS)
