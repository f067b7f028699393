"""The shared tier on a ``RemoteStore``: its parts built in one place, each with what it uses.

``RemoteTier`` is the ``Tier`` the mount talks to (``tier``) and the one
place that knows all of its parts; it builds them, hands each exactly its
collaborators (the index, the store, the clock, the events, sibling parts,
a few callables and the small state two parts share), and answers the
mount's calls by handing them to the part whose job they are:

- ``sync.dirs``: read-through; a directory's remote names merged in at a
  lookup or a listing, the newest (version, node) winning
  (``sync.reconcile``), so nodes converge on one version per path;
- ``sync.fetch``: a file's remote content brought in at its first read,
  verified, with its small neighbours (read-ahead); ``sync.in_flight``:
  one fetch per blob, whoever asks; ``sync.small``: small blobs in batches;
- ``sync.outbox`` and ``sync.write_behind``: what this node owes the tier,
  queued in the index (surviving unmounts and crashes) and sent after
  ``UPLOAD_DELAY``, blobs first, each name only where newer than what the
  tier holds; everything is queued again when the tier lost its data (its
  epoch token changes); ``sync.places``: where a bucket held blobs, kept
  from one mount to the next;
- ``sync.changes``: the change feed (deletions told to every node);
  ``sync.forget``: ``forget --fleet``; ``sync.pulse``: whether the mount
  is in use, which sets how often the feed, the epoch and the gc summary
  are asked for;
- ``warm.recorder``, ``warm.order``, ``warm.prefetch``: the startup set
  recorded, put to use (names, look-ahead), and prefetched;
- ``fleet.state``: use records out, the fleet gc's summary in.

No part imports this module nor reaches into another's state.
"""

from __future__ import annotations

import functools
import logging
import re
import secrets
import socket
import sqlite3
from collections.abc import Callable
from typing import Any

import trio

from mithrilfs.cache.integrity import Fetched
from mithrilfs.cache.lifetime import Lifetimes
from mithrilfs.cache.policy import EvictionPolicy
from mithrilfs.cache.recompiles import Recompiles
from mithrilfs.observe.events import EventLog
from mithrilfs.shared.fleet.state import FleetState
from mithrilfs.shared.stores.base import RemoteStore
from mithrilfs.shared.stores.entries import RemoteError
from mithrilfs.shared.stores.feed import FeedWire, NullFeed
from mithrilfs.shared.sync.changes import Changes
from mithrilfs.shared.sync.dirs import DirSync
from mithrilfs.shared.sync.fetch import RemoteFetch
from mithrilfs.shared.sync.forget import PurgeTier, forget_fleet
from mithrilfs.shared.sync.in_flight import InFlight
from mithrilfs.shared.sync.outbox import Outbox
from mithrilfs.shared.sync.places import KeptPlaces
from mithrilfs.shared.sync.pulse import Pulse
from mithrilfs.shared.sync.reconcile import Reconciler
from mithrilfs.shared.sync.small import SmallBlobs
from mithrilfs.shared.sync.tasks import Background, Threads
from mithrilfs.shared.sync.write_behind import WriteBehind, clock_meta
from mithrilfs.shared.tier import Tier
from mithrilfs.shared.warm.order import StartupOrder
from mithrilfs.shared.warm.prefetch import Prefetcher
from mithrilfs.shared.warm.recorder import StartupRecorder
from mithrilfs.store.blobs import Blobs
from mithrilfs.store.namespace import DirPaths, Inode, Namespace
from mithrilfs.store.tier_queue import TierQueue

log = logging.getLogger(__name__)

