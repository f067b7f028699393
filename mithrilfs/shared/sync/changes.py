"""The change feed: deletions told to every mounted node within seconds, not at its next listing.

A tombstone in the tier reaches a node only when that node lists the
directory; a process that opens a path directly (Triton, Inductor) would go
on reading a deleted file for as long as the node holds the name.  So every
tombstone a node publishes (a user's unlink, ``forget --fleet``) is also
announced on the feed (``stores.feed``), and every mounted node follows it: on
a change for a path it holds, the name goes from its index with tombstone
semantics (a newer local version stays), and the kernel is told
(``NOTIFY_DELETE``), so the next open by path is a LOOKUP that finds nothing.

A record is JSON ``{"mithrilfs_change": 1, "n": NODE, "x": [[PATH, VERSION,
TREE], ...], "mac": HMAC}``: each path is removed where its local version is
older than VERSION; TREE (1) means everything under it too (``forget
--fleet``), 0 one name (an unlink, whose directory case is the tier's usual
reconciliation).  Everything read from the feed is hostile until checked:
size, shape, node id, versions, and each path's components (no ``..``, no
empty name, no NUL); with ``--remote-key-file`` the HMAC covers namespace,
node and paths.  A bad record is skipped and counted
(``remote_changes_rejected``); it never stops the follower.

The follower's cursor is kept in the index, so a node remounted reads what
it missed; when the feed no longer holds everything after its cursor
(trimmed, or the node was away past the journal's keep), it reconciles every
directory it holds against the tier instead.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from mithrilfs.cache.lifetime import Lifetimes
from mithrilfs.shared.stores.base import RemoteStore
from mithrilfs.shared.stores.entries import MAX_VERSION, NODE_RE, RemoteEntry, RemoteError
from mithrilfs.shared.stores.feed import MAX_RECORD_BYTES, FeedWire
from mithrilfs.shared.stores.records import PURGES_READ
from mithrilfs.shared.sync.outbox import Outbox
from mithrilfs.shared.sync.pulse import IDLE_PERIOD, Pulse
from mithrilfs.shared.sync.reconcile import Reconciler
from mithrilfs.shared.sync.tasks import Threads
from mithrilfs.store.namespace import ROOT_INODE, Namespace, join_path, valid_name

log = logging.getLogger(__name__)

#: A change of the feed: (path, version, whole tree).
Change = tuple[str, int, bool]

#: Paths per announced record (a larger announcement is several records).
RECORD_PATHS = 256
#: Longest path a record may name (bytes).
MAX_PATH_BYTES = 4096
COUNTERS = ("remote_changes_announced", "remote_changes_applied", "remote_changes_rejected",
            "remote_feed_checks", "remote_feed_reads", "remote_feed_resyncs")


def path_parts(path: Any) -> list[bytes] | None:
    """The components of a path relative to the root; None unless every one is a valid name."""
    if not isinstance(path, str) or not path or "\0" in path:
        return None
    try:
        raw = path.encode(errors="surrogateescape")
    except UnicodeError:
        return None
    if len(raw) > MAX_PATH_BYTES:
        return None
    parts = raw.split(b"/")
    return parts if all(valid_name(p) for p in parts) else None


#: Deletions a mount remembers against its startup set's names (a few hundred bytes each): all the purge
#: records the tier keeps and a set's loader reads (``PURGES_READ`` of at most ``RECORD_PATHS``), and more.
PURGED_KEPT = PURGES_READ * RECORD_PATHS + 10_000

class ChangeCodec:
    """Records to and from bytes for one namespace, signed with *key* when there is one."""

    def __init__(self, namespace: str, key: bytes | None, *,
                 horizon: Callable[[], int] = lambda: MAX_VERSION) -> None:
        self.namespace = namespace
        self.key = key
        #: Versions past this are refused: dated ahead of the tier's time (``stores.clock``), as entries are.
        self.horizon = horizon

    def _mac(self, node: str, changes: list[list[Any]]) -> str:
        assert self.key is not None
        msg = json.dumps([self.namespace, "change", node, changes], sort_keys=True).encode(errors="surrogateescape")
        return hmac.new(self.key, msg, hashlib.sha256).hexdigest()

    def encode(self, node: str, changes: list[Change]) -> bytes:
        x = [[p, v, int(tree)] for p, v, tree in changes]
        doc: dict[str, Any] = {"mithrilfs_change": 1, "n": node, "x": x}
        if self.key is not None:
            doc["mac"] = self._mac(node, x)
        return json.dumps(doc, sort_keys=True).encode(errors="surrogateescape")

    def decode(self, raw: bytes | None) -> tuple[str, list[Change]]:
        """(node, changes); ValueError naming what is wrong with the record."""
        if raw is None or len(raw) > MAX_RECORD_BYTES:
            raise ValueError("record too large")
        try:
            doc = json.loads(raw.decode(errors="surrogateescape"))
        except (ValueError, RecursionError):
            raise ValueError("not JSON") from None
        if not isinstance(doc, dict) or doc.get("mithrilfs_change") != 1 or not set(doc) <= {"mithrilfs_change", "n",
                                                                                             "x", "mac"}:
            raise ValueError("not a change record")
        node, x = doc.get("n"), doc.get("x")
        if not isinstance(node, str) or not NODE_RE.fullmatch(node):
            raise ValueError("bad node")
        if not isinstance(x, list) or not 0 < len(x) <= RECORD_PATHS:
            raise ValueError("bad change list")
        out: list[Change] = []
        for item in x:
            if not (isinstance(item, list) and len(item) == 3 and path_parts(item[0]) is not None
                    and type(item[1]) is int and 0 < item[1] < MAX_VERSION and item[2] in (0, 1)
                    and type(item[2]) is int):
                raise ValueError("bad change (a path that cannot be one, or a version out of range)")
            if item[1] > self.horizon():
                raise ValueError("a change dated past the tier's time (its writer's clock runs ahead)")
            out.append((item[0], item[1], bool(item[2])))
        if self.key is not None:
            mac = doc.get("mac")
            if not isinstance(mac, str) or not hmac.compare_digest(mac, self._mac(node, x)):
                raise ValueError("no valid signature")
        return node, out


class Changes:
    """Announce this node's deletions and apply the fleet's (the tier's ``changes``): read from *wire*,
    signed with *key* when there is one."""

    def __init__(self, *, ns: Namespace, lifetimes: Lifetimes, remote: RemoteStore, counters: dict[str, int],
                 node: str, origin: dict[int, str], outbox: Outbox, reconciler: Reconciler,
                 resync: Callable[[int], Awaitable[None]], thread: Threads, wire: FeedWire,
                 key: bytes | None, pulse: Pulse) -> None:
        self.ns = ns
        self.lifetimes = lifetimes
        self.remote = remote
        self.clock = remote.clock
        self.counters = counters
        self.node = node
        #: Writer of content materialized this mount, by inode (``Reconciler.origin``).
        self.origin = origin
        self.outbox = outbox
        self.reconciler = reconciler
        #: Merge a directory's remote names now, waited for (the tier's ``sync_dir``, forced).
        self.resync = resync
        self.thread = thread
        self.wire = wire
        #: How often to check: while in use, while idle; told of each check and of a tier that fails.
        self.pulse = pulse
        self.codec = ChangeCodec(remote.namespace, key, horizon=remote.clock.horizon_us)
        #: Deletions this mount learned of (path -> the deletion), so a startup set recorded before one
        #: never brings its names back (``StartupOrder``); the newest ``PURGED_KEPT`` are kept.
        self.purged: dict[str, RemoteEntry] = {}
        for name in COUNTERS:
            counters.setdefault(name, 0)

    def _meta(self) -> str:
        return f"feed_cursor:{self.remote.url}:{self.remote.namespace}"

    def _count(self, name: str, n: int = 1) -> None:
        self.counters[name] = self.counters.get(name, 0) + n

    # -- announcing ----------------------------------------------------------
    async def announce(self, changes: list[Change]) -> None:
        """Tell the fleet (raises RemoteError when the feed cannot be written: the tombstones are in the tier
        anyway, and other nodes see them at their next listing)."""
        for start in range(0, len(changes), RECORD_PATHS):
            raw = self.codec.encode(self.node, changes[start:start + RECORD_PATHS])
            await self.thread(self.wire.append, raw)
        self._count("remote_changes_announced", len(changes))

    async def keep(self, changes: list[Change]) -> None:
        """Keep a purge's records in the tier beside the startup sets (``RemoteStore.keep_purge``), for the
        nodes that never read this feed (raises RemoteError)."""
        for start in range(0, len(changes), RECORD_PATHS):
            chunk = changes[start:start + RECORD_PATHS]
            raw = self.codec.encode(self.node, chunk)
            await self.thread(self.remote.keep_purge, max(v for _, v, _ in chunk), raw)

    async def announce_sent(self, tombstones: list[tuple[str, int]]) -> None:
        """The uploader published these tombstones (a user's unlinks): announce them, never failing the batch."""
        if not tombstones:
            return
        try:
            await self.announce([(path, version, False) for path, version in tombstones])
        except RemoteError as e:
            log.info("deletions not announced (other nodes see them at their next listing): %s", e)

    # -- following -----------------------------------------------------------
    async def follow(self) -> None:
        """Check the feed for the life of the mount and apply what it says: as often as the ``Pulse`` says
        (often while the mount is in use, rarely while idle, at once when a use ends an idle spell), or
        waiting in the tier for news where the feed can (``FeedWire.blocks``)."""
        cursor = self.ns.get_meta(self._meta())
        backoff = 1.0
        while True:
            try:
                if cursor is None:  # this store never followed this feed: nothing to catch up
                    cursor = await self.thread(self.wire.head)
                    self._save(cursor)
                self._count("remote_feed_checks")
                self.pulse.checking()
                if self.wire.blocks:  # waits in the tier: off the tier's limiter, and given up at the unmount
                    news = await trio.to_thread.run_sync(self.wire.changed, cursor, IDLE_PERIOD,
                                                         abandon_on_cancel=True)
                else:
                    news = await self.thread(self.wire.changed, cursor, 0.0)
                records: list[bytes | None] = []
                if news:
                    records, cursor = await self._read(cursor)
                self.pulse.checked()
                backoff = 1.0
                if records:
                    continue  # more may wait: read on at once
            except RemoteError as e:
                log.debug("change feed: %s", e)
                self.pulse.trouble()
                await trio.sleep(backoff)
                backoff = min(30.0, backoff * 2)
                continue
            except Exception:  # hostile data is refused in decode; anything else must not end the mount
                log.exception("change feed follower failed; retrying")
                await trio.sleep(backoff)
                backoff = min(30.0, backoff * 2)
                continue
            if not self.wire.blocks or news:  # news that held no record: a pause, not a spin
                await self.pulse.sleep(self.pulse.every(self.wire.period, IDLE_PERIOD))

    async def _read(self, cursor: str) -> tuple[list[bytes | None], str]:
        """Read and apply the records after *cursor*; (what was read, the new cursor, saved)."""
        records, new_cursor, gap = await self.thread(self.wire.read, cursor)
        self._count("remote_feed_reads")
        if gap:
            await self.resync_all()
        for raw in records:
            await self._apply_record(raw)
        if new_cursor != cursor:
            self._save(new_cursor)
        return records, new_cursor

    def _save(self, cursor: str) -> None:
        with self.ns.txn():
            self.ns.set_meta(self._meta(), cursor)

    def _decoded(self, raw: bytes | None, what: str) -> tuple[str, list[Change]] | None:
        """(node, changes) of a record, or None for one that is not one (refused, counted, logged)."""
        try:
            return self.codec.decode(raw)
        except ValueError as e:
            self._count("remote_changes_rejected")
            log.warning("%s refused: %s", what, e)
            return None

    async def _apply_record(self, raw: bytes | None) -> None:
        decoded = self._decoded(raw, "change feed record")
        if decoded is None:
            return
        node, changes = decoded
        if node == self.node:
            return  # our own: applied here when it was made
        for path, version, tree in changes:
            await self.apply(path, version, tree, node)

    def learn_kept(self, records: list[bytes]) -> None:
        """The purges the tier keeps (``RemoteStore.kept_purges``), remembered like those read from the feed
        (a new node read none there); a record that is not one is refused and counted, like the feed's."""
        for raw in records:
            decoded = self._decoded(raw, "kept purge record")
            if decoded is None:
                continue
            node, changes = decoded
            for path, version, _tree in changes:
                self._remember(path, RemoteEntry("x", version, node))

    def _remember(self, path: str, tomb: RemoteEntry) -> None:
        """A deletion a startup set's names are checked against (``deleted_since``); the newest win."""
        known = self.purged.pop(path, None)
        self.purged[path] = tomb if known is None or tomb.newer_than(known.version, known.node) else known
        while len(self.purged) > PURGED_KEPT:
            del self.purged[next(iter(self.purged))]

    async def apply(self, path: str, version: int, tree: bool, node: str) -> int:
        """Remove *path* here (and, with *tree*, everything under it) where older than *version*; how many
        names went.  A name this node does not hold is nothing to do: the tier holds its tombstone."""
        parts = path_parts(path)
        if parts is None:
            return 0
        self._remember(path, RemoteEntry("x", version, node))
        ns = self.ns
        parent = ROOT_INODE
        for part in parts[:-1]:
            child = ns.lookup(parent, part)
            if child is None:
                return 0
            parent = child
        ino = ns.lookup(parent, parts[-1])
        if ino is None:
            return 0
        tomb = RemoteEntry("x", version, node)
        if tree:
            gone: list[tuple[str, bool]] = []
            removed = await self._remove_tree(parent, parts[-1], ino, tomb, path, gone)
            if node != self.node:
                await self._tombstone_here_too(gone, tomb)
        else:
            before = ns.lookup(parent, parts[-1])
            await self.reconciler.reconcile(parent, parts[-1], ino, tomb, path)
            removed = int(before is not None and ns.lookup(parent, parts[-1]) is None)
        self._count("remote_changes_applied", removed)
        return removed

    def deleted_since(self, path: str, entry: RemoteEntry) -> bool:
        """Whether a deletion this mount learned of covers *path* and is newer than *entry*."""
        if not self.purged:  # the usual case, asked for each of a startup set's thousands of names
            return False
        parts = path.split("/")
        for i in range(1, len(parts) + 1):
            tomb = self.purged.get("/".join(parts[:i]))
            if tomb is not None and tomb.newer_than(entry.version, entry.node):
                return True
        return False

    async def _remove_tree(self, parent: int, name: bytes, ino_id: int, tomb: RemoteEntry, path: str,
                           gone: list[tuple[str, bool]]) -> int:
        """Tombstone semantics over a whole tree: every name older than *tomb* goes (deepest first), a
        directory once nothing newer is left in it; the kernel is told of each.  *gone* gets their paths,
        and whether each was queued for upload (or being sent)."""
        ino = self.ns.get(ino_id)
        if ino is None or self.lifetimes.is_written(ino_id):
            return 0  # a write in progress wins when it commits
        removed = 0
        if ino.is_dir:
            for child_name, child in self.ns.children(ino_id):
                removed += await self._remove_tree(ino_id, child_name, child, tomb, join_path(path, child_name),
                                                   gone)
            await trio.lowlevel.checkpoint()
            if self.ns.has_children(ino_id):
                return removed  # it holds names newer than the deletion: kept
        elif not tomb.newer_than(self.clock.version_of(ino.ctime_ns), self.origin.get(ino_id, self.node)):
            return removed  # written here after the deletion: ours stands
        queued = self.outbox.holds(ino_id)
        self.reconciler.replace(parent, name, ino, None)
        gone.append((path, queued))
        return removed + 1

    async def _tombstone_here_too(self, gone: list[tuple[str, bool]], tomb: RemoteEntry) -> None:
        """Names a purge took from this node that the purging node may not have seen get its tombstone too.

        The purging node tombstoned every name it could see; a name only
        this node held (written while it could not reach the tier) may reach
        the tier before or after this node reads the purge, and must lose to
        it either way.  So the purge's own tombstone (same version and node:
        every node writing it agrees) is published here for each name that
        was queued or being sent, and for each the tier holds alive at an
        older version (one listing of their directories); names the purge
        already covered cost no write.  When the tier does not answer, the
        tombstones wait in the queue like a user's unlinks.
        """
        if not gone:
            return
        try:
            dirs = sorted({p.rpartition("/")[0] for p, _ in gone})
            listed = await self.thread(self.remote.list_dirs, dirs)
            todo = []
            for path, queued in gone:
                d, _, name = path.rpartition("/")
                held = listed.get(d, {}).get(name.encode(errors="surrogateescape"))
                if queued or (held is not None and not held.is_tombstone
                              and tomb.newer_than(held.version, held.node)):
                    todo.append((path, tomb))
            if todo:
                await self.thread(self.remote.publish_entries, todo)
        except RemoteError:
            self.outbox.owe_tombstones([path for path, _ in gone], tomb.version)

    async def resync_all(self) -> None:
        """The feed dropped records this node never read: reconcile every directory it holds with the tier."""
        self._count("remote_feed_resyncs")
        log.warning("change feed: records were dropped while this node was away; reconciling every directory")
        stack = [ROOT_INODE]
        while stack:
            d = stack.pop()
            await self.resync(d)
            for _name, child in self.ns.children(d):
                node = self.ns.get(child)
                if node is not None and node.is_dir:
                    stack.append(child)


