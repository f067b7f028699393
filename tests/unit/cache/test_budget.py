"""Budget on its own: what pins a unit, carrying out an eviction, keeping to the budget, a full disk.

The collaborators are built as ``daemon.wiring.build`` builds them, on a
real store (CAS + SQLite index in a temporary directory), except that the
eviction listener (the shared tier in a mount) is a small recording
implementation of ``EvictionListener``, so the tests see which directories
it was told about.
"""

from __future__ import annotations

import errno
import os
import stat
import time
from collections.abc import Iterator
from dataclasses import dataclass

import pytest
import trio
from conftest import make_dir as mkdir

from mithrilfs.cache.budget import Budget
from mithrilfs.cache.eviction import Unit
from mithrilfs.cache.lifetime import Lifetimes, NoKernelCaches
from mithrilfs.cache.policy import EvictionPolicy
from mithrilfs.cache.recency import Recency
from mithrilfs.cache.staged import ContentDropped
from mithrilfs.cache.writepath import CommitListener, WritePath
from mithrilfs.observe.events import EventLog
from mithrilfs.observe.stats import ROOT_KEY, Stats
from mithrilfs.observe.tops import TopDirs
from mithrilfs.store.namespace import ROOT_INODE, DirPaths, Inode
from mithrilfs.store.open import Store


class RecordingEvictionListener:
    """``EvictionListener`` (the shared tier in a mount), remembering the directories it was told about."""

    def __init__(self) -> None:
        self.told: list[set[int]] = []

    def forget_listed(self, dirs: set[int]) -> None:
        self.told.append(set(dirs))


@dataclass
class Cache:
    """The pieces of a mount's cache, wired as ``daemon.wiring.build`` wires them."""

    store: Store
    policy: EvictionPolicy
    writes: WritePath
    lifetimes: Lifetimes
    recency: Recency
    stats: Stats
    budget: Budget
    evicted: RecordingEvictionListener


@pytest.fixture
def cache(store: Store) -> Iterator[Cache]:
    """A large budget (files are added without evicting) and no minimum age unless a test sets one."""
    policy = EvictionPolicy(max_bytes=1 << 30, min_age=0)
    stats = Stats()
    listeners: list[CommitListener] = []
    writes = WritePath(store.ns, store.blobs, stats, trio.CapacityLimiter(2), listeners)
    recency = Recency(store.ns)
    lifetimes = Lifetimes(store.ns, store.blobs, recency, writes.staged.__contains__, NoKernelCaches())
    evicted = RecordingEvictionListener()
    budget = Budget(store, policy, writes, lifetimes, recency, stats, EventLog(None),
                    TopDirs(store.ns, DirPaths(store.ns)), evicted=evicted)
    listeners.append(budget)
    try:
        yield Cache(store, policy, writes, lifetimes, recency, stats, budget, evicted)
    finally:
        writes.shutdown()




async def add_file(cache: Cache, parent: int, name: bytes, data: bytes, *, used_ns: int | None = None) -> Inode:
    """A file committed through the write path (which tells the budget); *used_ns*: its place in LRU order."""
    ns = cache.store.ns
    with ns.txn():
        ino = ns.create_inode(stat.S_IFREG | 0o644, os.getuid(), os.getgid())
        ns.link(parent, name, ino.id)
    of = cache.writes.staged_for(ino, ROOT_KEY)
    await cache.writes.write(of, 0, data)
    await cache.writes.commit(of)
    if used_ns is not None:
        cache.recency.touch(ino.id, used_ns)
    return ino


def now_cutoff() -> int:
    """A young cutoff that makes every file made so far old enough to evict."""
    return time.time_ns() + 1


def test_evict_unit_refuses_a_staged_inode(cache: Cache) -> None:
    """A file with uncommitted writes is pinned: nothing of its unit goes."""
    async def t() -> None:
        ino = await add_file(cache, ROOT_INODE, b"f", b"committed")
        of = cache.writes.staged_for(ino, ROOT_KEY)
        await cache.writes.write(of, 0, b"being written")
        assert cache.budget.evict_unit(Unit([ino.id], 0), now_cutoff()) is None
        assert cache.store.ns.lookup(ROOT_INODE, b"f") == ino.id
        assert cache.store.cas.exists(ino.hash)  # type: ignore[arg-type]
        assert cache.evicted.told == []

    trio.run(t)