#: How long the kernel may cache "no such name" when other nodes can create names.
NEGATIVE_TIMEOUT = 2.0


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
    """The shared tier on a ``stores.base.RemoteStore`` (Redis, a bucket, or both); knows the namespace and
    blobs, never the kernel protocol, nor which store it talks to."""

    negative_timeout = NEGATIVE_TIMEOUT
    slow = True

    def __init__(self, ns: Namespace, blobs: Blobs, paths: DirPaths, events: EventLog, lifetimes: Lifetimes,
                 remote: RemoteStore, policy: EvictionPolicy, physical: Callable[[], int], recompiles: Recompiles, *,
                 owner: tuple[int, int] | None = None, requeue: bool = False, startup_set: str = "default",
                 prefetch_at_start: str | None = None, prefetch_background: bool = False,
                 feed: tuple[FeedWire, bytes | None] | None = None) -> None:
        self.ns = ns
        self.paths = paths
        self.remote = remote
        counters = self.counters = remote.counters
        #: The tier's time here: every version and tombstone this node makes is dated by it (``stores.clock``).
        clock = remote.clock
        offset = ns.get_meta(clock_meta(remote))
        if offset is not None and offset.lstrip("-").isdigit():
            clock.restore(int(offset))
        node = node_id(ns)
        self.limiter = limiter = trio.CapacityLimiter(4)
        thread = Threads(limiter)
        #: The nursery of ``run``, once it has one: the parts' background work runs in it.
        self.background = Background()
        #: Writer of content materialized this mount (conflict detection), by inode: the reconciler's, read by
        #: the change feed and the startup set's record.
        origin: dict[int, str] = {}
        #: What this node owes the tier: names to publish, tombstones to send.
        self.outbox = outbox = Outbox(ns, TierQueue(ns), paths, clock)

        async def resync(d: int) -> None:  # the reconciler's and the feed's: a directory's names merged now
            await self.dirs.sync_dir(d, force=True)

        #: Remote names merged in, newest wins.
        self.reconciler = reconciler = Reconciler(
            ns=ns, paths=paths, lifetimes=lifetimes, events=events, counters=counters, clock=clock, node=node,
            owner=owner, origin=origin, pending_tombstones=outbox.pending_tombstones, resend=outbox.queue_upload,
            resync=resync)
        small = SmallBlobs(ns=ns, paths=paths, blobs=blobs, remote=remote, arrived=reconciler.arrived)
        #: The blobs on their way, whoever fetches them (a read, a read-ahead, the look-ahead, the prefetch).
        self.in_flight = in_flight = InFlight(blobs=blobs, remote=remote, counters=counters, limiter=limiter,
                                              policy=policy, physical=physical, small=small)
        #: The change feed: this node's deletions told to the fleet, and the fleet's applied here.
        wire, key = feed or (NullFeed(), None)
        #: Whether the mount is in use: how often the tier is asked for news, and what idleness costs.
        self.pulse = pulse = Pulse(lambda: sum(lv.requests for lv in remote.levels()), watching=wire.blocks)
        self.changes = changes = Changes(ns=ns, lifetimes=lifetimes, remote=remote, counters=counters, node=node,
                                         origin=origin, outbox=outbox, reconciler=reconciler, resync=resync,
                                         thread=thread, wire=wire, key=key, pulse=pulse)
        #: A startup set as this mount uses it (``order_of``).
        self._order = functools.partial(StartupOrder, ns=ns, paths=paths, remote=remote, counters=counters,
                                        thread=thread, purges=changes, merge_paths=reconciler.merge_paths,
                                        bring=in_flight.bring)
        #: The startup set this mount records into: what its workload reads first.
        self.startup_set = startup_set
        #: The same set as this mount uses it: names, prefetch order, look-ahead.
        self.order = self._order(startup_set, look_ahead=True)
        #: Remote content brought in, verified, with its neighbours.
        self.fetcher = fetcher = RemoteFetch(
            ns=ns, paths=paths, blobs=blobs, remote=remote, counters=counters, events=events, limiter=limiter,
            in_flight=in_flight, background=self.background, reached=self.order.reached, arrived=reconciler.arrived)
        #: Read-through: directories synced with the tier.
        self.dirs = DirSync(ns=ns, paths=paths, remote=remote, counters=counters, limiter=limiter,
                            background=self.background, reconciler=reconciler, read_ahead=fetcher.read_ahead,
                            reached=self.order.reached)
        self.recorder = StartupRecorder(startup_set, ns=ns, paths=paths, remote=remote, counters=counters,
                                        node=node, origin=origin, thread=thread)
        #: Use records out, the fleet gc's summary in (``fleet.state``).
        self.fleet = FleetState(remote, events, ns=ns, paths=paths, every=pulse.every)
        #: Where the store held blobs, as the last mount knew: kept at the unmount for the next.
        self.places = KeptPlaces(ns, remote)
        self.behind = WriteBehind(ns=ns, blobs=blobs, paths=paths, lifetimes=lifetimes, remote=remote,
                                  counters=counters, events=events, recompiles=recompiles, node=node, outbox=outbox,
                                  places=self.places, reconciler=reconciler, changes=changes,
                                  recorder=self.recorder, fleet=self.fleet, thread=thread, pulse=pulse)
        self.prefetcher = Prefetcher(ns=ns, paths=paths, blobs=blobs, remote=remote, counters=counters,
                                     policy=policy, physical=physical, in_flight=in_flight, small=small,
                                     fetch_blob=fetcher.fetch_blob, order_of=self.order_of,
                                     merge=reconciler.merge, mark_synced=self.dirs.mark_synced, thread=thread)
        #: What ``forget --fleet`` works with.
        self.purging = PurgeTier(ns=ns, remote=remote, changes=changes, events=events, counters=counters,
                                 node=node, thread=thread)
        self.blob_writer = blobs.writer
        #: The startup set to prefetch as soon as the mount serves (by default, unless ``--no-prefetch``).
        self.prefetch_at_start = prefetch_at_start
        #: Nobody waits for that prefetch (no ``mount --prefetch``): ``status --ready`` does not either.
        self.prefetch_background = prefetch_background
        if prefetch_at_start is not None and not ns.read_only:  # a read-only store runs no background work
            # running from the start: ``mount --prefetch`` waits for it once the mount answers, which
            # may be before the tier's first step (a ping of the store) has begun it
            self.prefetcher.begin(prefetch_at_start, background=prefetch_background)
        if requeue:  # after an unclean stop a commit may not have reached the queue
            outbox.queue_all()

    # -- use (``sync.pulse``) ----------------------------------------------
    def in_use(self) -> bool:
        return self.pulse.in_use()

    async def fresh(self) -> None:
        await self.pulse.fresh()

    # -- read-through (``sync.dirs``, ``sync.fetch``) ------------------------
    async def lookup(self, parent: int, name: bytes) -> int | None:
        return await self.dirs.lookup(parent, name)

    async def list_dir(self, d: int) -> None:
        self.pulse.in_use()
        await self.dirs.list_dir(d)

    def forget_listed(self, dirs: set[int]) -> None:
        """Names left these directories locally only (evicted): the next lookup there asks the tier again,
        and the next read reads ahead again."""
        for d in dirs:
            self.dirs.forget(d)
            self.fetcher.read_ahead_dirs.discard(d)

    @property
    def streaming(self) -> bool:
        return self.prefetcher.running

    async def fetch(self, ino: Inode, max_bytes: int) -> Fetched:
        return await self.fetcher.fetch(ino, max_bytes)

    # -- startup sets ------------------------------------------------------
    def record_read(self, ino: int) -> None:
        """A read at offset 0: its directory is used (``fleet.state``); the first read in this mount within
        its first minutes also joins the startup set (``warm.recorder``)."""
        self.pulse.in_use()
        self.fleet.read(ino)
        self.recorder.read(ino)

    async def unmounting(self) -> None:
        """Write the startup set's record (bounded: an unmount must not wait on a dead tier), end the blob
        writing process the background fetches started (``InFlight.bring_claimed``), and keep the places
        of blobs this mount learned for the next."""
        await self.recorder.unmounting()
        await trio.to_thread.run_sync(self.blob_writer.close)
        try:
            self.places.keep()
        except (sqlite3.Error, OSError) as e:
            log.warning("the places of blobs this mount learned are not kept: %s", e)

    # -- write-behind (``sync.outbox``, ``sync.write_behind``) ---------------
    def publish(self, ino: Inode) -> None:
        if ino.is_dir:
            self.outbox.queue_tree(ino.id)
        else:
            self.outbox.queue_upload(ino.id)

    def tombstone(self, parent: int, name: bytes) -> None:
        self.outbox.removing(parent, name)

    async def forget_fleet(self, paths: list[str]) -> dict[str, Any]:
        return await forget_fleet(self.purging, paths)

    async def push(self) -> dict[str, Any]:
        """Queue everything; the tier is asked first, so a dead store is an error naming the cause at once."""
        try:
            await trio.to_thread.run_sync(self.remote.ping)
        except RemoteError as e:
            return {"error": f"{self.remote.url}: {e}"}
        return {"queued": self.outbox.queue_all()}

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
        await self.background.opened.wait()
        nursery = self.background.nursery
        assert nursery is not None
        try:
            await trio.to_thread.run_sync(self.remote.ping)
        except RemoteError as e:
            error = f"{self.remote.url}: {e}"
            if at_start:  # shown as running since the mount began
                state.update(state="failed", error=error)
            return {"started": False, "error": error}
        background = at_start and self.prefetch_background
        run = state["run"] if at_start else self.prefetcher.begin(set_name, background=background)
        nursery.start_soon(functools.partial(self.prefetcher.run, set_name, background=background))
        return {"started": True, "run": run}

    def order_of(self, set_name: str) -> StartupOrder:
        """The mount's own set as it knows it (loaded once: the prefetch and the look-ahead share it), or a
        fresh one for another set."""
        return self.order if set_name == self.startup_set else self._order(set_name)

    def snapshot(self) -> dict[str, Any]:
        return self.counters | self.fleet.snapshot() | self.pulse.snapshot() | {"upload_queue": self.outbox.pending(),
                                                         "remote_last_error": self.remote.last_error,
                                                         "prefetch": self.prefetcher.state,
                                                         "remote_levels": [lv.state() for lv in self.remote.levels()]}

    async def run(self) -> None:
        """The tier's background work: the uploader, the change feed, and directory syncs nobody waits for."""
        async with trio.open_nursery() as nursery:
            self.background.open(nursery)
            if self.prefetch_at_start is not None:
                nursery.start_soon(functools.partial(self.start_prefetch, self.prefetch_at_start, at_start=True))
            nursery.start_soon(self.behind.uploader)
            nursery.start_soon(self.changes.follow)
