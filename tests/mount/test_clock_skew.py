"""No node's clock decides for the fleet: versions and ages are the tier's time (``shared/tier_clock``).

One node of two runs under libfaketime (its daemon's wall clock a day ahead
or thirty days behind), against a real
redis-server and a real SeaweedFS bucket.  A bucket checks SigV4 request
times (SeaweedFS answers 403 to a node a day off, as S3 does past 15
minutes), so there the skewed node runs 10 minutes ahead or behind, and gc's
``--max-age`` is 5 minutes where Redis's is 7 days.  Before the tier's clock, a node a
day ahead pinned every path it wrote (no purge or later write got through)
and one thirty days behind had what it published that minute collected by
``fleet gc --max-age 7d``.  Entries an older release dated ahead are planted
in the tier as such a node left them.
"""

from __future__ import annotations

import json
import os
import re
import time
from dataclasses import dataclass
from pathlib import Path

import obstore
import pytest
import redis
from conftest import MountFactory, RedisServer, SeaweedFS, run_cli, wait_for, wait_uploaded, write_committed
from test_fleet_gc import TIMES
from test_fleet_gc import Tier as GcTier

from mithrilfs.store.cas import hash_bytes

FAKETIME_LIB = "/usr/lib/x86_64-linux-gnu/faketime/libfaketime.so.1"
DAY = 86400.0

def skewed(offset: str) -> dict[str, str]:
    """The environment that runs a process with its wall clock moved by *offset* (libfaketime's "+1d").  Its
    monotonic clock moves by as much, which changes no interval; with ``FAKETIME_DONT_FAKE_MONOTONIC=1``
    libfaketime 0.9.10 (Debian 12) fails every ``time.sleep`` with EINVAL."""
    return {"LD_PRELOAD": FAKETIME_LIB, "FAKETIME": offset}


@dataclass
class Tier(GcTier):
    """``test_fleet_gc``'s look inside the tier, with how far the skewed node's clock runs ahead and behind and a
    ``--max-age`` it would fall foul of."""

    ahead: str = "+1d"
    behind: str = "-30d"
    max_age: str = "7d"

    def node(self, mount_factory: MountFactory, name: str, clock: str | None = None):
        env = {**self.env, **(skewed(clock) if clock else {})}
        return mount_factory(name, *self.remote, "--min-age", "0", env=env)

    def entry(self, path: str) -> dict | None:
        """The tier's entry for *path*, as any node would read it."""
        d, _, name = path.rpartition("/")
        return self.names().get(d, {}).get(name)

    def _manifest_key(self, d: str) -> str:
        from urllib.parse import quote

        return self.BASE + "names/" + "".join(f"~{quote(p, safe='')}/" for p in d.split("/")) + "#"

    def plant(self, path: str, **changes) -> None:
        """Rewrite *path*'s entry in the tier as a writer with another clock (an older release) left it."""
        d, _, name = path.rpartition("/")
        if self.kind == "redis":
            r = redis.Redis.from_url(self.redis_url)
            e = json.loads(r.hget(f"mfs:default:d:{d}", name))
            r.hset(f"mfs:default:d:{d}", name, json.dumps({**e, **changes}, sort_keys=True))
            return
        key = self._manifest_key(d)
        doc = json.loads(bytes(obstore.get(self._s3(), key).bytes()))
        doc["entries"][name] = json.dumps({**json.loads(doc["entries"][name]), **changes}, sort_keys=True)
        obstore.put(self._s3(), key, json.dumps(doc).encode())


@pytest.fixture(params=["redis", "s3"])
def tier(request: pytest.FixtureRequest, redis_server: RedisServer) -> Tier:
    if request.param == "redis":
        return Tier("redis", ("--remote", redis_server.url), dict(TIMES), redis_url=redis_server.url)
    weed: SeaweedFS = request.getfixturevalue("shared_seaweedfs")
    bucket = "clk-" + re.sub(r"[^a-z0-9]+", "-", request.node.name.lower())[-40:].strip("-")
    weed.create_bucket(bucket)
    return Tier("s3", ("--remote", f"s3://{bucket}/cache"), {**weed.env(), **TIMES}, ahead="+10m", behind="-10m",
                max_age="5m", weed=weed, bucket=bucket)


