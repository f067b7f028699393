"""A startup set's names merged into a real index in batches (``Reconciler.merge_paths``): what a node
holds is never replaced, a batch's own directories hold their files, and what cannot be placed is said."""

from __future__ import annotations

import stat
import time
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from mithrilfs.shared.stores.clock import TierClock
from mithrilfs.shared.stores.entries import RemoteEntry
from mithrilfs.shared.sync.reconcile import Reconciler
from mithrilfs.store.namespace import ROOT_INODE, DirPaths, Namespace


@dataclass
class TierState:
    """What ``Reconciler.merge_paths`` reads and writes of the tier: the index and a few tables."""

    ns: Namespace
    paths: DirPaths
    counters: Counter = field(default_factory=Counter)
    origin: dict[int, str] = field(default_factory=dict)
    pending_tombstones: dict[str, int] = field(default_factory=dict)
    owner: tuple[int, int] | None = (7, 8)
    clock: TierClock = field(default_factory=lambda: TierClock(time.time))


@pytest.fixture
def tier(tmp_path: Path):
    ns = Namespace(str(tmp_path / "index.sqlite3"))
    yield TierState(ns, DirPaths(ns))
    ns.close()


def _f(n: int, size: int = 10) -> RemoteEntry:
    return RemoteEntry("f", 100 + n, "node-b", bytes([n]).hex() * 32, size, 0o644, 5_000 + n)


def _merge(tier: TierState, items: list[tuple[str, RemoteEntry]], step: int) -> list[str]:
    """The items in steps of *step* in one transaction, as ``StartupOrder`` does."""
    reconciler = Reconciler(ns=tier.ns, paths=tier.paths, lifetimes=None, events=None,  # type: ignore[arg-type]
                            counters=tier.counters, clock=tier.clock, node="node-a", owner=tier.owner,
                            origin=tier.origin, pending_tombstones=tier.pending_tombstones,
                            resend=None, resync=None)  # type: ignore[arg-type]
    made_here: set[int] = set()
    unresolved: list[str] = []
    with tier.ns.txn():
        for i in range(0, len(items), step):
            unresolved += reconciler.merge_paths(items[i:i + step], made_here)
    return unresolved


def _path_ino(tier: TierState, path: str) -> int | None:
    """The inode at *path* (``DirPaths.dir_at`` for its directory, then a lookup)."""
    d, _, name = path.rpartition("/")
    parent = tier.paths.dir_at(d)
    return None if parent is None else tier.ns.lookup(parent, name.encode())


@pytest.mark.parametrize("step", [1, 3, 64])
def test_a_set_is_merged_in_batches_around_what_the_node_holds(tier: TierState, step: int):
    ns = tier.ns
    with ns.txn():  # this node's own: a kernel directory with one file, and a file where the set has a directory
        own = ns.create_inode(stat.S_IFDIR | 0o755, 0, 0, nlink=2)
        ns.add_link(ns.get(ROOT_INODE), +1)
        ns.link(ROOT_INODE, b"k1", own.id)
        mine = ns.create_inode(stat.S_IFREG | 0o600, 0, 0)
        ns.link(own.id, b"a", mine.id)
        clash = ns.create_inode(stat.S_IFREG | 0o600, 0, 0)
        ns.link(ROOT_INODE, b"x", clash.id)
        held = ns.create_inode(stat.S_IFREG | 0o600, 0, 0)
        ns.link(ROOT_INODE, b"held", held.id)
        ns.blob_intents([(bytes([9]) * 32, 99)])  # content this node holds: 99 bytes
    tier.pending_tombstones["k2/gone"] = 1  # deleted here, not yet told
    d = RemoteEntry("d", 50, "node-b", mode=0o750, mtime_ns=4_000)
    items = [("k1", d), ("k1/a", _f(1)), ("k1/b", _f(2)),
             ("k2", d), ("k2/sub", d), ("k2/sub/c", _f(3)), ("k2/gone", _f(4)), ("k2/dead", RemoteEntry("x", 60, "n")),
             ("k2/link", RemoteEntry("l", 70, "node-b", target="sub/c")), ("k2/liar", _f(9, size=5)),
             ("x", d), ("x/y", _f(5)), ("nowhere/z", _f(6)), ("k2/d", _f(7))]
    unresolved = _merge(tier, items, step)

    assert sorted(unresolved) == ["nowhere/z", "x/y"]  # no directory here for them
    assert ns.lookup(own.id, b"a") == mine.id and ns.get(mine.id).mode & 0o777 == 0o600  # never replaced
    assert ns.lookup(ROOT_INODE, b"x") == clash.id
    k2 = _path_ino(tier, "k2")
    sub = _path_ino(tier, "k2/sub")
    assert k2 is not None and sub is not None
    assert sorted(n for n, _ in ns.children(k2)) == [b"d", b"link", b"sub"]  # not the tombstones, nor the liar
    assert [n for n, _ in ns.children(sub)] == [b"c"] and sorted(n for n, _ in ns.children(own.id)) == [b"a", b"b"]
    k2_node, sub_node, c = ns.get(k2), ns.get(sub), ns.get(_path_ino(tier, "k2/sub/c"))
    assert (k2_node.mode, k2_node.nlink, k2_node.uid, k2_node.mtime_ns) == (stat.S_IFDIR | 0o750, 3, 7, 4_000)
    assert (sub_node.nlink, sub_node.ctime_ns) == (2, 50_000) and ns.get(ROOT_INODE).nlink == 4  # k1, k2 (x: a file)
    assert (c.hash, c.size, c.mtime_ns, c.ctime_ns) == (bytes([3]) * 32, 10, 5_003, 103_000)
    link = ns.get(_path_ino(tier, "k2/link"))
    assert stat.S_ISLNK(link.mode) and link.target == b"sub/c" and link.size == 5
    assert tier.counters["remote_rejected"] == 1  # the liar: its content is here with another size
    assert tier.origin[c.id] == "node-b"
    assert ns.refcount(bytes([3]) * 32) == 1
    ns.forget_cached()  # what was written, not only what is cached
    assert ns.get(k2).nlink == 3 and ns.lookup(sub, b"c") == c.id
