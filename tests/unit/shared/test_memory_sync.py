"""Names kept in sync through the in-memory store, in a real index: newest-wins merges and tombstones
(``Reconciler``), and deletions told over the change feed (``Changes`` on a ``MemoryFeed``) reaching another
node, which stops serving the name."""

from __future__ import annotations

import stat
import time
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest
import trio

from mithrilfs.cache.lifetime import Lifetimes, NoKernelCaches
from mithrilfs.cache.recency import Recency
from mithrilfs.observe.events import EventLog
from mithrilfs.shared.stores.base import new_counters
from mithrilfs.shared.stores.entries import RemoteEntry
from mithrilfs.shared.stores.memory.feed import MemoryFeed
from mithrilfs.shared.stores.memory.store import MemoryServer, MemoryStore
from mithrilfs.shared.sync.changes import ChangeCodec, Changes
from mithrilfs.shared.sync.outbox import Outbox
from mithrilfs.shared.sync.pulse import Pulse
from mithrilfs.shared.sync.reconcile import Reconciler
from mithrilfs.shared.sync.tasks import Threads
from mithrilfs.store.namespace import DirPaths, join_path
from mithrilfs.store.open import Store, open_store
from mithrilfs.store.tier_queue import TierQueue


def f(version: int, node: str, content: bytes, size: int = 10) -> RemoteEntry:
    from mithrilfs.store.cas import hash_bytes

    return RemoteEntry("f", version, node, hash_bytes(content).hex(), size, 0o644, 1)


DIR = RemoteEntry("d", 50, "node-a", mode=0o755)


class Node:
    """One mounted node's tier state, below the mount: a real index and CAS, its own store on the memory
    server, and the parts built as ``RemoteTier`` builds them (the reconciler, the outbox, the feed)."""

    def __init__(self, store: Store, server: MemoryServer, name: str, tmp: Path) -> None:
        self.node = name
        self.ns = store.ns
        self.paths = DirPaths(store.ns)
        self.remote = MemoryStore(server, counters=new_counters())
        self.counters = self.remote.counters
        self.clock = self.remote.clock
        self.origin: dict[int, str] = {}
        self.lifetimes = Lifetimes(store.ns, store.blobs, Recency(store.ns), lambda ino: False, NoKernelCaches())
        self.events = EventLog(tmp / f"{name}-events.jsonl")
        self.outbox = Outbox(store.ns, TierQueue(store.ns), self.paths, self.clock)
        self.pending_tombstones = self.outbox.pending_tombstones
        self.sent_again: list[int] = []
        self.reconciler = Reconciler(
            ns=self.ns, paths=self.paths, lifetimes=self.lifetimes, events=self.events, counters=self.counters,
            clock=self.clock, node=name, owner=None, origin=self.origin, pending_tombstones=self.pending_tombstones,
            resend=self.sent_again.append, resync=self.resync)

    async def resync(self, d: int) -> None:
        await self.sync_dir(d, force=True)

    def changes(self, wire: MemoryFeed) -> Changes:
        """The change feed of this node on *wire*, built as ``RemoteTier`` builds it."""
        return Changes(ns=self.ns, lifetimes=self.lifetimes, remote=self.remote, counters=self.counters,
                       node=self.node, origin=self.origin, outbox=self.outbox, reconciler=self.reconciler,
                       resync=self.resync, thread=Threads(trio.CapacityLimiter(4)), wire=wire, key=None,
                       pulse=Pulse(lambda: self.remote.level.requests, watching=wire.blocks))

    async def sync_dir(self, d: int, *, force: bool = False) -> None:
        """The tier's directory sync: list it in the store, create what is missing, reconcile the rest."""
        path = self.paths.of_dir(d)
        assert path is not None
        entries = self.remote.list_dir(path)
        for name, ino, entry in self.reconciler.merge(d, path, entries):
            await self.reconciler.reconcile(d, name, ino, entry, join_path(path, name))

    def sync(self, path: str) -> None:
        d = self.paths.dir_at(path)
        assert d is not None, path
        trio.run(self.sync_dir, d)

    def at(self, path: str) -> int | None:
        d, _, name = path.rpartition("/")
        parent = self.paths.dir_at(d)
        return None if parent is None else self.ns.lookup(parent, name.encode())


@pytest.fixture
def nodes(tmp_path: Path) -> Iterator[tuple[MemoryServer, Node, Node]]:
    server = MemoryServer()
    with ExitStack() as stack:
        made = []
        for name in ("node-b", "node-c"):
            store = open_store(tmp_path / name)
            stack.callback(store.close)
            made.append(Node(store, server, name, tmp_path))
        yield server, made[0], made[1]


def test_a_directory_sync_takes_the_newest_version_and_a_newer_tombstone_removes_the_name(nodes) -> None:
    """Writers publish one path in turn; a node syncing its directory materializes the first, adopts a newer
    version from another writer (a conflict: other content, counted and logged as an event), ignores an
    older one the store refused, and drops the name for a newer tombstone."""
    server, b, _ = nodes
    a, c, d = (MemoryStore(server) for _ in range(3))
    a.publish_entries([("k", DIR), ("k/x", f(100, "node-a", b"one"))])
    b.sync("")
    b.sync("k")
    x = b.at("k/x")
    assert x is not None and b.ns.get(x).hash.hex() == f(100, "node-a", b"one").hash and b.origin[x] == "node-a"
    c.publish_entries([("k/x", f(200, "node-c", b"two"))])
    assert d.publish_entries([("k/x", f(150, "node-d", b"old"))])[0][0] is False  # the store keeps the newest
    b.sync("k")
    x = b.at("k/x")
    assert x is not None and b.ns.get(x).hash.hex() == f(200, "node-c", b"two").hash
    assert b.counters["remote_conflicts"] == 1 and b.counters["remote_adopted"] == 1
    assert '"event": "conflict"' in b.events.path.read_text()
    c.publish_entries([("k/x", RemoteEntry("x", 300, "node-c"))])
    b.sync("k")
    assert b.at("k/x") is None and b.counters["remote_adopted"] == 2
    b.sync("k")  # the tombstone again: nothing to do, nothing created
    assert b.at("k/x") is None