def _read(path: Path) -> bytes | None:
    try:
        return path.read_bytes()
    except FileNotFoundError:
        return None


def _serves(m, rel: str, data: bytes | None) -> bool:
    """*m* serves *data* at *rel* (None: no such file) once it listed the directory (as a reader would)."""
    p = m.mountpoint / rel
    try:
        os.listdir(p.parent)
    except FileNotFoundError:
        return data is None
    return _read(p) == data


def _clock_said(m, offset: str) -> bool:
    """The daemon ran with its clock moved by *offset* (libfaketime took) and said so, measured against the
    tier's."""
    log = (m.store / "mithrilfs.log").read_text(errors="replace")
    return re.search(rf"this node's clock is \{offset[0]}\d+(\.\d)? s off the shared tier's", log) is not None


def _version_is_the_tiers(e: dict) -> bool:
    return abs(e["v"] / 1e6 - time.time()) < 60


@pytest.mark.timeout(240)
def test_a_node_whose_clock_runs_ahead_pins_nothing_and_a_fix_and_a_purge_reach_every_node(
        mount_factory: MountFactory, tier: Tier):
    f = tier.node(mount_factory, "f", tier.ahead)
    c = tier.node(mount_factory, "c")
    rel = "triton/ahead/k.py"
    (f.mountpoint / "triton" / "ahead").mkdir(parents=True)
    write_committed(f.mountpoint / rel, b"F's kernel, written a day ahead\n")
    wait_uploaded(f, 60)
    e = tier.entry(rel)
    assert e is not None and _version_is_the_tiers(e), e  # the tier's time, not F's

    # a correct node fixes the file: the fix is newer, on every node, the fixing node and F included (made
    # once the tier's time passed F's version by more than two measurements of a clock may differ: a bucket
    # dates by whole seconds)
    wait_for(lambda: _serves(c, rel, b"F's kernel, written a day ahead\n"), 30, "C reading F's file")
    wait_for(lambda: time.time() > e["v"] / 1e6 + 2, 10, "the tier's time past F's version")
    write_committed(c.mountpoint / rel, b"the fixed kernel\n")
    wait_uploaded(c, 60)
    assert tier.entry(rel)["h"] == hash_bytes(b"the fixed kernel\n").hex()
    wait_for(lambda: _serves(f, rel, b"the fixed kernel\n"), 30, "F serving the fix")
    assert _read(c.mountpoint / rel) == b"the fixed kernel\n"
    n = tier.node(mount_factory, "n")
    assert _read(n.mountpoint / rel) == b"the fixed kernel\n"

    # and a purge from F (its clock a day ahead) reaches every node, a new one included
    res = run_cli("forget", "--fleet", str(f.mountpoint), "triton/ahead")
    assert res.returncode == 0, res.stderr
    assert tier.entry(rel)["t"] == "x"
    for m in (c, n):
        wait_for(lambda m=m: _read(m.mountpoint / rel) is None, 15, f"{m.mountpoint.name} dropping the purged file")
    assert _read(tier.node(mount_factory, "n2").mountpoint / rel) is None
    assert _clock_said(f, tier.ahead)


