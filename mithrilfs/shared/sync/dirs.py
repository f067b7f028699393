"""The tier's directory syncs: a directory's remote names merged in when it is looked in or listed.

Read-through: a name missing locally is asked for remotely (bounded by the
tier's timeouts, in a worker thread: ``bounded.request``); the whole
directory comes in one request and its names are merged in
(``Reconciler.merge``: a file's content a placeholder, fetched at the first
read), then the names both sides have are reconciled (the newest (version,
node) wins, so nodes converge on one version per path).  ``list_dir`` (at
OPENDIR) merges the directory's remote names in at most every
``DIR_SYNC_SECONDS``; only a directory's first sync in a mount is waited
for.  A file found by a lookup starts the read-ahead of its directory
(*read_ahead*) and tells the startup set's look-ahead (*reached*).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import trio

from mithrilfs.shared.stores.base import RemoteStore
from mithrilfs.shared.stores.entries import MAX_DIR_NAMES, RemoteEntry
from mithrilfs.shared.sync.bounded import request
from mithrilfs.shared.sync.outbox import made_here
from mithrilfs.shared.sync.reconcile import Reconciler
from mithrilfs.shared.sync.tasks import Background
from mithrilfs.store.namespace import DirPaths, Namespace, join_path

log = logging.getLogger("mithrilfs.shared.remote_tier")  # the name operators know from the logs

DIR_SYNC_SECONDS = 5.0
#: A missing name is answered from a directory synced this recently; older, the lookup re-syncs it.
MISS_RESYNC_SECONDS = 1.0
#: Names merged per transaction: between two, the event loop serves other requests.
MERGE_BATCH = 500


class DirSync:
    """The tier's syncs of directories with the tier (see the module doc)."""

    def __init__(self, *, ns: Namespace, paths: DirPaths, remote: RemoteStore, counters: dict[str, int],
                 limiter: trio.CapacityLimiter, background: Background, reconciler: Reconciler,
                 read_ahead: Callable[..., None], reached: Callable[[int, trio.Nursery | None], None]) -> None:
        self.ns = ns
        self.paths = paths
        self.remote = remote
        self.counters = counters
        #: The tier's worker threads, for a listing (``bounded.request``).
        self.limiter = limiter
        #: Where the syncs nobody waits for run.
        self.background = background
        self.reconciler = reconciler
        #: Fetches a file's small neighbours in the background (``RemoteFetch.read_ahead``).
        self.read_ahead = read_ahead
        #: Told the directory a lookup reached (``StartupOrder.reached``: the look-ahead).
        self.reached = reached
        #: When each directory was last synced (monotonic).
        self._dir_synced: dict[int, float] = {}
        #: Directories whose background sync runs.
        self._syncing: set[int] = set()
        #: Waited syncs in progress: a lookup in that directory waits for it rather than miss its names.
        self._sync_done: dict[int, trio.Event] = {}

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
            self.read_ahead(node, itself=True)  # a file the framework is about to open, and its neighbours
            self.reached(parent, self.background.nursery)  # and the next directories its workload reads
        return ino

    def _being_made_here(self, d: int) -> bool:
        """A directory this node made, has not published, and changed in the last ``DIR_SYNC_SECONDS``:
        a missing name in it asks nothing.  Had another node published it, the lookup before the mkdir
        would have found it; a writer's creates there (Triton: a temporary directory per file, a manifest
        GET each) cost nothing.  Two nodes making the same directory at once see each other's names at
        the next listing, or once it is quiet for a few seconds."""
        if not made_here(self.ns, d):
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
        knows never waits on the tier (the names they bring show at the next
        listing).
        """
        now = time.monotonic()
        last = self._dir_synced.get(d)
        if not force and last is not None and now - last < DIR_SYNC_SECONDS:
            return
        self._dir_synced[d] = now
        if not force and last is not None and self.background.nursery is not None:
            if d not in self._syncing:
                self._syncing.add(d)
                self.background.nursery.start_soon(self._sync_in_background, d)
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
        entries = await request(self.remote, self.limiter, self.remote.list_dir, dir_path)
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
            existing += self.reconciler.merge(d, dir_path, dict(items[start:start + MERGE_BATCH]))
        return existing

    def forget(self, d: int) -> None:
        """Names left directory *d* locally only (evicted): the next lookup there asks the tier again."""
        self._dir_synced.pop(d, None)

    def mark_synced(self, d: int) -> None:
        """The directory's remote names were just merged (by a prefetch): no sync needed for a while."""
        self._dir_synced[d] = time.monotonic()
