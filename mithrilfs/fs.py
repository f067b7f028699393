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

import contextlib
import dataclasses
import errno
import functools
import json
import logging
import os
import sqlite3
import stat
import time
from typing import Any, Awaitable, Callable, Iterator, TypeVar

import trio

from . import kernel
from .kernel import DirBuffer, EntryAttributes, FileInfo, FUSEError, SetattrFields, StatvfsData
from .control import CONTROL_DIR_INODE, CONTROL_NAME, ControlFiles
from .eviction import EvictionPolicy, EvictionResult, Evictor, Recency, Unit
from . import settings, sharing
from .lifetime import Lifetimes, Removed
from .namespace import NAME_MAX, ROOT_INODE, DirPaths, Inode
from .prefetch import Prefetcher
from .remote import RemoteError, RemoteTier
from .stats import ROOT_KEY, EventLog, Stats
from .store import Store, StoreError, is_disk_full
from .units import parse_size
from .writepath import IDLE_COMMIT_SECONDS, OFFLOAD_MIN, ContentDropped, Staged, WritePath

log = logging.getLogger(__name__)

#: Kernel caching of names and attributes.  Changes made through the kernel
#: keep its caches right by themselves; the daemon invalidates what it
#: changes on its own.  The kernel revalidates a name or attributes it uses
#: after a minute, and that LOOKUP or GETATTR is the daemon's only sign of
#: use (reads are served from the page cache), so a minute is the grain of
#: eviction's recency: fine for a compile cache, where a working set lives
#: for hours.
ENTRY_TIMEOUT = 60.0
NEGATIVE_TIMEOUT = 300.0
_BLKSIZE = 128 * 1024
RECENCY_FLUSH_SECONDS = 5.0
#: Index meta key of the counters that outlive a mount (``stats``'s "all mounts").
COUNTERS_META = "counters"
SNAPSHOT_SECONDS = 1.0
SUMMARY_SECONDS = 60.0

F = TypeVar("F", bound=Callable[..., Awaitable[Any]])

def _sqlite_errno(e: sqlite3.Error) -> int:
    """The errno a failed index operation means for the caller."""
    if is_disk_full(e):
        return errno.ENOSPC
    text = str(e)
    if "readonly" in text or "read-only" in text:
        return errno.EROFS
    return errno.EIO


async def _retry_when_full(ops: "Operations", attempt: Callable[[], Awaitable[Any]], *, data: bool = False) -> Any:
    """Run *attempt*; if the disk is full, make room and run it once more (see ``_retry_after_room``)."""
    try:
        return await attempt()
    except (OSError, sqlite3.OperationalError) as e:
        if not _room_would_help(e):
            raise
    return await _retry_after_room(ops, attempt, data=data)


def _room_would_help(e: BaseException) -> bool:
    """A full disk that evicting may cure (a file whose writes already failed for room is past that)."""
    return is_disk_full(e) and not isinstance(e, ContentDropped)


async def _retry_after_room(ops: "Operations", attempt: Callable[[], Awaitable[Any]], *, data: bool) -> Any:
    """The disk was full: make room, then run *attempt* once more.

    The reserve (``Store.ensure_reserve``) is room for the index alone: an
    index-only retry (a commit, unlink, rename, a delete at FORGET) may use
    it, and it is taken back afterwards when there is room again; a retry
    that writes file data (*data*) runs only with the reserve in place, on
    what eviction freed, so written bytes can never take the index's last
    room (without it the retry fails as the attempt did).
    """
    await ops.make_room()
    if data:
        if not ops.store.ensure_reserve():
            raise OSError(errno.ENOSPC, "no room on the store's disk for the index's reserve")
        return await attempt()
    try:
        return await attempt()
    finally:
        ops.store.ensure_reserve()


