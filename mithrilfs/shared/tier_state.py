"""The shared tier as each of its parts sees it: small protocols, so no part imports ``remote_tier``.

``remote_tier.RemoteTier`` builds its parts (``in_flight``, ``remote_fetch``,
``reconcile``, ``startup_order``, ``startup_recorder``, ``prefetch``,
``changes``, ``write_behind``, ``purge``) and hands each itself.  Were a part
to name ``RemoteTier`` for the type of what it is handed, the two modules
would import each other (for the type checker at least), and a part could
reach for anything of the tier unseen.  Instead each part types its tier by
a protocol here listing exactly what it uses of it (go-fuse's small
capability interfaces), and mypy checks both sides: the part against its
protocol, ``RemoteTier`` against it where it hands itself in.

Two kinds of protocol:

- the *views of a part* another part uses (``Reconciles``, ``ChangeFeed``,
  ``BlobsOnTheWay`` ...), each one sibling's methods its siblings call;
  read-only properties on the tier's protocols, so ``RemoteTier``'s
  concrete part satisfies them;
- the *tier of a part* (``ReconcileTier``, ``UploaderTier`` ...): the
  tier's state and methods that one part uses.  A plain attribute is state
  the part reads (or, for ``write_behind``'s ``_wake`` and ``_epoch``,
  replaces); the underscored ones are the tier's own state, shared with the
  parts that were split out of it.

This module imports none of the parts, so the import graph has no cycle,
not even for the type checker (``tests/test_code_quality.py``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, Protocol

import trio

from mithrilfs.cache.eviction import EvictionPolicy
from mithrilfs.cache.lifetime import Lifetimes
from mithrilfs.cache.recompiles import Recompiles
from mithrilfs.observe.events import EventLog
from mithrilfs.shared.fleet.state import FleetState
from mithrilfs.shared.stores.base import RemoteStore
from mithrilfs.shared.stores.clock import TierClock
from mithrilfs.shared.stores.entries import RemoteEntry
from mithrilfs.store.blobs import Blobs
from mithrilfs.store.namespace import DirPaths, Inode, Namespace
from mithrilfs.store.tier_queue import TierQueue

#: Claimed blobs: content -> (set once it arrived or did not, the size it was claimed at).
Events = dict[bytes, tuple[trio.Event, int]]

#: A change of the feed: (path, version, whole tree).
Change = tuple[str, int, bool]


# ----------------------------------------------------------------------
# The parts as their siblings see them
# ----------------------------------------------------------------------
class BlobsOnTheWay(Protocol):
    """``in_flight.InFlight``: one fetch per blob, whoever asks (the fetch path, the look-ahead, the prefetch)."""

    fetching: Events
    missed: set[tuple[bytes, int]]

    def claim(self, nodes: list[Inode]) -> tuple[list[Inode], Events, list[trio.Event]]: ...

    def register(self, digest: bytes, size: int) -> Events: ...

    def release(self, events: Events) -> None: ...

    def room_for(self, todo: list[Inode], own: int = 0) -> bool: ...

    async def bring(self, nodes: list[Inode], counter: str) -> None: ...

    async def bring_claimed(self, todo: list[Inode], events: Events, counter: str) -> None: ...


class SmallFetches(Protocol):
    """``prefetch.Prefetcher`` as ``in_flight`` sees it: small blobs brought in batches, within its budget."""

    policy: EvictionPolicy
    #: Bytes the store holds now.
    physical: Callable[[], int]

    async def fetch_small(self, batch: list[Inode], limiter: trio.CapacityLimiter) -> list[bool]: ...


class LookAhead(Protocol):
    """``startup_order.StartupOrder`` as the fetch path sees it: told which directory a read reached."""

    def reached(self, dir_ino: int, nursery: trio.Nursery | None) -> None: ...


class LoadableOrder(Protocol):
    """``startup_order.StartupOrder`` as the prefetch sees it: a set's names, in order."""

    unresolved: list[str]

    async def load(self, materialized: Callable[[list[Inode]], None] | None = None) -> None: ...

    def files(self) -> list[Inode]: ...


class StartupRecord(Protocol):
    """``startup_recorder.StartupRecorder`` as the uploader sees it: written when due."""

    def due(self) -> bool: ...

    async def write(self, *, last: bool = False) -> None: ...


class UploadQueue(Protocol):
    """``write_behind.WriteBehind`` as the reconciler sees it: a local version to send again."""

    def queue_upload(self, ino: int) -> None: ...


class Reconciles(Protocol):
    """``reconcile.Reconciler`` as the change feed and the uploader see it."""

    async def reconcile(self, parent: int, name: bytes, ino_id: int, entry: RemoteEntry, path: str) -> None: ...

    def replace(self, parent: int, name: bytes, old: Inode, entry: RemoteEntry | None) -> None: ...

    def conflict(self, path: str, a: RemoteEntry, b: RemoteEntry, *, kept: str) -> None: ...


class ChangeFeed(Protocol):
    """``changes.Changes`` as the uploader, the purge and the startup orders see it."""

    async def announce(self, changes: list[Change]) -> None: ...

    async def announce_sent(self, tombstones: list[tuple[str, int]]) -> None: ...

    async def keep(self, changes: list[Change]) -> None: ...

    def learn_kept(self, records: list[bytes]) -> None: ...

    async def apply(self, path: str, version: int, tree: bool, node: str) -> int: ...

    def deleted_since(self, path: str, entry: RemoteEntry) -> bool: ...


