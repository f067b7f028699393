"""The tier's uploader: what this node owes the tier (``outbox``), sent in batches.

Names wait in the index's queue (``store.tier_queue``) for ``UPLOAD_DELAY``
(a temporary name renamed away is never sent), then go blobs first, names
after, each name by the conditional write that keeps the newest version; a
name that lost to a newer one elsewhere is taken locally.  An epoch token
per server tells when the tier lost its data: then everything is queued
again.  ``remote_tier`` builds it (the tier's ``behind``) with the outbox it
sends from and the parts it tells.
"""

from __future__ import annotations

import dataclasses
import logging
import stat
import time
from typing import Protocol

import trio

from mithrilfs.cache.lifetime import Lifetimes
from mithrilfs.cache.recompiles import Recompiles
from mithrilfs.observe.events import EventLog
from mithrilfs.shared.fleet.state import FleetState
from mithrilfs.shared.stores.ages import UPLOAD_LAG_SECONDS
from mithrilfs.shared.stores.base import RemoteStore
from mithrilfs.shared.stores.entries import RemoteEntry, RemoteError
from mithrilfs.shared.sync.changes import Changes
from mithrilfs.shared.sync.outbox import UPLOAD_DELAY, Outbox, made_here
from mithrilfs.shared.sync.places import KeptPlaces
from mithrilfs.shared.sync.pulse import Pulse
from mithrilfs.shared.sync.reconcile import Reconciler
from mithrilfs.shared.sync.tasks import Threads
from mithrilfs.store.blobs import Blobs
from mithrilfs.store.cas import EMPTY_DIGEST
from mithrilfs.store.namespace import ROOT_INODE, DirPaths, Namespace, join_path

log = logging.getLogger(__name__)

UPLOAD_BATCH = 512
#: A directory still being written holds its due names back at most this long (``_quiet_directories``).
HOLD_BUSY_DIRECTORY = 3.0
#: A store that packs a batch's blobs (a bucket) holds the due names of a writer still writing (something
#: queued in the last ``UPLOAD_DELAY``) this long at most, or until they fill ``PACK_FILL`` bytes: a pack per
#: upload batch would be a pack every ``UPLOAD_DELAY`` of a compile, and a new node reads one range GET per
#: pack.
PACK_WINDOW = 2.0
PACK_FILL = 8 << 20
#: How often the uploader asks whether the tier lost its data (its epoch token) while the mount is in use;
#: and while it is idle (``sync.pulse``).  A failed request of the feed's follower makes it ask at once.
EPOCH_SECONDS = 10.0
EPOCH_IDLE_SECONDS = 600.0
#: The index's meta keys holding the epoch of each tier this store has used (``epoch_meta``).
EPOCH_META_PREFIX = "remote_epoch:"
#: The index's meta key holding a store's clock offset as last measured (``stores.clock``), by store.
CLOCK_META_PREFIX = "remote_clock_offset_us:"


class StartupRecord(Protocol):
    """The startup set's record (``warm.recorder.StartupRecorder``) as the uploader sees it: written when due."""

    def due(self) -> bool: ...

    async def write(self, *, last: bool = False) -> None: ...


def clock_meta(remote: RemoteStore) -> str:
    """The index's meta key of *remote*'s clock offset: restored by the next mount until it measures."""
    return f"{CLOCK_META_PREFIX}{remote.url}:{remote.namespace}"


def epoch_meta(remote: RemoteStore) -> str:
    """The index's meta key of the epoch token this store last saw of *remote*."""
    return f"{EPOCH_META_PREFIX}{remote.url}:{remote.namespace}"


def in_directory_order(blobs: dict[str, tuple[str, int]],
                       items: list[tuple[str, RemoteEntry]]) -> dict[str, tuple[str, int]]:
    """*blobs* with each directory's together, directories and files in the order they were queued: a
    bucket packs them in this order, so a reader fetches a directory's files in one range."""
    rank: dict[str, int] = {}
    first: dict[str, int] = {}
    for path, e in items:
        d = path.rpartition("/")[0]
        rank.setdefault(d, len(rank))
        if e.hash is not None:
            first.setdefault(e.hash, rank[d])
    return dict(sorted(blobs.items(), key=lambda kv: first.get(kv[0], len(rank))))