@pytest.mark.timeout(240)
def test_an_entry_an_older_writer_dated_ahead_keeps_out_neither_a_write_nor_a_purge(
        mount_factory: MountFactory, tier: Tier):
    """What a node a day ahead left in the tier before it dated by the tier's clock: refused by readers,
    replaced by the next write, and tombstoned by a purge (before: the purge said "forgot" and every node
    kept serving it; the fixing node's own write was replaced by it)."""
    a = tier.node(mount_factory, "a")
    rel = "triton/pinned/k.py"
    (a.mountpoint / "triton" / "pinned").mkdir(parents=True)
    write_committed(a.mountpoint / rel, b"the pinned kernel\n")
    wait_uploaded(a, 60)
    ahead = int((time.time() + DAY) * 1e6)
    tier.plant(rel, v=ahead)
    assert _read(tier.node(mount_factory, "fresh").mountpoint / rel) is None  # refused: no version at all

    write_committed(a.mountpoint / rel, b"the fixed kernel\n")
    wait_uploaded(a, 60)
    assert tier.entry(rel)["h"] == hash_bytes(b"the fixed kernel\n").hex()
    assert _read(tier.node(mount_factory, "n").mountpoint / rel) == b"the fixed kernel\n"
    assert _read(a.mountpoint / rel) == b"the fixed kernel\n"

    tier.plant(rel, v=ahead)
    res = run_cli("forget", "--fleet", str(a.mountpoint), "triton/pinned")
    assert res.returncode == 0, res.stderr
    assert tier.entry(rel)["t"] == "x"


@pytest.mark.timeout(240)
def test_forget_fleet_fails_in_one_line_when_an_entry_survives_it(mount_factory: MountFactory, tier: Tier):
    """An entry dated within a clock's error ahead of the purge is newer than its tombstone: it survives, and
    the command says so (before: "forgot ...", exit 0, with the entry still served everywhere)."""
    a = tier.node(mount_factory, "a")
    rel = "triton/later/k.py"
    (a.mountpoint / "triton" / "later").mkdir(parents=True)
    write_committed(a.mountpoint / rel, b"written just after the purge began\n")
    wait_uploaded(a, 60)
    tier.plant(rel, v=int((time.time() + 30) * 1e6))
    res = run_cli("forget", "--fleet", str(a.mountpoint), "triton/later")
    assert res.returncode == 1
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and "still live" in lines[0] and rel in lines[0], res.stderr
    assert tier.entry(rel)["t"] == "f"


@pytest.mark.timeout(240)
def test_gc_never_collects_what_a_node_whose_clock_runs_behind_just_published(mount_factory: MountFactory,
                                                                             tier: Tier):
    s = tier.node(mount_factory, "s", tier.behind)
    data = os.urandom(40_000)
    (s.mountpoint / "triton" / "behind").mkdir(parents=True)
    write_committed(s.mountpoint / "triton/behind/k.bin", data)
    wait_uploaded(s, 60)
    wait_for(lambda: s.stats()["remote_use_records"] >= 1, what="S's use record")
    res = tier.gc_json("--max-age", tier.max_age, "--grace", "7h")
    assert res["deleted_dirs"] == 0, res
    assert tier.entry("triton/behind/k.bin")["t"] == "f"
    assert tier.has_blob(data)
    assert _read(tier.node(mount_factory, "n").mountpoint / "triton/behind/k.bin") == data
    assert _clock_said(s, tier.behind)


@pytest.mark.timeout(240)
def test_a_use_record_dated_ahead_ages_like_any_other(mount_factory: MountFactory, tier: Tier):
    """A use record a writer dated a day ahead used to keep its directory from ever aging (``--max-age``
    never reached it): it counts as a use now, and ages from there."""
    a = tier.node(mount_factory, "a")
    (a.mountpoint / "triton" / "old").mkdir(parents=True)
    write_committed(a.mountpoint / "triton/old/k.bin", b"unused from now on\n")
    wait_uploaded(a, 60)
    wait_for(lambda: a.stats()["remote_use_records"] >= 1, what="A's use record")
    a.umount()
    tier.plant_use({"triton/old": time.time() + DAY})

    def collected() -> bool:
        tier.gc_json("--max-age", "2s")
        e = tier.entry("triton/old/k.bin")
        return e is None or e["t"] == "x"

    wait_for(collected, 60, "gc collecting the directory whose use record was dated a day ahead")
