"""Glue between the local namespace and the remote tier: read-through, write-behind, convergence.

Read-through: a name missing locally is asked for remotely (bounded by the
tier's timeouts, in a worker thread); if found it appears locally with its
size, mode and the mount root's owner, and a *placeholder* blob row (size
0, no file); the content is streamed, size-checked and verified by blake3 at
the first read.  ``opendir`` merges the directory's remote names in, at most
every few seconds, and reconciles names both sides have: the newest
(version, node) wins, so nodes converge on one version per path.

Write-behind: a commit or rename queues the inode, a user's unlink, rmdir or
rename queues a tombstone for a name that was published; both queues live in
the index (they survive unmounts and crashes).  A background task sends what
has waited ``UPLOAD_DELAY`` (so a tmp file renamed into place is published
under its final name only): blobs Redis lacks first, then the names, each
written only where newer than what Redis holds.  When Redis loses its data
(its epoch token changes) everything local is queued again.

The tier holds the state and the sync of directories; its parts each hold
one concern and are built here: reconciliation (``reconcile``), the fetch
path and read-ahead (``remote_fetch``), blobs on their way (``in_flight``),
the uploader (``write_behind``), the prefetch, startup sets, use records and
the change feed.  Each part sees the tier through a protocol of what it uses
(``tier_state``), so none imports this module back.
"""

from __future__ import annotations

import functools
import json
import logging
import re
import secrets
import socket
import sqlite3
import time
from collections.abc import Callable
from typing import Any

import trio

from mithrilfs.cache.eviction import EvictionPolicy
from mithrilfs.cache.integrity import Fetched
from mithrilfs.cache.lifetime import Lifetimes
from mithrilfs.cache.recompiles import Recompiles
from mithrilfs.observe.events import EventLog
from mithrilfs.shared.fleet.state import FleetState
from mithrilfs.shared.stores.base import RemoteStore
from mithrilfs.shared.stores.entries import MAX_DIR_NAMES, RemoteEntry, RemoteError
from mithrilfs.shared.stores.feed import FeedWire, NullFeed
from mithrilfs.shared.sync.bounded import in_thread
from mithrilfs.shared.sync.changes import Changes
from mithrilfs.shared.sync.fetch import RemoteFetch
from mithrilfs.shared.sync.forget import forget_fleet
from mithrilfs.shared.sync.in_flight import InFlight
from mithrilfs.shared.sync.reconcile import Reconciler
from mithrilfs.shared.sync.write_behind import EPOCH_META_PREFIX, PLACES_META_PREFIX, WriteBehind, clock_meta
from mithrilfs.shared.tier import Tier
from mithrilfs.shared.warm.order import StartupOrder
from mithrilfs.shared.warm.prefetch import Prefetcher
from mithrilfs.shared.warm.recorder import StartupRecorder
from mithrilfs.store.blobs import Blobs
from mithrilfs.store.namespace import ROOT_INODE, DirPaths, Inode, Namespace, join_path
from mithrilfs.store.tier_queue import TierQueue

log = logging.getLogger(__name__)

DIR_SYNC_SECONDS = 5.0
#: A missing name is answered from a directory synced this recently; older, the lookup re-syncs it.
MISS_RESYNC_SECONDS = 1.0
#: How long the kernel may cache "no such name" when other nodes can create names.
NEGATIVE_TIMEOUT = 2.0
#: Names merged per transaction: between two, the event loop serves other requests.
MERGE_BATCH = 500


def node_id(ns: Namespace) -> str:
    """This store's name in the shared tier (kept in the index): tie-breaker and conflict witness."""
    node = ns.get_meta("node_id")
    if node is None:
        host = re.sub(r"[^A-Za-z0-9.-]", "-", socket.gethostname())[:40] or "node"
        node = f"{host}-{secrets.token_hex(4)}"
        with ns.txn():
            ns.set_meta("node_id", node)
    return node