def _error_policy(*, data: bool) -> Callable[[F], F]:
    """Error policy of the request handlers.

    A full backing disk gets one eviction pass to make room and one retry
    (handlers are written so that a failed attempt changes nothing); *data*
    says the handler writes file data (see ``_retry_after_room``).  Stray
    OSErrors become their errno and anything else EIO, logged here with
    the operation's name and counted in the event log.
    """

    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        async def wrapper(self: "Operations", *args: Any, **kwargs: Any) -> Any:
            try:
                # _retry_when_full, with its first attempt inlined: no closure or extra coroutine per request
                try:
                    return await fn(self, *args, **kwargs)
                except (OSError, sqlite3.OperationalError) as e:
                    if not _room_would_help(e):
                        raise
                return await _retry_after_room(self, lambda: fn(self, *args, **kwargs), data=data)
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
        async def wrapper(self: "Operations", *args: Any, **kwargs: Any) -> Any:
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


class Operations(kernel.Operations):

    def __init__(self, store: Store, policy: EvictionPolicy | None = None, remote: RemoteTier | None = None, *,
                 remote_owner: tuple[int, int] | None = None, after_crash: bool = False,
                 startup_set: str = "default", prefetch: str | None = None,
                 fixed_settings: frozenset[str] = frozenset()) -> None:
        super().__init__()
        self.store = store
        self.ns = store.ns
        self.cas = store.cas
        self.policy = policy or EvictionPolicy()
        self.control = ControlFiles()
        self.control.add_json(b"stats.json", self.stats_snapshot)
        self.control.add_command(b"gc", self._gc_command)
        self.control.add_command(b"commit", self._commit_command)
        self.control.add_command(b"clear", self._clear_command)
        self.control.add_command(b"zero", self._zero_command)
        self.control.add_command(b"usage", self._usage_command)
        self.control.add_json_async(b"usage.json", self._usage)
        self.control.add_command(b"settings", self._settings_command)
        #: Settings given on the mount's command line: ``config`` changes to them wait for the next mount.
        self.fixed_settings = fixed_settings
        self.blobs = store.blobs
        self._offload = trio.CapacityLimiter(2)
        self._saved_counters = self.ns.get_meta(COUNTERS_META)
        self.stats = Stats(self._saved_counters)
        self.evicted_files = 0
        self.events = EventLog(None if store.read_only else store.root / "events.jsonl")
        self.paths = DirPaths(self.ns)
        #: Top-level directory of files the kernel looked up (stats attribution without a query per open).
        self._tops: dict[int, str] = {}
        #: What the last background refresh saw; served to Prometheus from its own thread.
        self.cached_snapshot: dict[str, Any] = {}
        self.writes = WritePath(self.ns, self.blobs, self.stats, self._offload, self._committed)
        self.recency = Recency(self.ns)
        self.lifetimes = Lifetimes(self.ns, self.blobs, self.recency, self.writes.staged.__contains__)
        self.shared = (sharing.SharedTier(self.ns, self.blobs, self.paths, self.events, self.lifetimes, remote,
                                          owner=remote_owner, requeue=after_crash, startup_set=startup_set)
                       if remote is not None else None)
        self.prefetcher = Prefetcher(self.shared, self.policy, self.physical) if self.shared is not None else None
        self.negative_timeout = sharing.NEGATIVE_TIMEOUT if remote is not None else NEGATIVE_TIMEOUT
        # revalidations are the only sign of use: an idle TTL shorter than the timeouts needs them sooner
        self.cache_timeout = min(ENTRY_TIMEOUT, self.policy.idle_ttl / 4) if self.policy.idle_ttl else ENTRY_TIMEOUT
        if self.shared is not None:
            self.control.add_command(b"push", self._push_command)
            self.control.add_command(b"prefetch", self._prefetch_command)
        #: The startup set to prefetch as soon as the mount serves (``mount --prefetch``).
        self.prefetch_at_start = prefetch if self.shared is not None else None
        #: The background nursery of a live, writable mount (prefetches run there).
        self._nursery: trio.Nursery | None = None
        self._room_lock = trio.Lock()
        self._room_made = 0
        #: Inodes a request in flight works on (a rename, link or chmod that committed them first):
        #: the eviction their own commit starts must not take them from under the request.
        self._in_use: dict[int, int] = {}
        self.evictor = Evictor(self.policy, self.ns, self.recency, self.physical, self.evict_unit, self._evicted)

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

    def _top_of_dir(self, d: int) -> str:
        """Which top-level directory *d* is, or is under ("/" for the root itself)."""
        path = self.paths.of_dir(d)
        if not path:
            return ROOT_KEY
        return path.split("/", 1)[0].encode(errors="surrogateescape").decode(errors="replace")

    def _top_of_child(self, parent: int, child_is_dir: bool, name: bytes) -> str:
        if parent == ROOT_INODE:
            return name.decode(errors="replace") if child_is_dir else ROOT_KEY
        return self._top_of_dir(parent)

    def _top_of_file(self, ino: int) -> str:
        names = self.ns.names_of(ino)
        return self._top_of_child(names[0][0], False, names[0][1]) if names else ROOT_KEY

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

    @contextlib.contextmanager
    def _using(self, *inodes: int) -> Iterator[None]:
        """Keep *inodes* from eviction while a request works on them (see ``_in_use``)."""
        for ino in inodes:
            self._in_use[ino] = self._in_use.get(ino, 0) + 1
        try:
            yield
        finally:
            for ino in inodes:
                if (left := self._in_use[ino] - 1) > 0:
                    self._in_use[ino] = left
                else:
                    del self._in_use[ino]

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
            ino = self.control.lookup(name) if parent_inode == CONTROL_DIR_INODE else None
            if ino is None:
                raise _err(errno.ENOENT)
            return await self._fresh_control_attr(ino)
        if parent_inode == ROOT_INODE and name == CONTROL_NAME:
            return self._control_attr(CONTROL_DIR_INODE)
        if name == b".":
            ino: int | None = parent_inode
        elif name == b"..":
            ino = self.ns.parent_of(parent_inode) or ROOT_INODE
        else:
            ino = self.ns.lookup(parent_inode, name)
            if ino is None and self.shared is not None:
                ino = await self.shared.lookup(parent_inode, name)
        if ino is None:
            self.stats.add(self._top_of_child(parent_inode, False, name), "misses")
            e = EntryAttributes()
            e.st_ino = 0
            e.entry_timeout = self.negative_timeout
            return e
        self.recency.touch(ino)
        inode = self._inode(ino)
        if not inode.is_dir:
            top = self._top_of_child(parent_inode, False, name)
            self._tops[ino] = top
            self.stats.add(top, "hits")
        attr = self._attr(inode)
        self.lifetimes.ref(ino)
        return attr

    async def forget(self, inode_list: list[tuple[int, int]]) -> None:
        for ino, n in inode_list:
            if self.lifetimes.unref(ino, n):
                self._tops.pop(ino, None)
                await self._forgotten(ino)

    async def _forgotten(self, ino: int) -> None:
        """The kernel dropped the inode: no process has it open or mapped, so what it holds is final.

        Written content is committed and confirmed; an inode with no name
        left loses its uncommitted content and then its row and blob.
        """
        inode = self.ns.get(ino)
        if inode is not None and inode.nlink > 0:
            try:
                await _retry_when_full(self, lambda: self.writes.commit_inode(ino))
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
            await _retry_when_full(self, attempt)
        except (sqlite3.Error, OSError) as e:
            log.warning("cannot delete inode %d yet: %s", ino, e)
            self.lifetimes.doomed.add(ino)

    def physical(self) -> int:
        """Bytes the store holds on disk: unique blobs plus staging files."""
        return self.blobs.bytes + self.writes.staging_bytes()

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
            with self._using(inode):
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
        self._publish(ino)
        return self._attr(ino)

    @_request
    async def link(self, inode: int, new_parent_inode: int, new_name: bytes, ctx: Any) -> EntryAttributes:
        self._check_not_control(new_parent_inode, new_name)
        if self.control.is_control(inode):
            raise _err(errno.EPERM)
        if self._inode(inode).is_dir:
            raise _err(errno.EPERM)
        with self._using(inode):
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
            self._unpublish(parent_inode, name)
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
            self._unpublish(parent_inode, name)
            self.lifetimes.drop_name(self._inode(parent_inode), name, ino)
            self._touch_dir(parent_inode)
        await self._delete_if_unused(ino.id)

    def _unpublish(self, parent: int, name: bytes) -> None:
        """A user removes a name: the shared tier gets a tombstone for it (evictions never come here)."""
        if self.shared is not None:
            self.shared.removing(parent, name)

    def _publish(self, ino: Inode) -> None:
        """A name now points at *ino*: the shared tier gets it (a directory: everything under it)."""
        if self.shared is not None:
            if ino.is_dir:
                self.shared.queue_tree(ino.id)
            else:
                self.shared.queue_upload(ino.id)

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
        with self._using(source, *([other] if other is not None else [])):
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
            if src.is_dir or dst.is_dir:
                self.paths.clear()
                self._tops.clear()
            self._publish(src)
            self._publish(dst)
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
            self._unpublish(parent_inode_old, name_old)
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
        self._tops.pop(src.id, None)
        if src.is_dir:
            self.paths.clear()  # a subtree moved: recompute lazily
            self._tops.clear()
        self._publish(src)
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
    def _top(self, ino: int) -> str:
        """The top-level directory a file is under, for its stats (remembered from its lookup)."""
        top = self._tops.get(ino)
        if top is None:
            top = self._tops[ino] = self._top_of_file(ino)
        return top

    def _staged(self, ino: int) -> Staged:
        """The write state of a regular file (made at its first write or truncate)."""
        of = self.writes.staged.get(ino)
        if of is not None:
            return of
        inode = self._inode(ino)
        if not inode.is_reg:
            raise _err(errno.EINVAL)
        return self.writes.staged_for(inode, self._top(ino))

    async def make_room(self, at_least: int = 0) -> None:
        """The backing disk is full before the budget is: evict a slice of the cache now.

        A slice is a tenth of what the store holds, at least 1 MiB and at
        least *at_least* (the write waiting for it).

        The reserve file is released first: it gives the index room to
        record the evictions (and an index-only retry room, see
        ``_retry_when_full``, which takes the reserve back).  Requests that
        hit the full disk together make room once.
        """
        seen = self._room_made
        async with self._room_lock:
            if seen != self._room_made:
                return
            log.warning("backing store is full at %d bytes: evicting to make room", self.physical())
            self.store.release_reserve()
            try:
                await self.evictor.make_room(max(self.physical() // 10, 1 << 20, at_least))
                self.ns.shrink_wal()
            finally:
                self._room_made += 1

    async def _committed(self, of: Staged) -> None:
        """After every commit: publish it to the shared tier, and keep to the budget."""
        if self.shared is not None:
            self.shared.queue_upload(of.inode.id)
        await self._enforce_budget()

    async def _enforce_budget(self) -> None:
        """Wake the background evictor at the high watermark; past the budget itself, evict now."""
        if self.physical() > self.policy.max_bytes:
            await self.evictor.run(self.policy.low_bytes, reason="pressure")
        else:
            self.evictor.notify_growth()

    async def _verify(self, ino: Inode) -> None:
        """The first READ of a blob in this mount checks it still hashes to its name.

        The page cache of a new mount is empty, so that first read always
        reaches the daemon.  A mismatch (or a missing blob) is never served:
        the blob goes to quarantine, every name pointing at it goes (the
        next open is a miss and the framework recompiles), and the read
        fails with EIO.
        """
        digest = ino.hash
        if digest is None or digest in self.blobs.verified:
            return
        if ino.size >= OFFLOAD_MIN:
            ok = await trio.to_thread.run_sync(self.blobs.verify, digest, limiter=self._offload)
        else:
            ok = self.blobs.verify(digest)
        if ok:
            return
        if ok is None and self.shared is not None:
            if await self.shared.fetch(ino, self.policy.max_bytes):
                await self._enforce_budget()
                return
            # the shared tier lost it, is down, or this entry's size is wrong: a miss for this
            # name (others with the same hash may name the right size), not corruption
            self.lifetimes.forget_content(digest, [ino])
            raise _err(errno.EIO)
        self.quarantine(digest, "missing" if ok is None else "content does not match its hash")
        raise _err(errno.EIO)

    def _inodes_of(self, digest: bytes) -> list[Inode]:
        return [self._inode(i) for i in self.ns.inodes_with_hash(digest)]

    def quarantine(self, digest: bytes, why: str) -> None:
        """Move a bad blob aside and remove every name that pointed at it."""
        if digest in self.blobs.verified:
            return
        inodes = self._inodes_of(digest)
        top = self._top_of_file(inodes[0].id) if inodes else ROOT_KEY
        self.stats.add(top, "corrupt_blobs")
        self.events.emit("corruption", blob=digest.hex(), why=why, names=sum(i.nlink for i in inodes))
        if self.store.read_only:
            log.error("blob %s is corrupt (%s); read-only store: refusing to serve it", digest.hex(), why)
            return
        log.error("blob %s is corrupt (%s): quarantined, its names removed", digest.hex(), why)
        self.blobs.quarantine(digest)
        self.lifetimes.forget_content(digest, inodes)

    @_request
    async def create(
        self, parent_inode: int, name: bytes, mode: int, flags: int, ctx: Any
    ) -> tuple[FileInfo, EntryAttributes]:
        ino = self._new_entry(parent_inode, name, stat.S_IFREG | stat.S_IMODE(mode), ctx)
        self._tops[ino.id] = self._top_of_child(parent_inode, False, name)
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
            if digest not in self.blobs.verified:
                await self._verify(ino)
                continue  # it may have been written meanwhile
            if off == 0 and self.shared is not None:
                self.shared.record_read(inode)
            data = self._read_blob(inode, digest, off, size)
            break
        counters = self.stats.by_dir[self._top(inode)]
        counters["reads"] += 1
        counters["read_bytes"] += len(data)
        return data

    def _read_blob(self, inode: int, digest: bytes, off: int, size: int) -> bytes:
        # only the first read of a page reaches the daemon (the kernel keeps the pages), so an fd
        # per read costs little, and no cached fd keeps an evicted blob's disk space
        try:
            fd = self.cas.open(digest)
        except FileNotFoundError:
            log.error("blob %s of inode %d is missing", digest.hex(), inode)
            raise _err(errno.EIO) from None
        try:
            return os.pread(fd, size, off)
        finally:
            os.close(fd)

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
            if not _room_would_help(e):
                raise
        if not of.room_made:
            of.room_made = True
            await self.make_room(len(buf))
            # the idle timer may have committed the file meanwhile: go on with its current state
            of = self._staged(of.inode.id)
            of.room_made = True
            if self.store.ensure_reserve():
                try:
                    return await self.writes.write(of, off, buf)
                except OSError as e:
                    if not _room_would_help(e):
                        raise
        await self.writes.fail(of)
        self.store.ensure_reserve()
        self.lifetimes.notify_changed(of.inode.id)  # the kernel's size and pages are of the dropped content
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
        if self.shared is not None:
            await self.shared.sync_dir(inode)
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
                ino = self._inode(entry.inode)
                if not token.add(entry.name, self._attr(ino), entry.offset):
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
        used = -(-self.physical() // st.f_frsize)
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

    # ------------------------------------------------------------------
    # eviction
    # ------------------------------------------------------------------
    def evict_unit(self, unit: Unit, young_cutoff_ns: int) -> tuple[int, int] | None:
        """Remove every name of a unit, like unlink would; None when it is pinned.

        Pinned: a member has uncommitted writes, a request in flight works
        on it (``_in_use``), or it changed after *young_cutoff_ns*.  An evicted inode the kernel still holds (a
        process has it open or mapped, or only its dentry is cached) keeps
        its content until FORGET, which the delete notification brings at
        once for the merely cached.  Returns (bytes freed now, bytes of
        content that goes at FORGET).
        """
        inodes = []
        for ino_id in unit.inodes:
            if ino_id in self.writes.staged or ino_id in self._in_use:
                return None
            ino = self.ns.get(ino_id)
            if ino is None:
                continue
            if ino.ctime_ns > young_cutoff_ns or ino.mtime_ns > young_cutoff_ns:
                return None
            inodes.append(ino)
        removed_names: list[Removed] = []
        later = 0
        for ino in inodes:
            if ino.hash is not None and self.lifetimes.referenced(ino.id):
                info = self.ns.blob_info(ino.hash)
                if info is not None and info[0] == 1:  # no other file shares the blob
                    later += info[1]
        with self.ns.txn():
            dropped = self.lifetimes.remove_all_names(inodes, removed_names, keep_content=True)
            group = unit.group_dir
            if group is not None and not self.ns.has_children(group):
                dir_ino = self.ns.get(group)
                names = self.ns.names_of(group)
                if dir_ino is not None and names:
                    parent, name = names[0]
                    self.lifetimes.drop_name(self._inode(parent), name, dir_ino)
                    removed_names.append((parent, name, group))
        freed = sum(self.blobs.collect(d) for d in dropped)
        if group is not None and not self.ns.has_children(group):
            self.lifetimes.delete_if_unused(group)
        self.lifetimes.tell_kernel(removed_names)
        if self.shared is not None:  # evicted here, still in the shared tier: found there at the next lookup
            self.shared.forget_synced({parent for parent, _, _ in removed_names})
        if removed_names:
            parent, name, ino_id = removed_names[0]
            top = self._top_of_child(parent, ino_id == group, name)
            self.stats.add(top, "evictions")
            self.stats.add(top, "evicted_bytes", freed + later)
        return freed, later

    def _evicted(self, result: EvictionResult) -> None:
        self.evicted_files += result.files
        self.events.emit("eviction", **result.as_dict(), physical_bytes=self.physical())
        log.info("eviction (%s): %d units, %d files, %d bytes freed; %d pinned units skipped",
                 result.reason, result.units, result.files, result.bytes, result.skipped_pinned)

    async def _gc_command(self, request: bytes) -> bytes:
        """``gc`` control file: evict now, down to ``to=SIZE`` (default: the low watermark)."""
        args = dict(part.split("=", 1) for part in request.decode(errors="replace").split() if "=" in part)
        try:
            target = parse_size(args["to"]) if "to" in args else self.policy.low_bytes
        except ValueError:
            raise _err(errno.EINVAL) from None
        idle_before = None
        if self.policy.idle_ttl:
            idle_before = time.time_ns() - int(self.policy.idle_ttl * 1e9)
        result = await self.evictor.run(target, reason="gc", idle_before_ns=idle_before)
        answer = result.as_dict() | {"physical_bytes": self.physical(), "max_bytes": self.policy.max_bytes}
        return (json.dumps(answer) + "\n").encode()

    async def _clear_command(self, request: bytes) -> bytes:
        """``clear`` control file (ccache -C): evict every file not being written, now, however young.

        Files a process holds open keep their content until closed; their
        names go like the rest.  Nothing is published: the shared tier keeps them.
        """
        result = await self.evictor.run(0, reason="clear", everything=True)
        answer = result.as_dict() | {"physical_bytes": self.physical(), "max_bytes": self.policy.max_bytes}
        return (json.dumps(answer) + "\n").encode()

    async def _settings_command(self, request: bytes) -> bytes:
        """``settings`` control file: apply the store's settings now (``mithrilfs config`` on a mounted store).

        Settings fixed on the mount's command line keep their values.  A
        smaller budget evicts at once.
        """
        try:
            stored = settings.load(self.store.root)
            fixed = {k: getattr(self.policy, settings.SETTINGS[k][0]) for k in self.fixed_settings}
            new = settings.policy(stored, fixed)
        except (StoreError, ValueError) as e:
            return (json.dumps({"error": str(e)}) + "\n").encode()
        for f in dataclasses.fields(new):
            setattr(self.policy, f.name, getattr(new, f.name))
        self.evictor.notify_growth()
        return (json.dumps({"applied": True, "kept": sorted(self.fixed_settings)}) + "\n").encode()

    async def _zero_command(self, request: bytes) -> bytes:
        """``zero`` control file (``stats --zero``, ccache -z): every counter starts over, kept ones too."""
        self.stats.zero()
        self.save_counters()
        return (json.dumps({"zeroed_at": self.stats.since}) + "\n").encode()

    def save_counters(self) -> None:
        """Keep the counters in the index, where the store's next mount finds them."""
        record = self.stats.persisted()
        if self.store.read_only or record == self._saved_counters:
            return
        with self.ns.txn():
            self.ns.set_meta(COUNTERS_META, record)
        self._saved_counters = record

    async def _usage_command(self, request: bytes) -> bytes:
        """``usage`` control file: ``top=N`` answers ``usage.json`` and the N largest files (``stats --top N``)."""
        text = request.decode(errors="replace").strip().removeprefix("top=")
        return (json.dumps(await self._usage(int(text) if text.isdigit() else 0)) + "\n").encode()

    async def _usage(self, limit: int = 0) -> dict[str, Any]:
        """Bytes and files per top-level directory (``usage.json``, readable by anyone who sees the mount),
        and the *limit* largest files; the scans run on a reader in a thread."""
        reader = self.ns.reader()
        try:
            by_top, largest = await trio.to_thread.run_sync(
                lambda: (reader.usage_by_top(), reader.largest_files(min(limit, 10_000))), limiter=self._offload)
        finally:
            reader.close()
        answer = {
            "by_top": [{"name": top, "files": n, "bytes": size, "stored_bytes": stored}
                       for top, n, size, stored in by_top],
            "largest": [{"path": self.paths.of_name(parent, name), "bytes": size} for parent, name, size in largest],
        }
        return answer

    async def _commit_command(self, request: bytes) -> bytes:
        """``commit`` control file: commit every written file now, unconfirmed (``mithrilfs run`` at its end)."""
        written = len(self.writes.staged)
        if not self.store.read_only:
            await self.writes.commit_all()
        return (json.dumps({"committed": written - len(self.writes.staged)}) + "\n").encode()

    async def _push_command(self, request: bytes) -> bytes:
        """``push`` control file: queue every file for upload; the CLI follows upload_queue.

        The tier is asked first, so a dead Redis is an error naming the cause at once.
        """
        assert self.shared is not None
        try:
            await trio.to_thread.run_sync(self.shared.remote.ping)
        except RemoteError as e:
            return (json.dumps({"error": f"{self.shared.remote.url}: {e}"}) + "\n").encode()
        return (json.dumps({"queued": self.shared.queue_all()}) + "\n").encode()

    async def _prefetch_command(self, request: bytes) -> bytes:
        """``prefetch`` control file: ``set=NAME`` or ``all`` starts a prefetch; ``stats`` shows its progress."""
        text = request.decode(errors="replace").strip()
        set_name = None if text == "all" else text.removeprefix("set=")
        answer = await self.start_prefetch(set_name)
        return (json.dumps(answer) + "\n").encode()

    async def start_prefetch(self, set_name: str | None) -> dict[str, Any]:
        """Start a prefetch in the background unless one runs; an error names the tier's problem at once."""
        assert self.shared is not None and self.prefetcher is not None
        if self.prefetcher.running:
            return {"started": False, "error": "a prefetch is already running"}
        if self._nursery is None:
            return {"started": False, "error": "the store is read-only"}
        try:
            await trio.to_thread.run_sync(self.shared.remote.ping)
        except RemoteError as e:
            self.prefetcher.state = {"state": "failed", "error": f"{self.shared.remote.url}: {e}"}
            return {"started": False, "error": self.prefetcher.state["error"]}
        self.prefetcher.state = {"state": "running"}
        self._nursery.start_soon(self.prefetcher.run, set_name)
        return {"started": True}

    async def background(self) -> None:
        """Long-running duties of a live mount: eviction, recency written out in batches, deferred deletes."""
        if self.store.read_only:
            return
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            if self.prefetch_at_start is not None:
                nursery.start_soon(self.start_prefetch, self.prefetch_at_start)
            nursery.start_soon(self.evictor.background)
            nursery.start_soon(self._summaries)
            nursery.start_soon(self._idle_commits)
            if self.shared is not None:
                nursery.start_soon(self.shared.run)
            while True:
                await trio.sleep(RECENCY_FLUSH_SECONDS)
                try:
                    self.recency.flush()
                    self.save_counters()
                except (sqlite3.Error, OSError) as e:
                    log.warning("could not write recency and counters to the index: %s", e)
                self.lifetimes.retry_doomed()
                self.store.ensure_reserve()  # taken back once a full disk has room again

    async def _idle_commits(self) -> None:
        """Commit files nobody wrote for ``IDLE_COMMIT_SECONDS``, unconfirmed (see ``writepath``).

        Files written in place and never renamed are then deduplicated,
        counted in the budget as blobs and published like any other.
        """
        while True:
            await trio.sleep(IDLE_COMMIT_SECONDS / 2)
            idle = self.writes.idle(time.monotonic() - IDLE_COMMIT_SECONDS)
            try:
                # files staged in memory in batches; the rest (or everything, after an error) one by one
                left = await self.writes.commit_idle(idle)
            except (sqlite3.Error, OSError) as e:
                log.warning("idle commit of %d files failed (%s); committing them one by one", len(idle), e)
                left = idle
            for of in left:
                try:
                    await _retry_when_full(self, functools.partial(self.writes.commit, of, confirmed=False))
                except (sqlite3.Error, OSError) as e:
                    log.warning("idle commit of inode %d failed: %s", of.inode.id, e)

    async def _summaries(self) -> None:
        """Refresh the snapshot Prometheus serves; write a summary event now and then."""
        last_summary = time.monotonic()
        reader = self.ns.reader()
        try:
            while True:
                # the totals scan every file: a separate connection in a thread keeps it off the loop
                totals = await trio.to_thread.run_sync(reader.totals, limiter=self._offload)
                snap = self.stats_snapshot(totals)
                if time.monotonic() - last_summary >= SUMMARY_SECONDS:
                    last_summary = time.monotonic()
                    self.events.emit("summary", **{k: snap[k] for k in (
                        "hits", "misses", "hit_rate", "files", "physical_bytes", "logical_bytes", "evictions",
                        "commits", "corrupt_blobs")})
                await trio.sleep(SNAPSHOT_SECONDS)
        finally:
            reader.close()

    # ------------------------------------------------------------------
    # lifecycle and observation
    # ------------------------------------------------------------------
    def stats_snapshot(self, totals: tuple[int, int, int] | None = None) -> dict[str, Any]:
        """Current stats; *totals* (files, logical bytes, blobs) when the caller already counted them."""
        files, logical, blobs = totals if totals is not None else self.ns.totals()
        snap = self.stats.snapshot({
            "logical_bytes": logical,
            "physical_bytes": self.physical(),
            "max_bytes": self.policy.max_bytes,
            "low_bytes": self.policy.low_bytes,
            "files": files,
            "blobs": blobs,
            "written_files": len(self.writes.staged),
            "evicted_files": self.evicted_files,
            "pid": os.getpid(),
            "store": str(self.store.root),
            "read_only": self.store.read_only,
            "eviction": self.evictor.current.as_dict() if self.evictor.current is not None else None,
            **(self.shared.counters | {"upload_queue": self.shared.pending(),
                                       "remote_last_error": self.shared.remote.last_error,
                                       "prefetch": self.prefetcher.state} if self.shared else {}),
        })
        self.cached_snapshot = snap
        return snap

    async def unmounting(self) -> None:
        """A clean unmount is a commit point: everything written is committed (unconfirmed, see ``writepath``)."""
        if self.store.read_only:
            return
        try:
            await self.writes.commit_all()
        except (sqlite3.Error, OSError) as e:
            log.error("could not commit every written file at unmount: %s", e)
        if self.shared is not None:
            await self.shared.unmounting()

    def shutdown(self) -> None:
        """Drop what could not be committed, tidy the index and mark the store clean."""
        self.writes.shutdown()
        self.lifetimes.clear()
        if self.store.read_only:
            return
        try:
            self.recency.flush()
            self.save_counters()
            self.ns.recover(after_crash=False)
            self.store.collect_garbage()
            self.ns.mark_clean()
        except (sqlite3.Error, OSError) as e:
            # e.g. the store went read-only: the next mount repairs what this could not
            log.error("could not tidy the store at unmount: %s", e)