def test_evict_unit_refuses_an_inode_in_use_and_a_young_one(cache: Cache) -> None:
    """``using`` pins for the length of a request; a file changed after the cutoff is too young."""
    async def t() -> None:
        ino = await add_file(cache, ROOT_INODE, b"f", b"content")
        with cache.budget.using(ino.id):
            with cache.budget.using(ino.id):  # nested uses of the same inode
                pass
            assert cache.budget.evict_unit(Unit([ino.id], 0), now_cutoff()) is None
        assert cache.budget.evict_unit(Unit([ino.id], 0), ino.mtime_ns - 1) is None  # young
        assert cache.store.ns.lookup(ROOT_INODE, b"f") == ino.id
        # neither pin holds any more: it goes
        assert cache.budget.evict_unit(Unit([ino.id], 0), now_cutoff()) == (len(b"content"), 0)
        assert cache.store.ns.lookup(ROOT_INODE, b"f") is None

    trio.run(t)


def test_evict_unit_removes_names_collects_the_blob_and_counts_under_its_top_directory(cache: Cache) -> None:
    """An eviction frees the blob, counts evictions/evicted_bytes for the top-level dir, tells the listener."""
    async def t() -> None:
        store = cache.store
        inductor = mkdir(store, ROOT_INODE, b"inductor")
        sub = mkdir(store, inductor, b"ab")
        data = os.urandom(5000)
        ino = await add_file(cache, sub, b"kernel.py", data)
        digest = ino.hash
        assert digest is not None
        physical = cache.budget.physical()
        assert cache.budget.evict_unit(Unit([ino.id], 0), now_cutoff()) == (5000, 0)
        assert store.ns.lookup(sub, b"kernel.py") is None
        assert store.ns.get(ino.id) is None
        assert not store.cas.exists(digest) and store.ns.blob_info(digest) is None
        assert cache.budget.physical() == physical - 5000
        assert cache.stats.by_dir["inductor"]["evictions"] == 1
        assert cache.stats.by_dir["inductor"]["evicted_bytes"] == 5000
        assert cache.stats.by_dir[ROOT_KEY]["evictions"] == 0
        assert cache.evicted.told == [{sub}]

    trio.run(t)


def test_evict_unit_of_a_file_the_kernel_holds_frees_its_content_at_forget(cache: Cache) -> None:
    """A referenced inode's names go now; its bytes are reported as freed later and stay on disk until FORGET."""
    async def t() -> None:
        ino = await add_file(cache, ROOT_INODE, b"lib.so", b"m" * 3000)
        cache.lifetimes.ref(ino.id)
        assert cache.budget.evict_unit(Unit([ino.id], 0), now_cutoff()) == (0, 3000)
        assert cache.store.ns.lookup(ROOT_INODE, b"lib.so") is None
        assert cache.store.cas.exists(ino.hash)  # type: ignore[arg-type]
        assert cache.stats.by_dir[ROOT_KEY]["evicted_bytes"] == 3000
        cache.lifetimes.unref(ino.id, 1)
        assert cache.lifetimes.delete_if_unused(ino.id) == 3000

    trio.run(t)


def test_enforce_past_max_bytes_evicts_lru_down_to_the_low_watermark(cache: Cache) -> None:
    """Past the budget itself, eviction runs at once, oldest first, and stops at the low watermark."""
    async def t() -> None:
        files = [await add_file(cache, ROOT_INODE, b"f%d" % i, os.urandom(1000), used_ns=1000 + i)
                 for i in range(10)]
        assert cache.budget.physical() == 10_000
        cache.policy.max_bytes = 8000  # low watermark 0.85 * 8000 = 6800
        await cache.budget.enforce()
        assert cache.budget.physical() <= cache.policy.low_bytes
        assert cache.budget.physical() == 6000  # no further than needed
        left = [f.id for f in files if cache.store.ns.get(f.id) is not None]
        assert left == [f.id for f in files[4:]]  # the four least recently used went
        assert cache.budget.evicted_files == 4

    trio.run(t)


def test_enforce_under_the_budget_evicts_nothing(cache: Cache) -> None:
    """Between the watermarks, a commit only wakes the background evictor: nothing goes now."""
    async def t() -> None:
        for i in range(10):
            await add_file(cache, ROOT_INODE, b"f%d" % i, os.urandom(1000))
        cache.policy.max_bytes = 10_200  # over the high watermark (9690), under the budget
        await cache.budget.enforce()
        assert cache.budget.physical() == 10_000
        assert cache.budget.evictor._wake.is_set()  # the background evictor was woken

    trio.run(t)


