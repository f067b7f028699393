"""The byte budget at work: what the store holds, making room, and carrying out an eviction.

``eviction`` decides *which* units go and *when*; this module makes it
happen and keeps the promises around it:

- ``physical``: the bytes the budget counts (unique blobs plus content
  being written).
- After every commit (``committed``, the write path's hook): past the
  budget itself, evict now; past the high watermark, wake the evictor.
- ``evict_unit`` removes every name of a unit as unlink would (content the
  kernel still holds stays until FORGET), tells the kernel and the shared
  tier, and counts it.  Files being written, young files and files a
  request in flight works on (``using``) are pinned.
- A full backing disk (``make_room``, ``retry_when_full``): the 1 MiB
  reserve is room for the index alone; a retry that writes file data runs
  only with it in place (see docs/design.md, "A full disk").
"""

from __future__ import annotations

import contextlib
import errno
import logging
import sqlite3
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, Protocol

import trio

from mithrilfs.cache.eviction import EvictionResult, Evictor, Unit
from mithrilfs.cache.lifetime import Lifetimes, Removed
from mithrilfs.cache.policy import EvictionPolicy
from mithrilfs.cache.recency import Recency
from mithrilfs.cache.staged import ContentDropped, Staged
from mithrilfs.cache.writepath import WritePath
from mithrilfs.observe.events import EventLog
from mithrilfs.observe.stats import Stats
from mithrilfs.observe.tops import TopDirs
from mithrilfs.store.open import Store, is_disk_full

log = logging.getLogger(__name__)

#: How long a full disk's retry of a write waits for the room its eviction made to reach the disk.
ROOM_WAIT_SECONDS = 5.0
#: How often it looks meanwhile.
ROOM_POLL_SECONDS = 0.005
#: What recording an eviction may take of the room it made (the index's pages).
ROOM_SLACK_BYTES = 128 << 10


class EvictionListener(Protocol):
    """Told which directories lost names to eviction (the shared tier: ask again there)."""

    def forget_listed(self, dirs: set[int]) -> None: ...


def room_would_help(e: BaseException) -> bool:
    """A full disk that evicting may cure (a file whose writes already failed for room is past that)."""
    return is_disk_full(e) and not isinstance(e, ContentDropped)


