"""Warm a node from the shared tier before its workload asks: names, and blobs in parallel as they come.

A cold node that lets the framework pull its cache file by file pays one
round trip per directory and per file, one after another as the framework
asks.  ``Prefetcher`` instead takes a whole *startup set* (what workloads
read in their first minutes, in order, with each name's entry:
``stores.records``) or the whole namespace.  A set's names are created from
the set itself (``warm.order``; only what it cannot place is listed), the
whole namespace's by listing every directory in pipelined batches.  The
blobs come with several workers, each asking for many small blobs in one
pipeline (or a pack's range), a set's in the order its workload read them,
from the first batch of names on (``Todo``: a set's thousands of names are
created a batch at a time while the first blobs arrive).
A blob a read (or a read-ahead) is already bringing is not asked for again,
and a read of a blob a worker is bringing waits for it (``sync.in_flight``);
a read of a blob in a batch no worker has taken yet starts that batch at
once and waits for it, and the workers go on after it (``warm.batches``:
the prefetch follows its reader).
By default a mount runs it in the background as soon as it serves; ``mount
--prefetch`` waits for it.  Every blob is verified
(size and blake3) before it enters the store; a missing or corrupt one is a
miss, counted, never a failure.  It stops adding blobs at the low watermark
of the budget.  The store's disk filling up stops it (one line naming
ENOSPC, the tier's level untouched): what was written counts, the rest stays
listed and is fetched at its read, when the read path makes room.

The ``state`` dict is what ``stats`` shows while it runs (``mithrilfs
prefetch`` and ``status --ready`` follow it).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import trio

from mithrilfs.cache.policy import EvictionPolicy
from mithrilfs.crash_points import crash_point
from mithrilfs.shared.stores.base import RemoteStore
from mithrilfs.shared.stores.entries import RemoteEntry, RemoteError
from mithrilfs.shared.sync.in_flight import Queued
from mithrilfs.shared.sync.local_disk import cause, disk_full_message
from mithrilfs.shared.warm.batches import Batches
from mithrilfs.shared.warm.order import StartupOrder
from mithrilfs.store.blobs import Blobs
from mithrilfs.store.namespace import DirPaths, Inode, Namespace
from mithrilfs.store.open import is_disk_full

log = logging.getLogger(__name__)

#: Parallel fetch workers (threads blocked on the tier, hashing, writing staging files).  Each batch is
#: one pipeline from Redis, or GETs over the bucket's pool of ``stores.s3.conn.PARALLEL`` connections, which
#: bounds the requests a prefetch has in flight; the mount's own reads use other threads.
WORKERS = 4
#: Blobs and bytes per batch of small blobs: a read waiting for one waits for its batch.
BATCH_BLOBS = 64
BATCH_BYTES = 8 << 20
#: Blobs per batch of a prefetch nobody waits for: its workload reads meanwhile, and a read-ahead's GETs
#: queue behind the batches in the bucket's pool, so they are kept short.
BACKGROUND_BATCH_BLOBS = 16
#: A store that packs blobs (a bucket: one range GET per pack a batch touches, not one per blob) has its
#: batches cut by bytes and at the parts of its packs instead (``RemoteStore.container_of``): a batch of
#: this many bytes or more ends where the next blob is in another part (see docs/benchmarks.md, "H, a new
#: node across a 20 ms bucket": prefetch batches at pack boundaries).
PACKED_BATCH_MIN_BYTES = 4 << 20
#: Ended prefetches whose final states the next ones keep (``earlier``): a command following one finds its
#: result after another began.
KEPT_ENDED = 4


class BlobsOnTheWay(Protocol):
    """``sync.in_flight.InFlight`` as the prefetch sees it: what a read is bringing is not asked again."""

    missed: set[tuple[bytes, int]]
    limiter: trio.CapacityLimiter
    queued: Queued | None

    def claim(self, nodes: list[Inode]) -> tuple[list[Inode], dict[bytes, tuple[trio.Event, int]],
                                                 list[trio.Event]]: ...

    def release(self, events: dict[bytes, tuple[trio.Event, int]]) -> None: ...


class SmallFetch(Protocol):
    """``sync.small.SmallBlobs`` as the prefetch sees it: a batch of small blobs, which arrived."""

    async def fetch(self, batch: list[Inode], limiter: trio.CapacityLimiter) -> list[bool]: ...


class Prefetcher:
    """The mount's prefetches, one at a time (see the module doc); ``state`` is the last one's."""

    def __init__(self, *, ns: Namespace, paths: DirPaths, blobs: Blobs, remote: RemoteStore, counters: dict[str, int],
                 policy: EvictionPolicy, physical: Callable[[], int], in_flight: BlobsOnTheWay, small: SmallFetch,
                 fetch_blob: Callable[[Inode, int], Awaitable[bool]], order_of: Callable[[str], StartupOrder],
                 merge: Callable[[int, str, dict[bytes, RemoteEntry], set[bytes] | None], object],
                 mark_synced: Callable[[int], None], thread: Callable[..., Awaitable[Any]]) -> None:
        self.ns = ns
        self.paths = paths
        self.blobs = blobs
        self.remote = remote
        self.counters = counters
        self.policy = policy
        #: Bytes the store holds now (``Operations.physical``).
        self.physical = physical
        self.in_flight = in_flight
        self.small = small
        #: Brings one (large) blob, streamed (``RemoteFetch.fetch_blob``).
        self.fetch_blob = fetch_blob
        #: A startup set as this mount knows it (the tier's ``order_of``).
        self.order_of = order_of
        #: Materializes a directory's listed names (``Reconciler.merge``).
        self.merge = merge
        #: Tells the tier's directory syncs a directory was just merged.
        self.mark_synced = mark_synced
        #: The tier's worker threads, for the listings.
        self.thread = thread
        self.state: dict[str, Any] = {"state": "idle"}
        #: Prefetches begun by this daemon: each state's ``run``.
        self.runs = 0

    @property
    def running(self) -> bool:
        return self.state["state"] == "running"

    def begin(self, set_name: str | None, *, background: bool) -> int:
        """Show a prefetch of a startup set (None: the whole namespace) as running from now, numbered
        (``run``); the final states of those that ended before stay in it (``earlier``, newest first).
        *background*: nobody waits for it (the mount's default), shown as such.  Its number."""
        ended = [self.ended(self.state)] if "run" in self.state else []
        self.runs += 1
        self.state = {"state": "running", "set": set_name or "*", "run": self.runs, "files": 0, "bytes": 0,
                      "total_files": 0, "total_bytes": 0, "misses": 0, "skipped_for_budget": 0, "hurried": 0,
                      "seconds": 0.0,
                      "earlier": (ended + self.state.get("earlier", []))[:KEPT_ENDED]}
        if background:
            self.state["background"] = True
        return self.runs

    @staticmethod
    def ended(state: dict[str, Any]) -> dict[str, Any]:
        """A prefetch's state without those of the ones before it."""
        return {k: v for k, v in state.items() if k != "earlier"}

    async def run(self, set_name: str | None, *, background: bool = False) -> dict[str, Any]:
        """Run the prefetch ``begin`` showed (of *set_name*); the final state.  *background*: nobody waits
        for it, so its batches are short."""
        start = time.monotonic()
        self.blobs.writer.start()  # here, on the loop's thread: the writing process dies with the daemon
        try:
            try:
                await self._prefetch(set_name, BACKGROUND_BATCH_BLOBS if background else BATCH_BLOBS)
            finally:
                # off the loop (it waits for a read-ahead's batch in the child, then for the child to exit),
                # and before the state says the prefetch ended: a next one starts its own child
                with trio.CancelScope(shield=True):
                    await trio.to_thread.run_sync(self.blobs.writer.close)
            self.state["state"] = "done"
        except Exception as group:  # the workers' nursery wraps what they raise: the error inside counts
            e = cause(group)
            if is_disk_full(e):  # the store's disk, not the tier: stop, and leave the rest to the reads
                self.state.update(state="failed", error=disk_full_message(e))
            elif isinstance(e, RemoteError):
                self.state.update(state="failed", error=f"{self.remote.url}: {e}")
            else:  # an answer nobody foresaw fails the prefetch, never the mount
                log.error("prefetch %s failed", set_name or "*", exc_info=e)
                self.state.update(state="failed", error=f"{self.remote.url}: {type(e).__name__}: {e}")
        finally:
            self.state["seconds"] = round(time.monotonic() - start, 3)
        log.info("prefetch %s: %s", set_name or "*", self.ended(self.state))
        return self.state

    # -- names -----------------------------------------------------------
    async def _prefetch(self, set_name: str | None, batch_blobs: int) -> None:
        """Name what is wanted and fetch it, at once: the workers fetch the first batches while the rest
        of a set's names are created, rather than wait for all of them.  While it runs, a read of a blob
        in a batch not yet taken starts that batch (``Batches.hurry``, on the tier's threads)."""
        limiter = trio.CapacityLimiter(WORKERS)
        try:
            async with trio.open_nursery() as nursery:
                def hurried(batch: list[Inode]) -> None:  # claimed now: the read that hurried it waits for it
                    self.state["hurried"] += 1
                    nursery.start_soon(self._take, batch, self.in_flight.claim(batch), self.in_flight.limiter)

                queue = Batches(hurried)
                self.in_flight.queued = queue
                for _ in range(WORKERS):
                    nursery.start_soon(self._worker, queue, limiter)
                todo = Todo(self, queue, batch_blobs, in_order=set_name is not None)
                try:
                    await self._names(set_name, todo.add)
                    todo.finish()
                finally:
                    queue.close()
        finally:
            self.in_flight.queued = None

    async def _names(self, set_name: str | None, wanted: Callable[[list[Inode]], None]) -> None:
        """Materialize the names wanted; *wanted* is told the inodes whose content is not here yet (a set's
        in its order, a batch of names at a time)."""
        if set_name is None:
            wanted(await self._listed(await self.thread(self.remote.all_dirs), None))
            return
        order = self.order_of(set_name)
        told = False

        def materialized(files: list[Inode]) -> None:
            nonlocal told
            told = True
            wanted([n for n in files if not self._present(n)])

        await order.load(materialized)  # the names come with the set: no manifest per directory
        if not told:  # loaded before (or by the look-ahead, while this waited)
            wanted([n for n in order.files() if not self._present(n)])
        if order.unresolved:  # what the set could not place (a torn or hostile set): listed, as before
            only: dict[str, set[bytes]] = {}
            for p in order.unresolved:
                d, _, name = p.rpartition("/")
                only.setdefault(d, set()).add(name.encode(errors="surrogateescape"))
            order.unresolved = []
            wanted(await self._listed(set(only), only))

    async def _listed(self, dirs: set[str] | list[str], only: dict[str, set[bytes]] | None) -> list[Inode]:
        """Materialize the names of directories listed from the tier (*only*: just these names, their
        ancestors listed too); the inodes whose content is not here yet."""
        dirs = set(dirs)
        if only is not None:
            for d in list(dirs):  # every ancestor too, to materialize the directories on the way
                parts = d.split("/") if d else []
                for i in range(len(parts)):
                    parent = "/".join(parts[:i])
                    dirs.add(parent)
                    only.setdefault(parent, set()).add(parts[i].encode(errors="surrogateescape"))
        listing = await self.thread(self.remote.list_dirs, sorted(dirs))
        wanted: list[Inode] = []
        # parents before children: a directory's own name is materialized by its parent's pass
        for d in sorted(listing, key=lambda x: (x.count("/") if x else -1, x)):
            ino = self.paths.dir_at(d)
            if ino is None:
                continue
            self.merge(ino, d, listing[d], None if only is None else only.get(d, set()))
            self.mark_synced(ino)
            for name, entry in listing[d].items():
                if entry.type != "f" or (only is not None and name not in only.get(d, set())):
                    continue
                child = self.ns.lookup(ino, name)
                node = self.ns.get(child) if child is not None else None
                if node is not None and node.is_reg and node.hash is not None and not self._present(node):
                    wanted.append(node)
        return wanted

    def _present(self, node: Inode) -> bool:
        return self.blobs.cas.exists(node.hash)  # type: ignore[arg-type]

    # -- blobs -------------------------------------------------------------
    async def _worker(self, queue: Batches, limiter: trio.CapacityLimiter) -> None:
        while (batch := await queue.next()) is not None:
            await self._take(batch, self.in_flight.claim(batch), limiter)  # a blob on its way is not asked again

    async def _take(self, batch: list[Inode], claimed: tuple[list[Inode], dict[bytes, tuple[trio.Event, int]],
                                                              list[trio.Event]], limiter: trio.CapacityLimiter) -> None:
        """Fetch a batch's blobs *claimed* (``InFlight.claim``) and wait for those another fetch brings."""
        mine, events, others = claimed
        try:
            await self._fetch_batch_of(mine, limiter)
        finally:
            self.in_flight.release(events)
        for event in others:  # brought by a read or a read-ahead: counted once it is here
            self.counters["remote_fetch_joined"] = self.counters.get("remote_fetch_joined", 0) + 1
            await event.wait()
        fetched = {id(node) for node in mine}  # by identity: a batch holds hundreds (packs)
        for node in batch:
            if id(node) not in fetched:
                self._count(node, self._present(node))

    async def _fetch_batch_of(self, batch: list[Inode], limiter: trio.CapacityLimiter) -> None:
        if not batch:
            return
        if len(batch) == 1 and batch[0].size > self.remote.small_blob_bytes:
            ok = await self.fetch_blob(batch[0], self.policy.max_bytes)
            self._count(batch[0], ok)
            return
        # now: a read that fails meanwhile drops an inode's content
        wanted = [(node.hash, node.size) for node in batch]
        try:
            arrived = await self.small.fetch(batch, limiter)
        except OSError as e:
            if is_disk_full(e):  # the batch stopped part way: what it wrote is fetched
                for node, (digest, _size) in zip(batch, wanted):
                    if self.blobs.cas.exists(digest):  # type: ignore[arg-type]
                        self._count(node, True)
            raise
        for node, blob, ok in zip(batch, wanted, arrived):
            self._count(node, ok)
            if not ok:  # missing or bad (counted): a read that waited for it answers at once
                self.in_flight.missed.add(blob)  # type: ignore[arg-type]

    def _count(self, node: Inode, ok: bool) -> None:
        if ok:
            self.state["files"] += 1
            self.state["bytes"] += node.size
        else:
            self.state["misses"] += 1


class Todo:
    """What a prefetch fetches, cut into its workers' batches as the names come: each content once,
    within the budget's low watermark (a set's in its order, large blobs at their place; everything's
    smallest first), batches by count and bytes, or, where the store packs blobs, by bytes and at pack
    boundaries (``PACKED_BATCH_MIN_BYTES``); a batch left open waits for the next names."""

    def __init__(self, prefetcher: Prefetcher, queue: Batches, batch_blobs: int, *, in_order: bool) -> None:
        self.remote = prefetcher.remote
        self.state = prefetcher.state
        self.queue = queue
        self.batch_blobs = batch_blobs
        self.in_order = in_order
        self.room = prefetcher.policy.low_bytes - prefetcher.physical()
        self.seen: set[bytes] = set()
        self.batch: list[Inode] = []
        self.size = 0
        self.last: str | None = None
        self.started = False

    def add(self, nodes: list[Inode]) -> None:
        if not self.started:
            self.started = True
            crash_point("prefetch_fetch")  # the tests': a daemon killed while it prefetches
        unique = []
        for node in nodes:
            if node.hash not in self.seen:
                self.seen.add(node.hash)  # type: ignore[arg-type]
                unique.append(node)
        chosen: set[int] = set()
        for node in unique if self.in_order else sorted(unique, key=lambda n: n.size):
            if node.size > self.room:
                self.state["skipped_for_budget"] += 1
                continue
            self.room -= node.size
            chosen.add(id(node))
        todo = [n for n in unique if id(n) in chosen]  # in order: a directory's blobs together (one range)
        self.state["total_files"] += len(todo)
        self.state["total_bytes"] += sum(n.size for n in todo)
        packed = self.remote.packs_by_directory
        for n in todo:
            if n.size > self.remote.small_blob_bytes:
                self.queue.put([n])  # streamed alone, at its place in the order
                continue
            pack = self.remote.placement.container_of(n.hash.hex()) if packed else None  # type: ignore[union-attr]
            # packed: a part's blobs stay one batch (they may pass BATCH_BYTES by the one that begins at its end)
            if self.batch and (self.size + n.size > BATCH_BYTES * (2 if packed else 1) or (
                    self.size >= PACKED_BATCH_MIN_BYTES and pack != self.last if packed
                    else len(self.batch) >= self.batch_blobs)):
                self.finish()
            self.batch.append(n)
            self.size += n.size
            self.last = pack

    def finish(self) -> None:
        """The open batch goes (the names are all known, or it is full)."""
        if self.batch:
            self.queue.put(self.batch)
            self.batch, self.size = [], 0
