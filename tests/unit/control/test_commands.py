"""The control commands through a real ControlFiles, registered as a mount registers them (``daemon.wiring``).

Each test writes a command file the way the CLI does (run it, then read
its answer back) on a mount built by ``wiring.build`` over a real store
(CAS + SQLite index in a temporary directory), with no kernel to notify.
Files are made through the write path with no kernel reference held, so
an eviction frees their bytes at once.
"""

from __future__ import annotations

import errno
import json
import os
import stat
from collections.abc import Iterator
from typing import Any

import pytest
import trio
from conftest import make_dir as mkdir

from mithrilfs import settings
from mithrilfs.cache.lifetime import NoKernelCaches
from mithrilfs.cache.policy import EvictionPolicy
from mithrilfs.control.files import ControlFiles
from mithrilfs.daemon.wiring import Mounted, build
from mithrilfs.kernel import FUSEError
from mithrilfs.observe.stats import COUNTERS, KeptCounters
from mithrilfs.store.namespace import ROOT_INODE, Inode
from mithrilfs.store.open import Store


def mount(store: Store, policy: EvictionPolicy | None = None, fixed: frozenset[str] = frozenset()) -> Mounted:
    """What a mount serves, built by the one wiring function."""
    return build(store, policy or EvictionPolicy(max_bytes=1 << 30, min_age=0), NoKernelCaches(),
                 fixed_settings=fixed)


@pytest.fixture
def mounted(store: Store) -> Iterator[Mounted]:
    m = mount(store)
    try:
        yield m
    finally:
        m.ops.writes.shutdown()


def control(m: Mounted) -> ControlFiles:
    """The mount's ControlFiles (the filesystem holds it directly, or inside its control-directory node)."""
    c = m.ops.control
    files = c if isinstance(c, ControlFiles) else getattr(c, "files", None)
    assert isinstance(files, ControlFiles)
    return files


async def command(m: Mounted, name: bytes, request: bytes = b"") -> dict[str, Any]:
    """Write *request* to the command file *name* and read its JSON answer back, as the CLI does."""
    files = control(m)
    ino = files.lookup(name)
    assert ino is not None and files.is_command(ino), name
    await files.run_command(ino, request)
    return json.loads(await files.read(ino, 0, 1 << 20))


async def read_json(m: Mounted, name: bytes) -> dict[str, Any]:
    """A JSON control file as a reader sees it: produced at GETATTR, then read."""
    files = control(m)
    ino = files.lookup(name)
    assert ino is not None
    size, _ = await files.refresh(ino)
    return json.loads(await files.read(ino, 0, size))




async def add_file(m: Mounted, parent: int, name: bytes, data: bytes, *, used_ns: int | None = None) -> Inode:
    """A file committed through the mount's write path; *used_ns*: its place in LRU order."""
    ns = m.ops.ns
    with ns.txn():
        ino = ns.create_inode(stat.S_IFREG | 0o644, os.getuid(), os.getgid())
        ns.link(parent, name, ino.id)
    of = m.ops.writes.staged_for(ino, m.ops.tops.of_file(ino.id))
    await m.ops.writes.write(of, 0, data)
    await m.ops.writes.commit(of)
    if used_ns is not None:
        m.ops.recency.touch(ino.id, used_ns)
    return ino


def test_gc_to_a_size_evicts_down_to_it(mounted: Mounted) -> None:
    """``gc to=N`` evicts least recently used files until the store holds at most N; the answer says so."""
    async def t() -> None:
        files = [await add_file(mounted, ROOT_INODE, b"f%d" % i, os.urandom(1000), used_ns=100 + i)
                 for i in range(8)]
        answer = await command(mounted, b"gc", b"to=3000")
        assert answer["physical_bytes"] == mounted.ops.budget.physical() == 3000
        assert answer["units"] == 5 and answer["bytes"] == 5000 and answer["reason"] == "gc"
        assert answer["max_bytes"] == 1 << 30
        assert [mounted.ops.ns.lookup(ROOT_INODE, b"f%d" % i) is not None for i in range(8)] == \
            [False] * 5 + [True] * 3
        assert files[-1].hash is not None and mounted.ops.store.cas.exists(files[-1].hash)

    trio.run(t)


def test_gc_refuses_a_size_it_cannot_read(mounted: Mounted) -> None:
    async def t() -> None:
        await add_file(mounted, ROOT_INODE, b"f", b"x" * 100)
        with pytest.raises(FUSEError) as e:
            await command(mounted, b"gc", b"to=lots")
        assert e.value.errno == errno.EINVAL
        assert mounted.ops.ns.lookup(ROOT_INODE, b"f") is not None

    trio.run(t)