class Budget:
    def __init__(self, store: Store, policy: EvictionPolicy, writes: WritePath, lifetimes: Lifetimes,
                 recency: Recency, stats: Stats, events: EventLog, tops: TopDirs,
                 evicted: EvictionListener) -> None:
        self.store = store
        self.ns = store.ns
        self.blobs = store.blobs
        self.policy = policy
        self.writes = writes
        self.lifetimes = lifetimes
        self.stats = stats
        self.events = events
        self.tops = tops
        self._evicted_listener = evicted
        self.evicted_files = 0
        self._room_lock = trio.Lock()
        self._room_made = 0
        #: The room the disk has once the last slice's content is gone (0: it freed nothing), and until
        #: when a data retry waits for it.
        self._slice_room = 0
        self._slice_deadline = 0.0
        #: Requests waiting for that room (``stats``: ``full_disk_waits``).
        self.room_waits = 0
        #: Inodes a request in flight works on (a rename, link or chmod that committed them first):
        #: the eviction their own commit starts must not take them from under the request.
        self._in_use: dict[int, int] = {}
        self.evictor = Evictor(policy, self.ns, recency, self.physical, self.evict_unit, self._evicted)

    def physical(self) -> int:
        """The bytes the budget counts (``WritePath.physical``)."""
        return self.writes.physical()

    @contextlib.contextmanager
    def using(self, *inodes: int) -> Iterator[None]:
        """Keep *inodes* from eviction while a request works on them."""
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

    # -- keeping to the budget -------------------------------------------
    async def committed(self, of: Staged) -> None:
        """The write path's hook: keep to the budget after every commit."""
        await self.enforce()

    async def enforce(self) -> None:
        """Wake the background evictor at the high watermark; past the budget itself, evict now."""
        if self.physical() > self.policy.max_bytes:
            await self.evictor.run(self.policy.low_bytes, reason="pressure")
        else:
            self.evictor.notify_growth()

    def evict_unit(self, unit: Unit, young_cutoff_ns: int) -> tuple[int, int] | None:
        """Remove every name of a unit, like unlink would; None when it is pinned.

        Pinned: a member has uncommitted writes, a request in flight works
        on it (``using``), or it changed after *young_cutoff_ns*.  An
        evicted inode the kernel still holds (a process has it open or
        mapped, or only its dentry is cached) keeps its content until
        FORGET, which the delete notification brings at once for the merely
        cached.  Returns (bytes freed now, bytes of content that goes at
        FORGET).
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
        # the stats' top-level directory, while the names that say it are still there
        top = self.tops.of_file(inodes[0].id, remember=False) if inodes else None
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
                parent_ino = self.ns.get(names[0][0]) if names else None
                if dir_ino is not None and parent_ino is not None:
                    parent, name = names[0]
                    self.lifetimes.drop_name(parent_ino, name, dir_ino)
                    removed_names.append((parent, name, group))
        freed = sum(self.blobs.collect(d) for d in dropped)
        if group is not None and not self.ns.has_children(group):
            self.lifetimes.delete_if_unused(group)
        self.lifetimes.tell_kernel(removed_names)
        # evicted here, still in the shared tier: found there at the next lookup
        self._evicted_listener.forget_listed({parent for parent, _, _ in removed_names})
        if removed_names and top is not None:
            self.stats.add(top, "evictions")
            self.stats.add(top, "evicted_bytes", freed + later)
        return freed, later

    def _evicted(self, result: EvictionResult) -> None:
        self.evicted_files += result.files
        self.events.emit("eviction", **result.as_dict(), physical_bytes=self.physical())
        log.info("eviction (%s): %d units, %d files, %d bytes freed; %d pinned units skipped",
                 result.reason, result.units, result.files, result.bytes, result.skipped_pinned)

    # -- a full backing disk -------------------------------------------------
    async def write(self, of: Staged, off: int, buf: bytes) -> int:
        """Write into staging; on a full disk, one slice of the cache per file, then the file fails.

        A file gets one eviction slice (``make_room``) for all its writes:
        a writer that still does not fit after that would otherwise evict
        the whole cache and fail anyway.  The retry runs only with the
        index's reserve in place, on the file's write state as it is then
        (the idle timer may have committed it meanwhile).  A file that fails
        gives its staging back at once (``WritePath.fail``), so the disk,
        the reserve and unlink work again; its content is not kept, and
        ``ContentDropped`` (ENOSPC, never retried) is the write's answer.
        """
        try:
            return await self.writes.write(of, off, buf)
        except OSError as e:
            if not room_would_help(e):
                raise
        if not of.room_made:
            of.room_made = True
            await self.make_room(len(buf), data=True)
            of = self.writes.staged_for(of.inode, of.top)
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
        raise ContentDropped(of.inode.id)

    async def make_room(self, at_least: int = 0, *, data: bool = False) -> None:
        """The backing disk is full before the budget is: evict a slice of the cache now.

        A slice is a tenth of what the store holds, at least 1 MiB and at
        least *at_least* (the write waiting for it).  The reserve file is
        released first: it gives the index room to record the evictions
        (and an index-only retry room, see ``retry_after_room``, which
        takes the reserve back).  Requests that hit the full disk together
        make room once.

        A retry that writes file data (*data*) then waits, at most
        ``ROOM_WAIT_SECONDS``, for the slice's room to reach the disk (all
        of it: the file gets one slice for all its writes, and the write
        that hit the full disk may be its first page).  Evicted
        content goes only when the last reference to its file does: the
        kernel's (FORGET, milliseconds after the eviction's notification for
        an inode it only cached, at the close of an open file, perhaps never
        for a mapped one) and the supervisor's descriptor of a file just
        written (dropped when the daemon's "committed" message reaches it),
        so a retry at once can find no room yet: it waits for the room
        instead of failing with ENOSPC.  A request that
        finds the room made by another (an index-only retry's slice) waits
        for that slice the same way.  An index-only retry does not wait:
        the reserve is its room, and a delete at FORGET must not wait for
        other FORGETs; the wait is outside the lock for the same reason.
        """
        seen = self._room_made
        async with self._room_lock:
            if seen == self._room_made:
                log.warning("backing store is full at %d bytes: evicting to make room", self.physical())
                self.store.release_reserve()
                room_before = self.store.room()
                try:
                    result = await self.evictor.make_room(max(self.physical() // 10, 1 << 20, at_least))
                    # what the disk has once the slice's content is gone (less what recording it took)
                    self._slice_room = room_before + result.bytes - ROOM_SLACK_BYTES if result.bytes else 0
                    self._slice_deadline = trio.current_time() + ROOM_WAIT_SECONDS
                    self.ns.shrink_wal()
                finally:
                    self._room_made += 1
        if data:
            await self._until_room(self._slice_room)

    async def _until_room(self, wanted: int) -> None:
        """Wait until the disk has *wanted* bytes free, or the last slice's deadline passed."""
        self.room_waits += 1
        try:
            while self.store.room() < wanted:
                if trio.current_time() >= self._slice_deadline:
                    log.warning("full disk: the room evicting made has not come after %.0f s (evicted files "
                                "still open or mapped): retrying without it", ROOM_WAIT_SECONDS)
                    return
                await trio.sleep(ROOM_POLL_SECONDS)
        finally:
            self.room_waits -= 1

    async def retry_when_full(self, attempt: Callable[[], Awaitable[Any]], *, data: bool = False) -> Any:
        """Run *attempt*; if the disk is full, make room and run it once more (see ``retry_after_room``)."""
        try:
            return await attempt()
        except (OSError, sqlite3.OperationalError) as e:
            if not room_would_help(e):
                raise
        return await self.retry_after_room(attempt, data=data)

    async def retry_after_room(self, attempt: Callable[[], Awaitable[Any]], *, data: bool) -> Any:
        """The disk was full: make room, then run *attempt* once more.

        An index-only retry (a commit, unlink, rename, a delete at FORGET)
        may use the reserve, which is taken back afterwards when there is
        room again; a retry that writes file data (*data*) runs only with
        the reserve in place, on what eviction freed, so written bytes can
        never take the index's last room (without it the retry fails as
        the attempt did).
        """
        await self.make_room(data=data)
        if data:
            if not self.store.ensure_reserve():
                raise OSError(errno.ENOSPC, "no room on the store's disk for the index's reserve")
            return await attempt()
        try:
            return await attempt()
        finally:
            self.store.ensure_reserve()
