"""The filesystem's answers to kernel requests: it translates requests, nothing else.

Each handler looks things up in the namespace, hands content to the write
path (``staging`` and ``writepath``: staging and commits), inode lifetimes to ``lifetime``
(kernel references, names removed, content freed), blobs to ``blobs``, and
records what happened in ``stats``.  Everything runs on one trio event
loop, so namespace access needs no locks; the code re-checks what it relies
on after every ``await``.

Without passthrough the kernel opens and closes files itself: OPEN and
FLUSH are answered ENOSYS, so a cached open, read and close never reaches
the daemon, and READ, WRITE and SETATTR carry the inode.  With it
(``passthrough``), OPEN and RELEASE are answered, and a large committed
file's read-only open gets its blob as backing file.  Commit
points (``writepath``): a rename of a written file, fsync, link, chmod,
FORGET, a clean unmount and the idle timer.  Content stays while the kernel
holds the inode (an open file, an mmapped ``.so``) and goes at FORGET.

What a handler's failure answers, and its latency: ``policy``; the
attributes an answer carries: ``attributes``.
"""

from __future__ import annotations

import errno
import functools
import logging
import os
import sqlite3
import stat
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from mithrilfs import kernel
from mithrilfs.cache.budget import Budget
from mithrilfs.cache.integrity import Integrity
from mithrilfs.cache.lifetime import Lifetimes
from mithrilfs.cache.names import Names
from mithrilfs.cache.recency import Recency
from mithrilfs.cache.recompiles import Recompiles
from mithrilfs.cache.staged import ContentDropped, Staged
from mithrilfs.cache.writepath import WritePath
from mithrilfs.control.node import ControlNode
from mithrilfs.fs.attributes import Attributes
from mithrilfs.fs.passthrough import Passthrough
from mithrilfs.fs.policy import data_request, request, timed
from mithrilfs.kernel import DirBuffer, EntryAttributes, FileInfo, FUSEError, SetattrFields, StatvfsData
from mithrilfs.observe.events import EventLog
from mithrilfs.observe.stats import Stats
from mithrilfs.observe.tops import TopDirs
from mithrilfs.shared.tier import Tier
from mithrilfs.store.namespace import NAME_MAX, ROOT_INODE, Inode
from mithrilfs.store.open import Store

log = logging.getLogger("mithrilfs.fs")  # the name the handlers have always logged under