def test_a_local_version_newer_than_the_stores_is_sent_again_and_kept(nodes) -> None:
    """The store holds an older version of a name this node wrote since (a replayed or lost write): the
    node keeps its own and asks the uploader to send it again."""
    server, b, _ = nodes
    MemoryStore(server).publish_entries([("k", DIR), ("k/y", f(100, "node-a", b"old"))])
    b.sync("")
    k = b.at("k")
    assert k is not None
    with b.ns.txn():  # this node's own write, now
        mine = b.ns.create_inode(stat.S_IFREG | 0o644, 0, 0)
        b.ns.link(k, b"y", mine.id)
    b.sync("k")
    assert b.at("k/y") == mine.id and b.sent_again == [mine.id]


def test_a_name_deleted_here_and_not_yet_told_is_not_brought_back(nodes) -> None:
    server, b, _ = nodes
    MemoryStore(server).publish_entries([("k", DIR), ("k/gone", f(100, "node-a", b"z")), ("k/kept", f(100, "node-a", b"k"))])
    b.sync("")
    b.pending_tombstones["k/gone"] = 200
    b.sync("k")
    assert b.at("k/gone") is None and b.at("k/kept") is not None


def test_a_deletion_announced_on_the_feed_reaches_another_node_which_stops_serving_the_name(nodes) -> None:
    """Node c tombstones a name and announces it; node b, following the feed from before, drops the name
    from its index without listing the directory; its own record is skipped by its writer."""
    server, b, c = nodes
    MemoryStore(server).publish_entries([("k", DIR), ("k/x", f(100, "node-a", b"one"))])
    for node in (b, c):
        node.sync("")
        node.sync("k")
    follower = b.changes(MemoryFeed(b.remote))
    announcer = c.changes(MemoryFeed(c.remote))

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(follower.follow)
            while b.ns.get_meta(follower._meta()) is None:  # the follower took the feed's head
                await trio.sleep(0.01)
            version = c.clock.now_us()
            await announcer.announce([("k/x", version, False)])
            await announcer._apply_record(MemoryFeed(c.remote).read("0")[0][0])  # its own: skipped
            with trio.fail_after(30):
                while b.at("k/x") is not None:
                    await trio.sleep(0.01)
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert b.counters["remote_changes_applied"] == 1 and c.counters["remote_changes_announced"] == 1
    assert c.at("k/x") is not None  # the announcer's own index is its uploader's business
    assert follower.deleted_since("k/x", f(100, "node-a", b"one"))


def test_a_feed_reader_reads_on_from_its_cursor_and_is_told_when_records_were_trimmed() -> None:
    server = MemoryServer()
    writer, reader = MemoryFeed(MemoryStore(server), maxlen=3), MemoryFeed(MemoryStore(server), maxlen=3)
    codec = ChangeCodec("default", b"k" * 16)
    start = reader.head()
    for i in range(2):
        writer.append(codec.encode("node-a", [(f"d/{i}", 10 + i, False)]))
    got, cursor, gap = reader.read(start)
    assert [codec.decode(r) for r in got] == [("node-a", [(f"d/{i}", 10 + i, False)]) for i in range(2)] and not gap
    assert reader.read(cursor) == ([], cursor, False)
    for i in range(2, 6):
        writer.append(codec.encode("node-a", [(f"d/{i}", 10 + i, False)]))
    got, _, gap = reader.read(cursor)  # two of the four it missed were trimmed
    assert gap and [codec.decode(r)[1][0][0] for r in got] == ["d/3", "d/4", "d/5"]
    writer.append(b"x" * ((64 << 10) + 1))
    assert reader.read(reader.head())[0] == []
    assert reader.read(str(int(reader.head()) - 1))[0] == [None]  # too large: refused unread


def test_a_follower_survives_hostile_records_and_a_dead_feed(nodes) -> None:
    """A record that is no record is refused and counted; a feed that fails is retried; the next good
    record still applies."""
    server, b, _ = nodes
    MemoryStore(server).publish_entries([("k", DIR), ("k/x", f(100, "node-a", b"one"))])
    b.sync("")
    b.sync("k")
    wire = MemoryFeed(b.remote)
    follower = b.changes(wire)
    other = MemoryFeed(MemoryStore(server))

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(follower.follow)
            while b.ns.get_meta(follower._meta()) is None:
                await trio.sleep(0.01)
            other.append(b"{not a record")
            with trio.fail_after(30):
                while b.counters.get("remote_changes_rejected", 0) < 1:
                    await trio.sleep(0.01)
            b.remote.fail_next(1)
            other.append(ChangeCodec("default", None).encode("node-c", [("k/x", int(time.time() * 1e6), False)]))
            with trio.fail_after(30):
                while b.at("k/x") is not None:
                    await trio.sleep(0.01)
            nursery.cancel_scope.cancel()

    trio.run(main)
    assert b.remote.level.errors == 1