# ----------------------------------------------------------------------
# The tier as each part sees it
# ----------------------------------------------------------------------
class RemoteState(Protocol):
    """What every part but ``reconcile`` uses: the store behind the tier and the mount's remote counters."""

    remote: RemoteStore
    counters: dict[str, int]
    #: The tier's time here (the store's clock): what versions are dated by.
    clock: TierClock


class InFlightTier(RemoteState, Protocol):
    """What ``in_flight`` uses of the tier."""

    blobs: Blobs
    limiter: trio.CapacityLimiter

    @property
    def prefetcher(self) -> SmallFetches: ...


class FetchTier(RemoteState, Protocol):
    """What ``remote_fetch`` uses of the tier."""

    ns: Namespace
    blobs: Blobs
    paths: DirPaths
    events: EventLog
    lifetimes: Lifetimes
    _nursery: trio.Nursery | None

    @property
    def in_flight(self) -> BlobsOnTheWay: ...

    @property
    def order(self) -> LookAhead: ...

    async def _call(self, fn: Callable[..., Any], *args: Any) -> Any: ...


class ReconcileTier(Protocol):
    """What ``reconcile`` uses of the tier (never the remote store: it merges what others listed)."""

    counters: dict[str, int]
    clock: TierClock
    ns: Namespace
    paths: DirPaths
    lifetimes: Lifetimes
    events: EventLog
    node: str
    owner: tuple[int, int] | None
    origin: dict[int, str]
    pending_tombstones: dict[str, int]

    @property
    def behind(self) -> UploadQueue: ...

    async def sync_dir(self, d: int, *, force: bool = False) -> None: ...


class OrderTier(RemoteState, Protocol):
    """What ``startup_order`` uses of the tier."""

    ns: Namespace
    paths: DirPaths

    @property
    def changes(self) -> ChangeFeed: ...

    @property
    def in_flight(self) -> BlobsOnTheWay: ...

    def merge_paths(self, items: list[tuple[str, RemoteEntry]], made_here: set[int]) -> list[str]: ...

    async def thread(self, fn: Callable[..., Any], *args: Any) -> Any: ...


class RecorderTier(RemoteState, Protocol):
    """What ``startup_recorder`` uses of the tier."""

    ns: Namespace
    paths: DirPaths
    node: str
    origin: dict[int, str]

    async def thread(self, fn: Callable[..., Any], *args: Any) -> Any: ...


class PrefetchTier(RemoteState, Protocol):
    """What ``prefetch`` uses of the tier."""

    ns: Namespace
    blobs: Blobs
    paths: DirPaths

    @property
    def in_flight(self) -> BlobsOnTheWay: ...

    def order_of(self, set_name: str) -> LoadableOrder: ...

    def merge(self, d: int, dir_path: str, entries: dict[bytes, RemoteEntry],
              only: set[bytes] | None = None) -> list[tuple[bytes, int, RemoteEntry]]: ...

    def mark_synced(self, d: int) -> None: ...

    async def fetch_blob(self, ino: Inode, max_bytes: int) -> bool: ...

    def arrived(self, blobs: list[tuple[bytes, int]]) -> None: ...

    async def thread(self, fn: Callable[..., Any], *args: Any) -> Any: ...


class ChangesTier(RemoteState, Protocol):
    """What ``changes`` uses of the tier."""

    ns: Namespace
    queue: TierQueue
    lifetimes: Lifetimes
    node: str
    origin: dict[int, str]
    pending_tombstones: dict[str, int]
    _wake: trio.Event

    @property
    def reconciler(self) -> Reconciles: ...

    async def sync_dir(self, d: int, *, force: bool = False) -> None: ...

    async def thread(self, fn: Callable[..., Any], *args: Any) -> Any: ...


class PurgeTier(RemoteState, Protocol):
    """What ``purge`` (``forget --fleet``) uses of the tier."""

    ns: Namespace
    events: EventLog
    node: str

    @property
    def changes(self) -> ChangeFeed: ...

    async def thread(self, fn: Callable[..., Any], *args: Any) -> Any: ...


class UploaderTier(RemoteState, Protocol):
    """What ``write_behind`` uses of the tier: the uploader shares the tier's wake-up event and epoch."""

    ns: Namespace
    queue: TierQueue
    blobs: Blobs
    paths: DirPaths
    events: EventLog
    lifetimes: Lifetimes
    recompiles: Recompiles
    fleet: FleetState
    node: str
    pending_tombstones: dict[str, int]
    _wake: trio.Event
    _epoch: str | None
    #: Places of blobs the last mount kept (JSON), until the first look at the epoch takes or drops them.
    kept_places: str | None

    @property
    def recorder(self) -> StartupRecord: ...

    @property
    def changes(self) -> ChangeFeed: ...

    @property
    def reconciler(self) -> Reconciles: ...

    def _epoch_meta(self) -> str: ...

    def take_kept_places(self, raw: str) -> int: ...

    def made_here(self, d: int) -> bool: ...

    async def thread(self, fn: Callable[..., Any], *args: Any) -> Any: ...