class RemoteTier(Tier):
    """The shared tier on a ``wire.RemoteStore`` (Redis, a bucket, or both); knows the namespace and blobs,
    never the kernel protocol, nor which store it talks to."""

    negative_timeout = NEGATIVE_TIMEOUT
    slow = True

    def __init__(self, ns: Namespace, blobs: Blobs, paths: DirPaths, events: EventLog, lifetimes: Lifetimes,
                 remote: RemoteStore, policy: EvictionPolicy, physical: Callable[[], int], recompiles: Recompiles, *,
                 owner: tuple[int, int] | None = None, requeue: bool = False, startup_set: str = "default",
                 prefetch_at_start: str | None = None, prefetch_background: bool = False,
                 feed: tuple[FeedWire, bytes | None] | None = None) -> None:
        self.ns = ns
        self.queue = TierQueue(ns)
        self.blobs = blobs
        self.paths = paths
        self.events = events
        self.lifetimes = lifetimes
        self.remote = remote
        self.counters = remote.counters
        #: The tier's time here: every version and tombstone this node makes is dated by it (``tier_clock``).
        self.clock = remote.clock
        offset = ns.get_meta(clock_meta(remote))
        if offset is not None and offset.lstrip("-").isdigit():
            self.clock.restore(int(offset))
        #: Told of uploads whose blob the tier already held (another node compiled the same bytes).
        self.recompiles = recompiles
        self.node = node_id(ns)
        #: Owner of materialized entries (``--remote-owner``); None: the mount root's at the time.
        self.owner = owner
        self.limiter = trio.CapacityLimiter(4)
        self._wake = trio.Event()
        self._dir_synced: dict[int, float] = {}
        #: The blobs on their way, whoever fetches them (a read, a read-ahead, the look-ahead, the prefetch).
        self.in_flight = InFlight(self)
        #: Remote content brought in, verified, with its neighbours (``remote_fetch``).
        self.fetcher = RemoteFetch(self)
        #: Remote names merged in, newest wins (``reconcile``).
        self.reconciler = Reconciler(self)
        self._syncing: set[int] = set()
        #: Waited syncs in progress: a lookup in that directory waits for it rather than miss its names.
        self._sync_done: dict[int, trio.Event] = {}
        self._nursery: trio.Nursery | None = None
        #: Set once ``run`` has its nursery: the prefetch command waits for it.
        self._running = trio.Event()
        #: Removed paths whose tombstones are not sent yet: never materialized again meanwhile.
        self.pending_tombstones: dict[str, int] = dict(self.queue.tombstones())
        #: Writer of content materialized this mount (conflict detection), by inode.
        self.origin: dict[int, str] = {}
        self._epoch = ns.get_meta(self._epoch_meta())
        #: Where the store held blobs, as the last mount knew (``known_places``, as JSON): taken once the
        #: uploader's first look at the epoch finds the store the one they were learned from (``write_behind``).
        self.kept_places = ns.get_meta(self._places_meta())
        #: The startup set this mount records into: what its workload reads first.
        self.startup_set = startup_set
        self.recorder = StartupRecorder(self, startup_set)
        #: The same set as this mount uses it: names, prefetch order, look-ahead.
        self.order = StartupOrder(self, startup_set, look_ahead=True)
        #: When each inode's read was last turned into a use record (``fleet``).
        self._use_noted: dict[int, float] = {}
        self.behind = WriteBehind(self)
        #: Use records out, the fleet gc's summary in (``fleet_state``).
        self.fleet = FleetState(remote, events)
        self.prefetcher = Prefetcher(self, policy, physical)
        #: The change feed: this node's deletions told to the fleet, and the fleet's applied here.
        self.changes = Changes(self, *(feed or (NullFeed(), None)))
        #: The startup set to prefetch as soon as the mount serves (by default, unless ``--no-prefetch``).
        self.prefetch_at_start = prefetch_at_start
        #: Nobody waits for that prefetch (no ``mount --prefetch``): ``status --ready`` does not either.
        self.prefetch_background = prefetch_background
        if prefetch_at_start is not None and not ns.read_only:  # a read-only store runs no background work
            # running from the start: ``mount --prefetch`` waits for it once the mount answers, which
            # may be before the tier's first step (a ping of Redis) has begun it
            self.prefetcher.begin(prefetch_at_start, background=prefetch_background)
        if requeue:  # after an unclean stop a commit may not have reached the queue
            self.behind.queue_all()

    def _epoch_meta(self) -> str:
        return f"{EPOCH_META_PREFIX}{self.remote.url}:{self.remote.namespace}"

    def _places_meta(self) -> str:
        return f"{PLACES_META_PREFIX}{self.remote.url}:{self.remote.namespace}"

    def take_kept_places(self, raw: str) -> int:
        """The places the last mount kept (``kept_places``) given to the store; how many it took.  In a
        thread: up to 65,536 of them are parsed and checked one by one."""
        try:
            places = json.loads(raw)
        except ValueError:
            places = None
        if not isinstance(places, list):
            log.warning("the places of blobs kept by the last mount do not read as a list: not used")
            return 0
        return self.remote.placement.learn_places(places)

    def _keep_places(self) -> None:
        """The places this mount knew, for the next one (read back in ``__init__``); the last mount's stay
        as they are when this one never looked at the epoch (a tier down all along): it learned nothing."""
        if self.kept_places is not None:
            return
        places = self.remote.placement.known_places()
        with self.ns.txn():
            self.ns.set_meta(self._places_meta(), json.dumps(places, separators=(",", ":")))

    async def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """A request of the mount: None when the tier is backed off, fails, or stalls past ``REMOTE_WAIT``."""
        if not self.remote.available():
            return None
        try:
            return await in_thread(self.remote, self.limiter, fn, *args)
        except RemoteError:
            return None

    # -- read-through ------------------------------------------------------
    async def lookup(self, parent: int, name: bytes) -> int | None:
        """A name missing locally: its inode once the directory's remote names are merged, or None.

        The whole directory comes in one request (its first lookup waits
        for it); after that a missing name is answered from the index, and
        a missing name re-syncs the directory (waited) only when its last
        sync is ``MISS_RESYNC_SECONDS`` old, so a cold walk costs one round
        trip per directory, not per name, and a name another node just
        published is seen within a second.
        """
        if self._being_made_here(parent):  # no other node's names can be in it: not a request per create
            self.counters["remote_misses"] += 1
            return None
        last = self._dir_synced.get(parent)
        if last is None or time.monotonic() - last >= MISS_RESYNC_SECONDS:
            await self.sync_dir(parent, force=True)
        elif parent in self._sync_done:  # another request's sync of it is merging its names
            await self._sync_done[parent].wait()
        ino = self.ns.lookup(parent, name)
        self.counters["remote_hits" if ino is not None else "remote_misses"] += 1
        node = self.ns.get(ino) if ino is not None else None
        if node is not None and node.is_reg and node.hash is not None:
            self.fetcher.read_ahead(node, itself=True)  # a file the framework is about to open, and its neighbours
            self.order.reached(parent, self._nursery)  # and the next directories its workload reads
        return ino

    def made_here(self, d: int) -> bool:
        """A directory this node made and has not published: the tier has no manifest of it to read,
        unless another node made the same one meanwhile."""
        names = self.ns.names_of(d) if d != ROOT_INODE else []
        return bool(names) and not self.ns.is_published(*names[0])

    def _being_made_here(self, d: int) -> bool:
        """A directory this node made, has not published, and changed in the last ``DIR_SYNC_SECONDS``:
        a missing name in it asks nothing.  Had another node published it, the lookup before the mkdir
        would have found it; a writer's creates there (Triton: a temporary directory per file, a manifest
        GET each) cost nothing.  Two nodes making the same directory at once see each other's names at
        the next listing, or once it is quiet for a few seconds."""
        if not self.made_here(d):
            return False
        node = self.ns.get(d)
        return node is not None and time.time_ns() - node.ctime_ns < DIR_SYNC_SECONDS * 1e9

    async def list_dir(self, d: int) -> None:
        await self.sync_dir(d)
        if d in self._sync_done:  # another request's sync of it is merging its names: list them all
            await self._sync_done[d].wait()

    async def sync_dir(self, d: int, *, force: bool = False) -> None:
        """Merge a directory's remote names into the local namespace (rate-limited unless *force*).

        Only a directory's first sync in this mount is waited for; later
        ones run in the background, so listing a directory the node already
        knows never waits on Redis (the names they bring show at the next
        listing).
        """
        now = time.monotonic()
        last = self._dir_synced.get(d)
        if not force and last is not None and now - last < DIR_SYNC_SECONDS:
            return
        self._dir_synced[d] = now
        if not force and last is not None and self._nursery is not None:
            if d not in self._syncing:
                self._syncing.add(d)
                self._nursery.start_soon(self._sync_in_background, d)
            return
        done = self._sync_done.setdefault(d, trio.Event())
        try:
            if not await self._sync(d) and last is None:
                # the tier did not answer: this directory was never synced, and its next listing asks again
                self._dir_synced.pop(d, None)
        finally:
            if self._sync_done.get(d) is done:
                del self._sync_done[d]
            done.set()

    async def _sync_in_background(self, d: int) -> None:
        try:
            await self._sync(d)
        except Exception:  # a background refresh must not take the mount down
            log.exception("background sync of directory %d failed", d)
        finally:
            self._syncing.discard(d)

    async def _sync(self, d: int) -> bool:
        """False when the tier did not answer."""
        dir_path = self.paths.of_dir(d)
        if dir_path is None:
            return True
        entries = await self._call(self.remote.list_dir, dir_path)
        if entries is None:
            return False
        if len(entries) > MAX_DIR_NAMES:  # a store that does not bound it itself (Redis)
            self.counters["remote_rejected"] += 1
            log.warning("remote names of %r ignored: %d names, more than %d", dir_path, len(entries), MAX_DIR_NAMES)
            return True
        existing = await self._merge_in_batches(d, dir_path, entries)
        for i, (name, local, entry) in enumerate(existing):
            if self.ns.get(d) is None:
                break
            await self.reconciler.reconcile(d, name, local, entry, join_path(dir_path, name))
            if i % MERGE_BATCH == MERGE_BATCH - 1:
                await trio.lowlevel.checkpoint()
        return True

    async def _merge_in_batches(self, d: int, dir_path: str,
                                entries: dict[bytes, RemoteEntry]) -> list[tuple[bytes, int, RemoteEntry]]:
        """``merge`` a large listing ``MERGE_BATCH`` names per transaction, letting the event loop serve
        other requests in between: one directory's thousands of names never hold the whole mount (a
        20,000-name directory held it 1.9 s in one transaction).  Lookups in *d* wait for the whole
        merge (``_sync_done``)."""
        items = list(entries.items())
        existing: list[tuple[bytes, int, RemoteEntry]] = []
        for start in range(0, len(items), MERGE_BATCH):
            if start:
                await trio.lowlevel.checkpoint()
            existing += self.merge(d, dir_path, dict(items[start:start + MERGE_BATCH]))
        return existing

    def merge(self, d: int, dir_path: str, entries: dict[bytes, RemoteEntry],
              only: set[bytes] | None = None) -> list[tuple[bytes, int, RemoteEntry]]:
        """Materialize a directory's remote names it lacks (``reconcile``); (name, local inode, entry) for
        those it has, to reconcile."""
        return self.reconciler.merge(d, dir_path, entries, only)

    @property
    def streaming(self) -> bool:
        return self.prefetcher.running

    def merge_paths(self, items: list[tuple[str, RemoteEntry]], made_here: set[int]) -> list[str]:
        """Materialize a startup set's names it lacks in one batch (``reconcile``); the paths whose
        directory this node lacks."""
        return self.reconciler.merge_paths(items, made_here)

    # -- fetches (``remote_fetch``) -------------------------------------------
    async def fetch(self, ino: Inode, max_bytes: int) -> Fetched:
        return await self.fetcher.fetch(ino, max_bytes)

    async def fetch_blob(self, ino: Inode, max_bytes: int) -> bool:
        return await self.fetcher.fetch_blob(ino, max_bytes)

    def arrived(self, blobs: list[tuple[bytes, int]]) -> None:
        self.fetcher.arrived(blobs)


    def forget_listed(self, dirs: set[int]) -> None:
        """Names left these directories locally only (evicted): the next lookup there asks the tier again,
        and the next read reads ahead again."""
        for d in dirs:
            self._dir_synced.pop(d, None)
            self.fetcher.read_ahead_dirs.discard(d)

    def mark_synced(self, d: int) -> None:
        """The directory's remote names were just merged (by a prefetch): no sync needed for a while."""
        self._dir_synced[d] = time.monotonic()

    # -- startup sets ------------------------------------------------------
    def record_read(self, ino: int) -> None:
        """A read at offset 0: its directory is used (``fleet``, at most one record an hour); the first
        read in this mount within its first minutes also joins the startup set."""
        now = time.monotonic()
        noted = self._use_noted.get(ino)
        if noted is None or now - noted >= self.fleet.usage.every:  # one dict lookup for most reads
            if len(self._use_noted) > 100_000:
                self._use_noted.clear()
            self._use_noted[ino] = now
            self._record_use(ino)
        self.recorder.read(ino)

    def _record_use(self, ino: int) -> None:
        for parent, _name in self.ns.names_of(ino)[:1]:
            dir_path = self.paths.of_dir(parent)
            if dir_path is not None:
                self.fleet.usage.used(dir_path)

    async def unmounting(self) -> None:
        """Write the startup set's record (bounded: an unmount must not wait on a dead tier), and end the
        blob writing process the background fetches started (``InFlight.bring_claimed``)."""
        await self.recorder.unmounting()
        await trio.to_thread.run_sync(self.blobs.writer.close)
        try:
            self._keep_places()
        except (sqlite3.Error, OSError) as e:
            log.warning("the places of blobs this mount learned are not kept: %s", e)

    # -- write-behind ------------------------------------------------------
    def publish(self, ino: Inode) -> None:
        if ino.is_dir:
            self.behind.queue_tree(ino.id)
        else:
            self.behind.queue_upload(ino.id)

    def tombstone(self, parent: int, name: bytes) -> None:
        self.behind.removing(parent, name)

    async def forget_fleet(self, paths: list[str]) -> dict[str, Any]:
        return await forget_fleet(self, paths)

    async def push(self) -> dict[str, Any]:
        """Queue everything; the tier is asked first, so a dead Redis is an error naming the cause at once."""
        try:
            await trio.to_thread.run_sync(self.remote.ping)
        except RemoteError as e:
            return {"error": f"{self.remote.url}: {e}"}
        return {"queued": self.behind.queue_all()}

    async def start_prefetch(self, set_name: str | None, *, at_start: bool = False) -> dict[str, Any]:
        """Start a prefetch in the background; an error names the tier's problem at once.

        Answers the prefetch's number (``run`` in its state).  A request for the prefetch that runs (the
        same set, or everything) joins it (``joined``): its caller follows that one as its own.  One for
        another is refused with ``busy`` (the set that runs, ``*`` for everything): its caller asks again
        once that one ends.  *at_start*: the one the mount asked for, already shown as running.
        """
        state = self.prefetcher.state
        if self.prefetcher.running and not at_start:
            if state["set"] == (set_name or "*"):
                return {"started": True, "joined": True, "run": state["run"]}
            what = "everything" if state["set"] == "*" else f"set {state['set']}"
            return {"started": False, "busy": state["set"], "error": f"a prefetch of {what} is already running"}
        if self.ns.read_only:  # a read-only store runs no background work (``Duties.background``)
            return {"started": False, "error": "the store is read-only"}
        # a command may come before the tier's work has begun: the first request a successor serves
        # after a takeover can be a ``prefetch`` the killed daemon had read and not answered
        await self._running.wait()
        assert self._nursery is not None
        try:
            await trio.to_thread.run_sync(self.remote.ping)
        except RemoteError as e:
            error = f"{self.remote.url}: {e}"
            if at_start:  # shown as running since the mount began
                state.update(state="failed", error=error)
            return {"started": False, "error": error}
        background = at_start and self.prefetch_background
        run = state["run"] if at_start else self.prefetcher.begin(set_name, background=background)
        self._nursery.start_soon(functools.partial(self.prefetcher.run, set_name, background=background))
        return {"started": True, "run": run}

    def order_of(self, set_name: str) -> StartupOrder:
        """The mount's own set as it knows it (loaded once: the prefetch and the look-ahead share it), or a
        fresh one for another set."""
        return self.order if set_name == self.startup_set else StartupOrder(self, set_name)

    def snapshot(self) -> dict[str, Any]:
        return self.counters | self.fleet.snapshot() | {"upload_queue": self.behind.pending(), "remote_last_error": self.remote.last_error,
                                "prefetch": self.prefetcher.state,
                                "remote_levels": [lv.state() for lv in self.remote.levels()]}

    async def run(self) -> None:
        """The tier's background work: the uploader, the change feed, and directory syncs nobody waits for."""
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            self._running.set()
            if self.prefetch_at_start is not None:
                nursery.start_soon(functools.partial(self.start_prefetch, self.prefetch_at_start, at_start=True))
            nursery.start_soon(self.behind.uploader)
            nursery.start_soon(self.changes.follow)

    async def thread(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await trio.to_thread.run_sync(fn, *args, limiter=self.limiter)