@dataclasses.dataclass
class Batch:
    """One upload: the queue rows it settles, the entries (with their directories') it publishes, the
    names they are (parent, name: ``names`` pairs with ``items``), their blobs (hex: file, size) and the
    tombstones."""

    tombs: list[tuple[str, int]]
    settled: list[tuple[int, int]] = dataclasses.field(default_factory=list)
    items: list[tuple[str, RemoteEntry]] = dataclasses.field(default_factory=list)
    names: list[tuple[int, bytes]] = dataclasses.field(default_factory=list)
    blobs: dict[str, tuple[str, int]] = dataclasses.field(default_factory=dict)


class WriteBehind:
    """The tier's uploader: sends what waits in *outbox*, watches the tier's epoch and clock, and writes
    the startup set's record and the use records when due."""

    def __init__(self, *, ns: Namespace, blobs: Blobs, paths: DirPaths, lifetimes: Lifetimes, remote: RemoteStore,
                 counters: dict[str, int], events: EventLog, recompiles: Recompiles, node: str, outbox: Outbox,
                 places: KeptPlaces, reconciler: Reconciler, changes: Changes, recorder: StartupRecord,
                 fleet: FleetState, thread: Threads, pulse: Pulse) -> None:
        self.ns = ns
        self.blobs = blobs
        self.paths = paths
        self.lifetimes = lifetimes
        self.remote = remote
        self.clock = remote.clock
        self.counters = counters
        self.events = events
        self.recompiles = recompiles
        self.node = node
        self.outbox = outbox
        self.queue = outbox.queue
        self.places = places
        self.reconciler = reconciler
        self.changes = changes
        self.recorder = recorder
        self.fleet = fleet
        self.thread = thread
        #: Whether the mount is in use (how often the epoch is checked) and whether the tier failed a request.
        self.pulse = pulse
        #: Whether this mount's first epoch check (which measures the tier's clock) was made.
        self._first_checked = False
        #: The tier's epoch token as this store last saw it (None: this store never used this tier).
        self.epoch = ns.get_meta(epoch_meta(remote))

    async def uploader(self) -> None:
        backoff = 0.5
        next_epoch = 0.0
        while True:
            try:
                if time.monotonic() >= next_epoch or self.pulse.suspect:
                    self.pulse.suspect = False
                    await self._check_epoch()
                    next_epoch = time.monotonic() + self.pulse.every(EPOCH_SECONDS, EPOCH_IDLE_SECONDS)
                sent = await self._send_due()
                if self.recorder.due():
                    await self.recorder.write()
                await self.fleet.step(self.thread)
                backoff = 0.5
            except Exception as e:  # a bug or an answer nobody foresaw must not take the mount down either
                if isinstance(e, RemoteError):
                    log.debug("upload deferred: %s", e)
                else:
                    log.exception("shared tier uploader failed; retrying in %.1f s", backoff)
                await trio.sleep(backoff)
                backoff = min(30.0, backoff * 2)
                next_epoch = 0.0  # a server back from a restart may be empty: asked first
                continue
            if not sent:
                await self.outbox.wait(min(UPLOAD_DELAY, max(0.0, next_epoch - time.monotonic())))

    async def _check_epoch(self) -> None:
        """Queue everything again when the tier is not the one we uploaded to (restarted empty, new).

        A store that never used any tier queues only its names that did not come from this one: the
        prefetch or a lookup may have created thousands from the tier before this first check answers,
        and publishing them again would be the whole prefetched set sent back.

        The tier's clock is measured here first (``stores.clock``), and again when due before a batch is
        sent (``_send_due``): nothing is published before this node dates its versions by the tier's time,
        and an idle node asks no time."""
        if not self._first_checked:
            self._first_checked = True
            await self._measure_clock()
        epoch, _ = await self.thread(self.remote.epoch)
        kept = self.places.take()
        if epoch == self.epoch:
            if kept:  # the store the last mount learned them from, not emptied since
                log.info("%d places of blobs kept by the last mount", await self.thread(self.places.learn, kept))
            return
        first_tier = self.epoch is None and not self.ns.has_meta_prefix(EPOCH_META_PREFIX)
        n = self.outbox.queue_all(unpublished_only=first_tier)
        if self.epoch is not None:
            self.counters["remote_data_lost"] += 1
            log.warning("the shared tier %s lost its data (new epoch): %d local files queued for upload again",
                        self.remote.url, n)
            self.events.emit("remote_data_lost", url=self.remote.url, requeued=n)
        else:
            log.info("first use of the shared tier %s by this store: %d local files queued%s", self.remote.url,
                     n, " (its first tier: names taken from it are not)" if first_tier else "")
        with self.ns.txn():
            self.ns.set_meta(epoch_meta(self.remote), epoch)
        self.epoch = epoch

    async def _measure_clock(self) -> None:
        """Measure the tier's clock when due (``stores.clock``), keeping a new offset for the next mount.  A
        tier that does not tell its time leaves the offset as it was (this node's clock, never measured),
        said once an hour: uploads wait for no clock."""
        clock = self.clock
        if not clock.due():
            return
        try:
            moved = await self.thread(clock.measure)
        except RemoteError as e:
            clock.postpone()
            log.warning("the shared tier's clock could not be read (%s): dating by %s", e,
                        "the offset measured before" if clock.known else "this node's clock")
            return
        if moved:
            with self.ns.txn():
                self.ns.set_meta(clock_meta(self.remote), str(clock.offset_us))

    async def _send_due(self) -> int:
        """Send one batch of what waited UPLOAD_DELAY; how many queue rows it settled."""
        now = time.time_ns()
        due = self.queue.due(now - int(UPLOAD_DELAY * 1e9), UPLOAD_BATCH)
        if due and self.remote.packs_by_directory:
            due = [] if self._filling_a_pack(due, now) else self._quiet_directories(due, now)
        tombs = self.queue.tombstones(UPLOAD_BATCH)
        if not due and not tombs:
            return 0
        await self._measure_clock()
        batch = self._batch(due, tombs)
        with self.outbox.on_the_way(batch.names):
            await self._send(batch)
        return len(batch.settled) + len(tombs)

    def _batch(self, due: list[tuple[int, int]], tombs: list[tuple[str, int]]) -> Batch:
        """The entries for *due* (and their directories) and the tombstones *tombs*, read from the index."""
        batch = Batch(tombs=tombs)
        dirs_done: set[int] = set()
        for ino_id, queued_ns in due:
            node = self.ns.get(ino_id)
            batch.settled.append((ino_id, queued_ns))
            if node is None or node.nlink == 0 or not (node.is_reg or stat.S_ISLNK(node.mode)):
                continue  # a directory goes with its names; a fifo, socket or device stays on its node
            if node.hash is None and node.is_reg and self.lifetimes.is_written(ino_id):
                continue  # nothing committed yet: its commit queues it again
            for parent, name in self.ns.names_of(ino_id):
                dir_path = self._add_dirs(parent, batch.items, batch.names, dirs_done)
                if dir_path is None:
                    continue
                path = join_path(dir_path, name)
                if stat.S_ISLNK(node.mode):
                    entry = RemoteEntry("l", self.clock.version_of(node.ctime_ns), self.node, mode=0o777, mtime_ns=node.mtime_ns,
                                        target=(node.target or b"").decode(errors="surrogateescape"))
                else:
                    digest = node.hash or EMPTY_DIGEST
                    entry = RemoteEntry("f", self.clock.version_of(node.ctime_ns), self.node, digest.hex(), node.size,
                                        stat.S_IMODE(node.mode), node.mtime_ns)
                    batch.blobs[digest.hex()] = (str(self.blobs.cas.path(digest)) if node.hash else "", node.size)
                batch.items.append((path, entry))
                batch.names.append((parent, name))
        return batch

    async def _send(self, batch: Batch) -> None:
        """Blobs first, then names and tombstones; then the index says so."""
        tombs = batch.tombs
        tomb_items = [(path, RemoteEntry("x", version, self.node)) for path, version in tombs]
        # directories this node made and never published have nothing to read
        await self.thread(self.remote.placement.will_publish,
                               [path for (path, _), (parent, _) in zip(batch.items, batch.names)
                                if not made_here(self.ns, parent)] + [path for path, _ in tomb_items])
        gone, held = await self._send_blobs(in_directory_order(batch.blobs, batch.items))
        keep = [i for i, (_, e) in enumerate(batch.items) if e.hash not in gone]
        items = [batch.items[i] for i in keep]
        names = [batch.names[i] for i in keep]
        results = await self._publish(items + tomb_items)
        with self.ns.txn():
            self.ns.mark_published(names)
            self.queue.sent(batch.settled)
            self.queue.tombstones_sent(tombs)
        self.outbox.tombstones_sent(tombs)
        self.counters["remote_tombstones"] += len(tombs)
        await self.changes.announce_sent(tombs)  # every mounted node drops them within seconds
        for (path, ours), (written, other), name_key in zip(items, results, names):
            if other is None or ours.type == "d":
                continue
            if not written:
                await self._lost_to(name_key, path, other)
            elif other.type == "f" and ours.type == "f" and other.hash != ours.hash and other.node != self.node:
                self.reconciler.conflict(path, ours, other, kept=self.node)
        await self._blobs_seen_elsewhere(items, results, held)

    def _filling_a_pack(self, due: list[tuple[int, int]], now: int) -> bool:
        """Whether to hold *due* back for a fuller pack: the writer is still writing, the oldest has waited
        less than ``PACK_WINDOW`` and they hold less than a batch or ``PACK_FILL`` bytes.  A writer that
        stops (a test, a compile's end) is sent ``UPLOAD_DELAY`` after its last write, as before."""
        if len(due) >= UPLOAD_BATCH or now - due[0][1] >= PACK_WINDOW * 1e9:
            return False
        if not self.queue.queued_after(now - int(UPLOAD_DELAY * 1e9), 1):
            return False
        size = 0
        for ino, _ in due:
            node = self.ns.get(ino)
            size += node.size if node is not None else 0
            if size >= PACK_FILL:
                return False
        return True

    def _quiet_directories(self, due: list[tuple[int, int]], now: int) -> list[tuple[int, int]]:
        """The due names, less those of directories still being written (a name queued there less than
        ``UPLOAD_DELAY`` ago), for at most ``HOLD_BUSY_DIRECTORY``: a bucket packs a batch's blobs together,
        so a kernel's files sent in one batch are one range GET for a reader, not one per batch they
        straddled."""
        young = self.queue.queued_after(now - int(UPLOAD_DELAY * 1e9), UPLOAD_BATCH)
        busy = {parent for ino in young for parent, _ in self.ns.names_of(ino)}
        if not busy:
            return due
        held_until = now - int(HOLD_BUSY_DIRECTORY * 1e9)
        return [(ino, queued) for ino, queued in due
                if queued <= held_until or not any(p in busy for p, _ in self.ns.names_of(ino))]

    async def _publish(self, items: list[tuple[str, RemoteEntry]]) -> list[tuple[bool, RemoteEntry | None]]:
        """Publish names in the order ``fleet gc`` relies on: a directory's names before its entry in its
        parent (files first, then directories deepest first); results in *items*' order.  Each directory
        published into is recorded as used first (``fleet``: no gc sees the name before its use)."""
        order = sorted(range(len(items)), key=lambda i: (items[i][1].type == "d", -items[i][0].count("/")))
        await self.fleet.before_publish([path for path, e in items if e.type not in "dx"], self.thread)
        published = await self.thread(self.remote.publish_entries, [items[i] for i in order])
        results: list[tuple[bool, RemoteEntry | None]] = [(False, None)] * len(items)
        for i, r in zip(order, published):
            results[i] = r
        return results

    def _add_dirs(self, parent: int, items: list, names: list, done: set[int]) -> str | None:
        """Entries for *parent* and its ancestors (once per batch); the parent's path."""
        chain: list[tuple[int, int, bytes]] = []
        d = parent
        while d != ROOT_INODE and d not in done:
            up = self.ns.names_of(d)
            if not up:
                return None
            chain.append((d, up[0][0], up[0][1]))
            d = up[0][0]
        for d, up_parent, name in reversed(chain):
            done.add(d)
            node = self.ns.get(d)
            up_path = self.paths.of_dir(up_parent)
            if node is None or up_path is None:
                return None
            items.append((join_path(up_path, name), RemoteEntry("d", self.clock.version_of(node.ctime_ns), self.node,
                                                             mode=stat.S_IMODE(node.mode), mtime_ns=node.mtime_ns)))
            names.append((up_parent, name))
        return self.paths.of_dir(parent)

    async def _blobs_seen_elsewhere(self, items: list[tuple[str, RemoteEntry]],
                                    results: list[tuple[bool, RemoteEntry | None]], held: set[str]) -> None:
        """Names new to the tier whose blobs it already held: another node compiled the same bytes
        (``Recompiles.fleet``).  The tier keeps where each blob was first published, where it can."""
        fresh = [(path, e) for (path, e), (written, other) in zip(items, results)
                 if e.type == "f" and e.hash and written and other is None]
        first = {e.hash: f"{self.node}\t{path}" for path, e in fresh if e.hash not in held}
        seen = [(path, e) for path, e in fresh if e.hash in held]
        try:
            if first:
                await self.thread(self.remote.note_blob_names, first)
            others = await self.thread(self.remote.blob_names, [e.hash for _, e in seen]) if seen else {}
        except RemoteError as err:
            log.debug("where blobs were first published: %s", err)
            others = {}
        for path, entry in seen:
            assert entry.hash is not None and entry.size is not None
            node, _, other_path = others.get(entry.hash, "").partition("\t")
            if node == self.node:
                continue  # this node uploaded those bytes itself, under a name it has since changed
            self.recompiles.fleet(path, bytes.fromhex(entry.hash), entry.size, other_path or None)

    async def _send_blobs(self, blobs: dict[str, tuple[str, int]]) -> tuple[set[str], set[str]]:
        """Upload the blobs the tier lacks (blobs first, names after): the hashes whose files were gone, and
        those the tier already held."""
        checked = time.monotonic()
        missing = await self.thread(self.remote.missing_blobs, {h: size for h, (_, size) in blobs.items()})
        gone = await self.thread(self.remote.upload_blobs, [(h, blobs[h][0]) for h in missing])
        if time.monotonic() - checked > UPLOAD_LAG_SECONDS:  # ``fleet gc``'s grace assumes no longer: again
            raise RemoteError(f"blobs took more than {UPLOAD_LAG_SECONDS:.0f} s to upload; checking them again")
        if blobs and await self.thread(self.remote.sweeping):
            # a gc deleting blobs may have listed ours as old and unreferenced: check them again after it
            raise RemoteError("a fleet gc is deleting blobs: names are published after it")
        lacked = set(missing)
        return gone, {h for h in blobs if h not in lacked}

    async def _lost_to(self, name_key: tuple[int, bytes], path: str, winner: RemoteEntry) -> None:
        """Our version of a path lost to a newer one from another node: take it locally too."""
        parent, name = name_key
        ino_id = self.ns.lookup(parent, name)
        if ino_id is not None:
            await self.reconciler.reconcile(parent, name, ino_id, winner, path)