def test_clear_evicts_everything_not_being_written(store: Store) -> None:
    """``clear`` takes every file however young (min_age does not hold), but not one being written."""
    m = mount(store, EvictionPolicy(max_bytes=1 << 30, min_age=3600))

    async def t() -> None:
        d = mkdir(store, ROOT_INODE, b"triton")
        for i in range(4):
            await add_file(m, d, b"k%d" % i, os.urandom(700))
        busy = await add_file(m, ROOT_INODE, b"busy", b"committed part")
        of = m.ops.writes.staged_for(busy, "/")
        await m.ops.writes.write(of, 0, b"being written now")
        answer = await command(m, b"clear")
        assert answer["units"] == 4 and answer["reason"] == "clear"
        assert all(store.ns.lookup(d, b"k%d" % i) is None for i in range(4))
        assert store.ns.lookup(ROOT_INODE, b"busy") == busy.id
        # what is left: the busy file's committed blob and its staging
        assert answer["physical_bytes"] == len(b"committed part") + len(b"being written now")
        assert m.ops.stats.by_dir["triton"]["evictions"] == 4

    try:
        trio.run(t)
    finally:
        m.ops.writes.shutdown()


def test_zero_zeroes_the_kept_counters_and_persists_them(store: Store, mounted: Mounted) -> None:
    """``zero``: this mount's and earlier mounts' counters start over, and the next mount sees zeros too."""
    async def t() -> None:
        await add_file(mounted, ROOT_INODE, b"a", b"a")
        await add_file(mounted, ROOT_INODE, b"b", b"a")  # a dedup hit
        mounted.duties.kept.save()
        before = KeptCounters(store.ns, read_only=False).stats.all_mounts()
        assert sum(c["commits"] for c in before.values()) == 2
        answer = await command(mounted, b"zero")
        assert answer["zeroed_at"] == mounted.duties.kept.stats.since
        after = KeptCounters(store.ns, read_only=False)
        assert all(c[k] == 0 for c in after.stats.all_mounts().values() for k in COUNTERS)
        assert after.stats.since == pytest.approx(answer["zeroed_at"])
        assert mounted.ops.stats.totals()["commits"] == 0  # the live counters too

    trio.run(t)


def test_usage_and_usage_json_report_bytes_per_top_level_directory(store: Store, mounted: Mounted) -> None:
    """Bytes and files per top-level directory (nested files count under their top), and the largest files."""
    async def t() -> None:
        inductor = mkdir(store, ROOT_INODE, b"inductor")
        sub = mkdir(store, inductor, b"xy")
        triton = mkdir(store, ROOT_INODE, b"triton")
        await add_file(mounted, inductor, b"a.py", b"a" * 100)
        await add_file(mounted, sub, b"b.py", b"b" * 200)
        await add_file(mounted, sub, b"b-copy.py", b"b" * 200)  # same blob: stored once
        await add_file(mounted, triton, b"k.cubin", b"k" * 50)
        doc = await read_json(mounted, b"usage.json")
        by_top = {row["name"]: row for row in doc["by_top"]}
        assert by_top["inductor"] == {"name": "inductor", "files": 3, "bytes": 500, "stored_bytes": 300}
        assert by_top["triton"] == {"name": "triton", "files": 1, "bytes": 50, "stored_bytes": 50}
        assert doc["largest"] == []
        answer = await command(mounted, b"usage", b"top=2")
        assert {row["name"]: row for row in answer["by_top"]} == by_top
        assert sorted(row["path"] for row in answer["largest"]) == ["inductor/xy/b-copy.py", "inductor/xy/b.py"]
        assert all(row["bytes"] == 200 for row in answer["largest"])

    trio.run(t)


def test_settings_applies_stored_config_but_keeps_fixed_settings(store: Store) -> None:
    """``settings``: config.json reaches the live policy (the evictor's too); command-line settings stay."""
    policy = EvictionPolicy(max_bytes=1 << 30, min_age=7.0)
    m = mount(store, policy, fixed=frozenset({"min_age"}))

    async def t() -> None:
        settings.save(store.root, {"max_size": 123_456_789, "low_watermark": 0.5, "high_watermark": 0.6,
                                   "min_age": 1.5, "idle_ttl": 600.0})
        answer = await command(m, b"settings")
        assert answer == {"applied": True, "kept": ["min_age"]}
        live = m.ops.budget.policy
        assert live is policy and m.ops.budget.evictor.policy is policy
        assert (live.max_bytes, live.low, live.high, live.idle_ttl) == (123_456_789, 0.5, 0.6, 600.0)
        assert live.min_age == 7.0
        # a broken file is named in the answer and changes nothing
        (store.root / settings.SETTINGS_FILE).write_text('{"max_size": "big"}')
        answer = await command(m, b"settings")
        assert "error" in answer and "max_size" in answer["error"]
        assert live.max_bytes == 123_456_789

    try:
        trio.run(t)
    finally:
        m.ops.writes.shutdown()


def test_push_and_prefetch_without_a_tier_answer_no_tier(mounted: Mounted) -> None:
    """A mount without --remote has a NullTier: no push, prefetch or forget file, and the tier itself says why."""
    async def t() -> None:
        files = control(mounted)
        assert files.lookup(b"push") is None and files.lookup(b"prefetch") is None
        assert files.lookup(b"forget") is None
        assert files.lookup(b"gc") is not None
        forget = await mounted.tier.forget_fleet(["x"])
        assert forget["no_tier"] is True and "error" in forget
        push = await mounted.tier.push()
        assert push["no_tier"] is True and "error" in push
        for set_name in (None, "default"):
            prefetch = await mounted.tier.start_prefetch(set_name)
            assert prefetch["no_tier"] is True and prefetch["started"] is False

    trio.run(t)