def test_retry_when_full_makes_room_and_retries_once(cache: Cache) -> None:
    """A disk-full OSError: evict a slice, run the attempt again, take the index's reserve back."""
    async def t() -> None:
        ino = await add_file(cache, ROOT_INODE, b"old", os.urandom(2000))
        calls = []

        async def attempt() -> str:
            calls.append(1)
            if len(calls) == 1:
                raise OSError(errno.ENOSPC, "No space left on device")
            return "done"

        assert await cache.budget.retry_when_full(attempt) == "done"
        assert len(calls) == 2
        assert cache.store.ns.get(ino.id) is None  # the slice of the cache made room
        assert (cache.store.root / "reserve").stat().st_size > 0  # reserve taken back after the retry

        # a second failure in the retry is not retried again
        calls.clear()

        async def always_full() -> None:
            calls.append(1)
            raise OSError(errno.ENOSPC, "No space left on device")

        with pytest.raises(OSError) as e:
            await cache.budget.retry_when_full(always_full)
        assert e.value.errno == errno.ENOSPC and len(calls) == 2

    trio.run(t)


def test_retry_when_full_does_not_retry_content_dropped_or_other_errors(cache: Cache) -> None:
    """ContentDropped (a file already had its slice) and non-disk-full errors pass straight through."""
    async def t() -> None:
        ino = await add_file(cache, ROOT_INODE, b"keep", os.urandom(2000))
        for error in (ContentDropped(ino.id), OSError(errno.EIO, "I/O error")):
            calls: list[OSError] = []

            async def attempt(error: OSError = error, calls: list[OSError] = calls) -> None:
                calls.append(error)
                raise error

            with pytest.raises(type(error)):
                await cache.budget.retry_when_full(attempt)
            assert calls == [error]
        assert cache.store.ns.lookup(ROOT_INODE, b"keep") == ino.id  # no eviction happened

    trio.run(t)


def test_make_room_evicts_at_least_what_was_asked(cache: Cache) -> None:
    """``make_room(at_least)`` frees at least that much even when it is more than a tenth or 1 MiB."""
    async def t() -> None:
        size = 512 << 10
        for i in range(6):
            await add_file(cache, ROOT_INODE, b"f%d" % i, os.urandom(size), used_ns=1000 + i)
        before = cache.budget.physical()
        assert before == 6 * size
        at_least = 2 << 20  # more than both before // 10 and 1 MiB
        await cache.budget.make_room(at_least)
        assert before - cache.budget.physical() >= at_least
        assert cache.budget.physical() == 2 * size  # and no more than needed
        assert [cache.store.ns.lookup(ROOT_INODE, b"f%d" % i) is not None for i in range(6)] == [False] * 4 + [True] * 2

    trio.run(t)



async def add_group(cache: Cache) -> tuple[int, int, list[Inode]]:
    """``triton/HASH/`` holding a ``__grp__`` file and two members: (triton, the group dir, its files)."""
    triton = mkdir(cache.store, ROOT_INODE, b"triton")
    group = mkdir(cache.store, triton, b"HASH")
    members = [await add_file(cache, group, name, os.urandom(400))
               for name in (b"__grp__k.json", b"k.cubin", b"k.json")]
    return triton, group, members


def test_a_triton_group_is_evicted_whole_with_its_directory(cache: Cache) -> None:
    """A group directory goes as one unit, directory included (a half-evicted group is worse than a miss)."""
    async def t() -> None:
        store = cache.store
        triton, group, members = await add_group(cache)
        # pinned if any member is: nothing of the group goes
        with cache.budget.using(members[1].id):
            assert cache.budget.evict_unit(Unit([m.id for m in members], 0, group_dir=group), now_cutoff()) is None
        assert all(store.ns.get(m.id) is not None for m in members)
        unit = Unit([m.id for m in members], 0, group_dir=group)
        assert cache.budget.evict_unit(unit, now_cutoff()) == (1200, 0)
        assert store.ns.lookup(triton, b"HASH") is None and store.ns.get(group) is None
        assert all(store.ns.get(m.id) is None for m in members)
        assert cache.evicted.told == [{triton, group}]

    trio.run(t)


def test_a_triton_group_eviction_is_counted_under_its_top_directory(cache: Cache) -> None:
    """evictions/evicted_bytes of a group go to ``triton`` even when nothing looked its path up before."""
    async def t() -> None:
        _, group, members = await add_group(cache)
        cache.budget.evict_unit(Unit([m.id for m in members], 0, group_dir=group), now_cutoff())
        assert cache.stats.by_dir["triton"]["evictions"] == 1
        assert cache.stats.by_dir["triton"]["evicted_bytes"] == 1200

    trio.run(t)
