"""Blobs on their way from the shared tier: one request per blob, whoever asks first.

A read, the read-ahead of its directory's small files, the look-ahead of the
next directories of the startup set and the prefetch can all want the same
blob at once; asked for by each, it would cost the tier (and the bill) as
many requests.  Whoever fetches a blob first registers it here (``claim``,
``register``) until it arrived or did not (``release``); a read of a blob on
its way waits for that fetch and takes its answer (``RemoteFetch.fetch``), a
prefetch worker waits for it instead of asking again.  A blob a background
fetch found missing or bad is remembered (``missed``), so the read that
waited on it answers at once rather than ask the same question again.
While a prefetch runs, a blob in one of its batches not yet taken is not
fetched by a read, a read-ahead or the look-ahead on their own: that batch
is started at once and they wait for it (``hurry``, ``warm.batches``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Protocol

import trio

from mithrilfs.cache.policy import EvictionPolicy
from mithrilfs.shared.stores.base import RemoteStore
from mithrilfs.shared.stores.entries import RemoteError
from mithrilfs.shared.sync.small import SmallBlobs
from mithrilfs.store.blobs import Blobs
from mithrilfs.store.namespace import Inode
from mithrilfs.store.open import disk_room, is_disk_full

log = logging.getLogger(__name__)

class Queued(Protocol):
    """A running prefetch's batches not yet taken (``warm.batches.Batches``)."""

    def hurry(self, digest: bytes) -> bool: ...


#: Claimed blobs: content -> (set once it arrived or did not, the size it was claimed at).
Events = dict[bytes, tuple[trio.Event, int]]


class InFlight:
    """The tier's blobs on their way (see the module doc)."""

    def __init__(self, *, blobs: Blobs, remote: RemoteStore, counters: dict[str, int], limiter: trio.CapacityLimiter,
                 policy: EvictionPolicy, physical: Callable[[], int], small: SmallBlobs) -> None:
        self.blobs = blobs
        self.remote = remote
        self.counters = counters
        #: The tier's worker threads: a batch's fetch takes one.
        self.limiter = limiter
        #: The budget: what is fetched ahead stays within its low watermark.
        self.policy = policy
        #: Bytes the store holds now.
        self.physical = physical
        self.small = small
        self.fetching: Events = {}
        #: (blob, size) a background fetch found missing or bad: the read that waited on one answers at once
        #: (with the size: a name claiming another size for the same content must not miss a good one).
        self.missed: set[tuple[bytes, int]] = set()
        #: The running prefetch's batches not yet taken; None while none runs.
        self.queued: Queued | None = None

    def claim(self, nodes: list[Inode]) -> tuple[list[Inode], Events, list[trio.Event]]:
        """Of *nodes*, those not here and not on their way (registered as on their way now, once per
        content), and the events of those another fetch is bringing."""
        mine: list[Inode] = []
        events: Events = {}
        others: list[trio.Event] = []
        for node in nodes:
            digest = node.hash
            assert digest is not None
            coming = self.fetching.get(digest)
            if coming is not None:
                if digest not in events:
                    others.append(coming[0])
                continue
            if self.blobs.cas.exists(digest):
                continue
            events[digest] = self.fetching[digest] = (trio.Event(), node.size)
            mine.append(node)
        return mine, events, others

    def hurry(self, nodes: list[Inode]) -> list[Inode]:
        """Of *nodes*, those the running prefetch will not bring: the batches of the others, if they were
        still waiting their turn, are started now (they are on their way then)."""
        if self.queued is None:
            return nodes
        return [node for node in nodes if node.hash is None or not self.queued.hurry(node.hash)]

    def register(self, digest: bytes, size: int) -> Events:
        """One blob a read fetches itself, unless something already brings it (then nothing)."""
        if digest in self.fetching:
            return {}
        events: Events = {digest: (trio.Event(), size)}
        self.fetching.update(events)
        return events

    def release(self, events: Events) -> None:
        """Claimed blobs arrived or not: the reads that waited for them go on."""
        for digest, claimed in events.items():
            if self.fetching.get(digest) is claimed:
                del self.fetching[digest]
            claimed[0].set()

    def room_for(self, todo: list[Inode], own: int = 0) -> bool:
        """Room for *todo* within the budget's low watermark, and on the store's disk after *own* bytes (the
        file a read needs comes first: a read-ahead raced a 9 MiB fetch for the last megabytes)."""
        wanted = sum(n.size for n in todo)
        return (wanted <= self.policy.low_bytes - self.physical()
                and wanted + own <= disk_room(self.blobs.cas.objects))

    async def bring(self, nodes: list[Inode], counter: str) -> None:
        """Fetch small blobs ahead of their reads (the look-ahead), within the budget and the disk's room;
        those a running prefetch has queued come with its batches, started now."""
        nodes = self.hurry(nodes)
        if nodes and self.room_for(nodes):
            todo, events, _ = self.claim(nodes)
            await self.bring_claimed(todo, events, counter)

    async def bring_claimed(self, todo: list[Inode], events: Events, counter: str) -> None:
        """Fetch claimed small blobs in one batch (read-ahead, look-ahead), counted in *counter*.  Never
        raises: an optimisation must not take the mount down."""
        try:
            if todo and self.remote.available():
                # their files are created by the store's writing process, not by a thread here that waits for
                # the event loop's lock after each system call (``blob_writer``; it stays until the unmount)
                self.blobs.writer.start()
                wanted = [(node.hash, node.size) for node in todo]  # now: a failed read drops an inode's content
                for blob, ok in zip(wanted, await self.small.fetch(todo, self.limiter)):
                    if not ok:  # missing, or not its size or hash (counted): the read need not ask again
                        self.missed.add(blob)  # type: ignore[arg-type]
                self.counters[counter] = self.counters.get(counter, 0) + len(todo)
        except RemoteError as e:
            log.debug("%s failed: %s", counter, e)
        except Exception as e:
            if is_disk_full(e):  # each read fetches its own file then, making room if it must
                log.info("%s stopped: %s", counter, e)
            else:
                log.exception("%s failed", counter)
        finally:
            self.release(events)