def _check_name_length(name: bytes) -> None:
    if len(name) > NAME_MAX:
        raise FUSEError(errno.ENAMETOOLONG)


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
    control: ControlNode
    stats: Stats
    events: EventLog
    tops: TopDirs
    names: Names
    recompiles: Recompiles
    #: Head starts for the next request, run once a reply is written (``lookup``).
    after_reply: kernel.AfterReply
    #: Which opens get their blob as backing file (``open``).
    passthrough: Passthrough


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
        self.tops = parts.tops
        self.names = parts.names
        self.recompiles = parts.recompiles
        self.after_reply = parts.after_reply
        self.passthrough = parts.passthrough
        #: An inode by number, ENOENT when gone (``Names.inode``); bound once: every request asks.
        self._inode = parts.names.inode
        #: An inode's attributes for an answer (``attributes.Attributes.of``); bound once, as ``_inode``.
        self._attr = Attributes(parts.writes, parts.recency, self.policy.idle_ttl).of

    def _check_not_control(self, parent: int, name: bytes) -> None:
        _check_name_length(name)
        self.control.refuse_names_in(parent, name)

    # ------------------------------------------------------------------
    # lookups
    # ------------------------------------------------------------------
    @timed("lookup")
    @request
    async def lookup(self, parent_inode: int, name: bytes, ctx: Any = None) -> EntryAttributes:
        _check_name_length(name)
        if self.control.owns(parent_inode) or self.control.is_its_name(parent_inode, name):
            return await self.control.lookup(parent_inode, name)
        if self.tier.in_use():  # the first use after an idle spell: the fleet's news first
            await self.tier.fresh()
        if name == b".":
            ino: int | None = parent_inode
        elif name == b"..":
            ino = self.ns.parent_of(parent_inode) or ROOT_INODE
        else:
            found = self.ns.lookup_inode(parent_inode, name)
            ino = found.id if found is not None else await self.tier.lookup(parent_inode, name)
        if ino is None:
            self.stats.add(self.tops.of_child(parent_inode, False, name), "misses")
            self.recompiles.missed(parent_inode, name)
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
            if not self.lifetimes.referenced(ino) and inode.is_reg and ino not in self.writes.staged:
                # the kernel meets the file for the first time: its READ is coming
                self.after_reply.defer(functools.partial(self.integrity.read_ahead.after_lookup, inode, top))
        else:
            # a program entering a directory (a compiled kernel's) opens its files next
            self.after_reply.defer(functools.partial(self.ns.preload_dir, ino))
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

    @timed("getattr")
    @request
    async def getattr(self, inode: int, ctx: Any = None) -> EntryAttributes:
        if self.control.owns(inode):
            return await self.control.getattr(inode)
        ino = self._inode(inode)
        if ino.is_reg:
            # the kernel revalidates attributes of a file in use once per cache timeout: a use, for eviction
            self.recency.touch(inode)
        return self._attr(ino)

    @data_request
    async def setattr(
        self, inode: int, attr: EntryAttributes, fields: SetattrFields, fh: int | None, ctx: Any
    ) -> EntryAttributes:
        if self.control.owns(inode):
            return self.control.setattr(inode, attr, fields)
        ino = self._inode(inode)
        now = time.time_ns()
        if fields.update_size:
            if ino.is_dir:
                raise FUSEError(errno.EISDIR)
            if not ino.is_reg:
                raise FUSEError(errno.EINVAL)
            if self.passthrough.holds(inode):
                raise FUSEError(errno.ETXTBSY)  # a reader maps its blob (``passthrough``)
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

    @request
    async def readlink(self, inode: int, ctx: Any = None) -> bytes:
        ino = self._inode(inode)
        if not stat.S_ISLNK(ino.mode) or ino.target is None:
            raise FUSEError(errno.EINVAL)
        return ino.target

    # ------------------------------------------------------------------
    # creating and removing names
    # ------------------------------------------------------------------
    def _new_entry(self, parent: int, name: bytes, mode: int, ctx: Any, *, target: bytes | None = None,
                   rdev: int = 0) -> Inode:
        self._check_not_control(parent, name)
        return self.names.create(parent, name, mode, ctx.uid, ctx.gid, target=target, rdev=rdev)

    @request
    async def mknod(self, parent_inode: int, name: bytes, mode: int, rdev: int, ctx: Any) -> EntryAttributes:
        # device nodes are stored with their device number; the mount is nodev, so none can be opened
        if not (stat.S_ISREG(mode) or stat.S_ISFIFO(mode) or stat.S_ISSOCK(mode) or stat.S_ISCHR(mode)
                or stat.S_ISBLK(mode)):
            raise FUSEError(errno.EINVAL)
        dev = rdev if stat.S_ISCHR(mode) or stat.S_ISBLK(mode) else 0
        return self._attr(self._new_entry(parent_inode, name, mode, ctx, rdev=dev))

    @request
    async def mkdir(self, parent_inode: int, name: bytes, mode: int, ctx: Any) -> EntryAttributes:
        return self._attr(self._new_entry(parent_inode, name, stat.S_IFDIR | stat.S_IMODE(mode), ctx))

    @request
    async def symlink(self, parent_inode: int, name: bytes, target: bytes, ctx: Any) -> EntryAttributes:
        return self._attr(self._new_entry(parent_inode, name, stat.S_IFLNK | 0o777, ctx, target=target))

    @request
    async def link(self, inode: int, new_parent_inode: int, new_name: bytes, ctx: Any) -> EntryAttributes:
        self._check_not_control(new_parent_inode, new_name)
        if self.control.owns(inode) or self._inode(inode).is_dir:
            raise FUSEError(errno.EPERM)
        with self.budget.using(inode):
            await self.writes.commit_inode(inode)  # a second name: the content is whole
        return self._attr(self.names.link(inode, new_parent_inode, new_name))

    @request
    async def unlink(self, parent_inode: int, name: bytes, ctx: Any) -> None:
        self._check_not_control(parent_inode, name)
        await self._delete_if_unused(self.names.remove(parent_inode, name, is_dir=False))

    @request
    async def rmdir(self, parent_inode: int, name: bytes, ctx: Any) -> None:
        self._check_not_control(parent_inode, name)
        await self._delete_if_unused(self.names.remove(parent_inode, name, is_dir=True))

    @request
    async def rename(
        self, parent_inode_old: int, name_old: bytes, parent_inode_new: int, name_new: bytes, flags: int, ctx: Any
    ) -> None:
        self._check_not_control(parent_inode_new, name_new)
        self._check_not_control(parent_inode_old, name_old)
        source = self.names.existing(parent_inode_old, name_old).id
        other = self.ns.lookup(parent_inode_new, name_new) if flags & kernel.RENAME_EXCHANGE else None
        # a rename the kernel sent completes whatever the budget: the commits below may start an
        # eviction, which must not take the files being renamed
        rename = functools.partial(self.names.rename, parent_inode_old, name_old, parent_inode_new, name_new,
                                   exchange=bool(flags & kernel.RENAME_EXCHANGE),
                                   noreplace=bool(flags & kernel.RENAME_NOREPLACE))
        with self.budget.using(source, *([other] if other is not None else [])):
            if other is not None:
                await self.writes.commit_inode(other)
            # the frameworks publish by rename: what the source holds is whole; its commit and the
            # rename are one transaction
            replaced = await self.writes.commit_inode(source, along=rename)
        self.recompiles.settle(source)  # a file renamed into its cache entry: judged under its final name
        if replaced is not None:
            await self._delete_if_unused(replaced)

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
            raise FUSEError(errno.EINVAL)
        return self.writes.staged_for(inode, self.tops.of_file(ino))

    @request
    async def create(
        self, parent_inode: int, name: bytes, mode: int, flags: int, ctx: Any
    ) -> tuple[FileInfo, EntryAttributes]:
        ino = self._new_entry(parent_inode, name, stat.S_IFREG | stat.S_IMODE(mode), ctx)
        self.tops.remember(ino.id, self.tops.of_child(parent_inode, False, name))
        if self.passthrough.answers_open():  # a RELEASE comes: the inode is open through the page cache
            return self.passthrough.opened_cached(ino.id), self._attr(ino)
        # no handle: the kernel opens files itself (OPEN is answered ENOSYS) and sends no RELEASE
        return FileInfo(fh=0, keep_cache=True), self._attr(ino)

    @request
    async def open(self, inode: int, flags: int, ctx: Any) -> FileInfo:
        if self.control.owns(inode):
            if not self.passthrough.answers_open():
                raise FUSEError(errno.ENOSYS)
            return FileInfo(fh=0, keep_cache=True)  # as the kernel's own open: never counted, never handed
        return await self.passthrough.open(self._inode(inode), flags)

    async def release(self, inode: int, fh: int) -> None:
        if not self.control.owns(inode):
            self.passthrough.release(inode, fh)

    @timed("read")
    @data_request  # a first read of content in the shared tier writes it into the store
    async def read(self, inode: int, fh: int, off: int, size: int) -> bytes | memoryview:
        if self.control.owns(inode):
            return await self.control.read(inode, off, size)
        data: bytes | memoryview
        while True:
            of = self.writes.staged.get(inode)
            if of is not None and of.has_staging:
                data = of.read(off, size)
                break
            if inode in self.lifetimes.unreadable:
                raise FUSEError(errno.EIO)  # its content was bad and is gone; a retried read must not see it empty
            ino = self._inode(inode)
            digest = ino.hash
            if digest is None:
                data = b""
                break
            first = None
            if digest not in self.integrity.blobs.verified:
                first = self.integrity.read_small(ino, off, size)  # hashed and served from one read
                if first is None:
                    if not await self.integrity.verify(ino):
                        raise FUSEError(errno.EIO)  # never served: quarantined, or a miss from now on
                    continue  # it may have been written meanwhile
            if off == 0:
                self.tier.record_read(inode)
            data = first if first is not None else self.integrity.read(inode, digest, off, size)
            break
        counters = self.stats.by_dir[self.tops.of_file(inode)]
        counters["reads"] += 1
        counters["read_bytes"] += len(data)
        return data

    @data_request
    async def write(self, inode: int, fh: int, off: int, buf: bytes) -> int:
        if self.control.owns(inode):
            return await self.control.write(inode, buf)
        code = self.writes.failed.get(inode)
        if code is not None:
            raise FUSEError(code)  # no more eviction for a file that already failed for room, nor writes after a tear
        of = self._staged(inode)
        n = await self.budget.write(of, off, buf)
        counters = self.stats.by_dir[of.top]
        counters["writes"] += 1
        counters["write_bytes"] += n
        return n

    @request
    async def fsync(self, inode: int, fh: int, datasync: bool) -> None:
        if not self.control.owns(inode):
            await self.writes.commit_inode(inode)

    # ------------------------------------------------------------------
    # directories
    # ------------------------------------------------------------------
    @request
    async def opendir(self, inode: int, ctx: Any) -> int:
        if self.control.owns(inode):
            return self.control.opendir(inode)
        if not self._inode(inode).is_dir:
            raise FUSEError(errno.ENOTDIR)
        await self.tier.list_dir(inode)
        return inode

    @request
    async def readdir(self, fh: int, start_id: int, token: DirBuffer) -> None:
        if self.control.owns(fh):
            self.control.readdir(start_id, token)
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

    @request
    async def fsyncdir(self, fh: int, datasync: bool) -> None:
        self.ns.commit_deferred()  # the names created in it are in the index: a create commits late

    @request
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
        raise FUSEError(errno.ENOSYS)

    async def getxattr(self, inode: int, name: bytes, ctx: Any) -> bytes:
        raise FUSEError(errno.ENOSYS)

    async def listxattr(self, inode: int, ctx: Any) -> list[bytes]:
        raise FUSEError(errno.ENOSYS)

    async def removexattr(self, inode: int, name: bytes, ctx: Any) -> None:
        raise FUSEError(errno.ENOSYS)
