"""``mithrilfs fleet gc``: a budget for the shared tier, on a real redis-server and a real SeaweedFS bucket.

What remains after a run is what the fleet used most recently (nodes record
their reads), a new node reads all of it byte for byte, nothing dangles
(every name's blob is there, every directory with names is reachable), and
gc racing writers or killed half-way loses no name it did not choose.
Use records are planted in the tier as a node of days ago would have left
them: the test cannot wait days.
"""

from __future__ import annotations

import json
import os
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

import obstore
import pytest
import redis
from conftest import MountFactory, RedisServer, SeaweedFS, run_cli, wait_for, wait_uploaded, write_committed

from mithrilfs.observe.metrics import render
from mithrilfs.store.cas import hash_bytes

DAY = 86400.0
#: What writers and gc assume in these tests (``shared.usage``): blobs trusted 0.5 s, names published within
#: 2.5 s of their blobs' check (else checked again), so a 3 s grace.
TIMES = {"MITHRILFS_BLOB_TRUST_SECONDS": "0.5", "MITHRILFS_UPLOAD_LAG_SECONDS": "2.5",
         "MITHRILFS_USE_RECORD_SECONDS": "0", "MITHRILFS_USE_FLUSH_SECONDS": "0"}
GRACE = "3s"


@dataclass
class Tier:
    """One shared tier as the test sees it: how nodes and gc reach it, and a look inside."""

    kind: str
    remote: tuple[str, ...]
    env: dict[str, str]
    redis_url: str = ""
    weed: SeaweedFS | None = None
    bucket: str = ""

    BASE = "cache/default/"

    def gc(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        return run_cli("fleet", "gc", *self.remote, "--grace", GRACE, *args, timeout=timeout,
                       env=dict(os.environ, **self.env))

    def gc_json(self, *args: str) -> dict:
        res = self.gc(*args, "--json")
        assert res.returncode == 0, res.stderr
        return json.loads(res.stdout)

    # -- a look inside ---------------------------------------------------------
    def _r(self) -> redis.Redis:
        return redis.Redis.from_url(self.redis_url)

    def _s3(self):
        assert self.weed is not None
        return self.weed.client(self.bucket)

    def plant_use(self, times: dict[str, float]) -> None:
        """The use records a fleet would have left: directory -> when it was last used."""
        if self.kind == "redis":
            self._r().zadd("mfs:default:used", times)
            return
        for batch in obstore.list(self._s3(), prefix=self.BASE + "usage/"):
            for meta in batch:
                obstore.delete(self._s3(), meta["path"])
        obstore.put(self._s3(), self.BASE + "usage/00000000000000000000-planted", json.dumps(times).encode())

    def has_blob(self, data: bytes) -> bool:
        h = hash_bytes(data).hex()
        if self.kind == "redis":
            return bool(self._r().exists(f"mfs:default:b:{{{h}}}:0"))
        try:
            obstore.head(self._s3(), f"{self.BASE}blobs/{h[:2]}/{h}")
            return True
        except FileNotFoundError:
            return False

    def names(self) -> dict[str, dict[str, dict]]:
        """Every directory's entries, as the tier holds them."""
        if self.kind == "redis":
            r = self._r()
            out = {}
            for k in r.scan_iter(match="mfs:default:d:*"):
                raw = r.hgetall(k)
                raw.pop(b"\0complete", None)
                if raw:
                    out[k[len("mfs:default:d:"):].decode()] = {n.decode(): json.loads(v) for n, v in raw.items()}
            return out
        from urllib.parse import unquote

        out = {}
        for batch in obstore.list(self._s3(), prefix=self.BASE + "names/"):
            for meta in batch:
                rest = meta["path"][len(self.BASE + "names/"):-1]
                d = "/".join(unquote(p[1:]) for p in rest.split("/") if p)
                doc = json.loads(bytes(obstore.get(self._s3(), meta["path"]).bytes()))
                if doc["entries"]:
                    out[d] = {n: json.loads(v) for n, v in doc["entries"].items()}
        return out

    def assert_nothing_dangles(self) -> None:
        """Every file entry's blob is in the tier; every directory holding names is named in its parent."""
        names = self.names()
        for d, entries in names.items():
            if d:
                parent, _, base = d.rpartition("/")
                assert names.get(parent, {}).get(base, {}).get("t") == "d", f"directory {d!r} is not reachable"
            for name, e in entries.items():
                if e["t"] == "f" and e["s"]:
                    h = e["h"]
                    present = (bool(self._r().exists(f"mfs:default:b:{{{h}}}:0")) if self.kind == "redis"
                               else _s3_has(self._s3(), f"{self.BASE}blobs/{h[:2]}/{h}"))
                    assert present, f"{d}/{name} names blob {h[:16]}, which is gone"


def _s3_has(client, key: str) -> bool:
    try:
        obstore.head(client, key)
        return True
    except FileNotFoundError:
        return False


@pytest.fixture(params=["redis", "s3"])
def tier(request: pytest.FixtureRequest, redis_server: RedisServer) -> Tier:
    if request.param == "redis":
        return Tier("redis", ("--remote", redis_server.url), dict(TIMES), redis_url=redis_server.url)
    weed: SeaweedFS = request.getfixturevalue("shared_seaweedfs")
    bucket = "gc-" + request.node.name.replace("_", "-").replace("[", "-").replace("]", "")[-40:].strip("-").lower()
    weed.create_bucket(bucket)
    return Tier("s3", ("--remote", f"s3://{bucket}/cache"), {**weed.env(), **TIMES}, weed=weed, bucket=bucket)


def _node(mount_factory: MountFactory, tier: Tier, name: str):
    return mount_factory(name, *tier.remote, "--min-age", "0", env=tier.env)


def _entries(root: Path, n: int) -> dict[str, bytes]:
    """*n* cache entries ``triton/kI`` of two files each (50 KB, all different)."""
    files = {}
    for i in range(n):
        (root / "triton" / f"k{i}").mkdir(parents=True)
        for f in ("kernel.cubin", "kernel.json"):
            data = os.urandom(50_000)
            write_committed(root / "triton" / f"k{i}" / f, data)
            files[f"triton/k{i}/{f}"] = data
    return files


def test_gc_keeps_what_was_used_most_recently_under_max_age_and_max_size(mount_factory: MountFactory, tier: Tier):
    a = _node(mount_factory, tier, "a")
    files = _entries(a.mountpoint, 6)
    wait_uploaded(a, 60)
    now = time.time()
    older = now + 3.5
    # a fleet last used kI (10 - I) days ago and an hour
    tier.plant_use({f"triton/k{i}": now - (10 - i) * DAY - 3600 for i in range(6)})
    b = _node(mount_factory, tier, "b")
    for i in (0, 1):  # b uses the two oldest today: they count as the most recent
        assert (b.mountpoint / "triton" / f"k{i}" / "kernel.cubin").read_bytes() == files[f"triton/k{i}/kernel.cubin"]
    wait_for(lambda: b.stats()["remote_use_records"] >= 2, what="b's use records")
    wait_for(lambda: time.time() > older, what="the blobs to be older than the grace")
    dry = tier.gc_json("--max-age", "7d", "--dry-run")
    assert sorted(dry["deleted"]) == ["triton/k2", "triton/k3"] and dry["deleted_blobs"] == 4
    assert all(tier.has_blob(files["triton/k2/kernel.cubin"]) for _ in [0])  # a dry run deletes nothing

    by_age = tier.gc_json("--max-age", "7d")
    assert sorted(by_age["deleted"]) == ["triton/k2", "triton/k3"]
    assert by_age["deleted_names"] == 4 and by_age["deleted_blobs"] == 4 and by_age["freed_bytes"] == 200_000
    by_size = tier.gc_json("--max-size", "350K")  # three entries fit: k0, k1 (used today) and k5
    assert by_size["deleted"] == ["triton/k4"] and by_size["bytes"] == 300_000 and by_size["freed_bytes"] == 100_000
    tier.assert_nothing_dangles()
    kept = {p: d for p, d in files.items() if p.split("/")[1] in ("k0", "k1", "k5")}
    for p, d in files.items():
        assert tier.has_blob(d) == (p in kept), p

    c = _node(mount_factory, tier, "c")  # a new node reads all that is left, and nothing else
    assert sorted(os.listdir(c.mountpoint / "triton")) == ["k0", "k1", "k5"]
    for p, d in kept.items():
        assert (c.mountpoint / p).read_bytes() == d
    for gone in ("k2", "k3", "k4"):
        with pytest.raises(FileNotFoundError):
            (c.mountpoint / "triton" / gone / "kernel.cubin").stat()
    # a second run finds nothing more to do
    again = tier.gc_json("--max-age", "7d", "--max-size", "350K")
    assert again["deleted"] == [] and again["deleted_blobs"] == 0 and again["names"] == 6
    # every node shows the tier's size and count from the last run, and logs it as an event
    wait_for(lambda: c.stats().get("remote_tier_names") == 6, timeout=90, what="the gc summary on a node")
    assert c.stats()["remote_tier_bytes"] == 300_000
    events = [json.loads(line) for line in (c.store / "events.jsonl").read_text().splitlines()]
    assert any(e["event"] == "fleet_gc" and e["names"] == 6 for e in events)
    shown = run_cli("stats", str(c.mountpoint)).stdout
    assert "6 names, 293.0 KiB" in shown, shown
    assert "mithrilfs_remote_tier_names 6" in render(c.stats())  # what Prometheus is served


def test_fleet_gc_bad_input_is_one_line(tmp_path: Path, redis_server: RedisServer):
    for args, code, words in [
        (("--remote", "ftp://x"), 2, "invalid remote"),
        (("--remote", redis_server.url, "--max-size", "lots"), 2, "invalid size"),
        (("--remote", redis_server.url, "--max-age", "soon"), 2, "invalid duration"),
        (("--remote", redis_server.url, "--grace", "1s"), 2, "--grace must be at least"),
        (("--remote", redis_server.url, "--remote-key-file", str(tmp_path / "none")), 2, "cannot read key file"),
        (("--remote", "redis://127.0.0.1:1/0"), 1, "fleet gc of redis://127.0.0.1:1/0"),
        ((), 2, "--remote"),
    ]:
        res = run_cli("fleet", "gc", *args)
        assert res.returncode == code and words in res.stderr and len(res.stderr.strip().splitlines()) == 1, \
            (args, res.returncode, res.stderr)
