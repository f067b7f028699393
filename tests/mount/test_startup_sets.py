"""Startup sets at work, against a real redis-server: one record per mount, names without manifests,
the prefetch in the background by default, reads that wait for a fetch in flight, and the look-ahead
of a lazy node."""

from __future__ import annotations

import json
import random
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import Mount, MountFactory, RedisServer, run_cli, wait_for, wait_uploaded, write_committed
from test_prefetch import fill
from test_shared_tier import _remote

from mithrilfs.testing.delay_proxy import DelayProxy

SET = "mfs:default:startup:{default}"


def commands(redis_server: RedisServer) -> dict[str, int]:
    """Calls per command so far (INFO commandstats)."""
    out = {}
    for line in redis_server.cli("INFO", "commandstats").stdout.splitlines():
        if line.startswith("cmdstat_"):
            name, rest = line[len("cmdstat_"):].split(":", 1)
            out[name] = int(rest.split("calls=")[1].split(",")[0])
    return out


def since(before: dict[str, int], redis_server: RedisServer) -> dict[str, int]:
    after = commands(redis_server)
    return {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}


def record_paths(redis_server: RedisServer) -> list[list[str]]:
    """The paths of each record of the default set, newest first."""
    ids = redis_server.cli("ZREVRANGE", SET, "0", "-1").stdout.split()
    return [[p for p, _ in json.loads(redis_server.cli("GET", f"{SET}:{i}").stdout)["order"]] for i in ids]


def test_a_load_writes_one_record_and_a_new_node_prefetches_it_in_the_background(mount_factory: MountFactory,
                                                                                redis_server: RedisServer):
    a = mount_factory("a", *_remote(redis_server))
    files = fill(a, dirs=6, per_dir=5, size=500)
    a.remount()
    order = sorted(files)
    random.Random(7).shuffle(order)
    before = commands(redis_server)
    for p in order:  # the workload's first reads, in its order
        assert (a.mountpoint / p).read_bytes() == files[p]
    assert a.stats().get("startup_set_writes", 0) == 0  # buffered: at most one write a minute
    a.umount()
    written = since(before, redis_server)
    # one record, written once (a ZADD of the set's index too; the use records of fleet gc are ZADDs as well)
    assert written.get("set") == 1, written
    assert redis_server.cli("ZCARD", SET).stdout.strip() == "1"
    recorded = record_paths(redis_server)
    assert len(recorded) == 1
    assert [p for p in recorded[0] if p in files] == order  # the read order
    assert recorded[0][:2] == ["triton", order[0].rpartition("/")[0]]  # each directory before what it holds

    # --no-prefetch: nothing is fetched at mount
    c = mount_factory("c", *_remote(redis_server, "--no-prefetch"))
    s = c.stats()
    assert s["prefetch"]["state"] == "idle" and s["physical_bytes"] == 0 and "startup_set_paths" not in s, s

    # by default the set streams in at once, with no read, the names without a manifest request
    before = commands(redis_server)
    b = mount_factory("b", *_remote(redis_server))
    wait_for(lambda: b.stats()["prefetch"]["state"] == "done", 30, "the background prefetch")
    s = b.stats()
    assert s["prefetch"]["background"] and s["prefetch"]["files"] == len(files), s["prefetch"]
    assert s["physical_bytes"] == sum(len(v) for v in files.values())
    read = since(before, redis_server)
    assert read.get("hgetall", 0) == 0, read  # the names came with the set: no directory listed
    # the set's records (RECORDS_READ) and the purges kept beside them
    assert read.get("zrevrange") == 2 and read.get("getrange", 0) <= 4, read
    assert not {"zadd", "zrem", "del", "expire"} & set(read), read  # a reader writes nothing to the set
    assert run_cli("status", "--ready", str(b.mountpoint)).returncode == 0
    redis_server.stop()  # everything is here
    for p, data in files.items():
        assert (b.mountpoint / p).read_bytes() == data


def recorded_load(a: Mount, **shape: int) -> dict[str, bytes]:
    """Node A writes a workload (``fill``), remounts, loads it in path order and unmounts: its startup set
    records that order."""
    files = fill(a, **shape)
    a.remount()
    for p in sorted(files):
        (a.mountpoint / p).read_bytes()
    a.umount()
    return files


def test_names_a_new_node_took_from_the_tier_are_never_published_again(mount_factory: MountFactory,
                                                                        redis_server: RedisServer):
    """A new store's first check of the tier's epoch queues what it holds for upload; the prefetch may have
    created the whole set from the tier before that check answers (seen in CI under load: the new node
    published all 37 names again, its blobs checked and the set's directories recorded as used). Here the
    store is left as such a node leaves it (its names from the tier, no epoch kept: killed before the check
    answered, or the check came late) and mounted again: nothing is queued, nothing is sent."""
    import sqlite3

    a = mount_factory("a", *_remote(redis_server))
    files = recorded_load(a, dirs=3, per_dir=4, size=300)
    b = mount_factory("b", *_remote(redis_server))
    wait_for(lambda: b.stats()["prefetch"]["state"] == "done", 30, "the background prefetch")
    assert b.stats()["prefetch"]["files"] == len(files)
    b.umount()
    db = sqlite3.connect(b.store / "index.sqlite3")
    with db:
        assert db.execute("DELETE FROM meta WHERE key LIKE 'remote_epoch:%'").rowcount == 1
    db.close()
    log = b.store / "mithrilfs.log"
    seen = log.read_text().count("first use of the shared tier")
    before = commands(redis_server)
    b.mount()
    wait_for(lambda: log.read_text().count("first use of the shared tier") > seen, 30, "the first epoch check")
    line = [x for x in log.read_text().splitlines() if "first use of the shared tier" in x][-1]
    wait_for(lambda: b.stats()["upload_queue"] == 0, 30, "the upload queue to drain")
    sent = since(before, redis_server)
    assert ": 0 local files queued" in line, (line, sent)
    assert not {"evalsha", "exists", "zadd", "set"} & set(sent), sent  # no blob checked, no name published
    for p, data in files.items():
        assert (b.mountpoint / p).read_bytes() == data


def test_a_directory_named_from_the_tier_is_recorded_with_the_tiers_version(mount_factory: MountFactory,
                                                                            redis_server: RedisServer):
    """B names a directory from the tier, then a subdirectory in it (two listings), and drops that
    subdirectory when a purge of it reaches B: its record dates the directory as the tier does, never by
    B's clock (neither is a change made on B), so a purge of the directory issued a moment later, within
    the nodes' clock disagreement (a bucket's whole seconds), covers it on a new node."""
    a = mount_factory("a", *_remote(redis_server))
    (a.mountpoint / "kern" / "sub").mkdir(parents=True)
    write_committed(a.mountpoint / "kern" / "k0.so", b"kernel 0")
    write_committed(a.mountpoint / "kern" / "sub" / "k2.so", b"kernel 2")
    wait_uploaded(a)
    b = mount_factory("b", *_remote(redis_server))
    assert (b.mountpoint / "kern" / "k0.so").read_bytes() == b"kernel 0"
    assert (b.mountpoint / "kern" / "sub" / "k2.so").read_bytes() == b"kernel 2"
    run_cli("forget", "--fleet", str(a.mountpoint), "kern/sub", check=True)
    wait_for(lambda: not (b.mountpoint / "kern" / "sub").exists(), 30, "B to drop the purged directory")
    b.umount()
    tier = json.loads(redis_server.cli("HGET", "mfs:default:d:", "kern").stdout)
    (record_id,) = redis_server.cli("ZREVRANGE", SET, "0", "-1").stdout.split()
    recorded = {p: json.loads(e) for p, e in json.loads(redis_server.cli("GET", f"{SET}:{record_id}").stdout)["order"]}
    assert list(recorded) == ["kern", "kern/k0.so"]
    assert (recorded["kern"]["v"], recorded["kern"]["n"]) == (tier["v"], tier["n"]), (recorded, tier)


def test_a_read_of_what_the_prefetch_is_bringing_waits_for_it(mount_factory: MountFactory,
                                                              redis_server: RedisServer):
    """Through a proxy that makes every exchange with Redis cost 300 ms, a new node's workload reads the
    set's files while the background prefetch brings them: every byte right, each blob fetched once (a read
    and the prefetch wanting the same blob share one fetch, whichever asked first)."""
    a = mount_factory("a", *_remote(redis_server))
    files = recorded_load(a, dirs=4, per_dir=40, size=200)
    with DelayProxy("127.0.0.1", redis_server.port, rtt_ms=300, protocol="redis", connect_rtts=0) as proxy:
        b = mount_factory("b", "--remote", f"redis://127.0.0.1:{proxy.port}/0", "--min-age", "0")
        order = sorted(files, reverse=True)  # the last of the set first: some queued, some on their way
        with ThreadPoolExecutor(4) as pool:
            got = dict(zip(order, pool.map(lambda p: (b.mountpoint / p).read_bytes(), order)))
        assert got == files
        wait_for(lambda: b.stats()["prefetch"]["state"] == "done", 60, "the background prefetch")
        s = b.stats()
    assert s["remote_fetched_bytes"] == sum(len(v) for v in files.values()), s  # none fetched twice
    assert s["remote_fetch_joined"] >= 1, s


def test_a_lazy_node_looks_ahead_in_the_recorded_order(mount_factory: MountFactory, redis_server: RedisServer):
    a = mount_factory("a", *_remote(redis_server))
    files = recorded_load(a, dirs=12, per_dir=4, size=300)  # kernel after kernel
    d = mount_factory("d", *_remote(redis_server, "--no-prefetch"))
    for i in range(4):
        assert (d.mountpoint / f"triton/k000/f{i}.bin").read_bytes() == files[f"triton/k000/f{i}.bin"]
    wait_for(lambda: "startup_set_paths" in d.stats(), 20, "the startup set to be read")
    assert (d.mountpoint / "triton/k001/f0.bin").read_bytes() == files["triton/k001/f0.bin"]
    # the next kernels (k002..k011: all ten left, a batch being up to 16) come ahead of their reads, in one
    # batch
    wait_for(lambda: d.stats().get("remote_look_ahead", 0) == 10 * 4, 20, "the look-ahead")
    before, fetched = commands(redis_server), d.stats()["remote_fetched_bytes"]
    for p in sorted(files):
        if "k002" <= p.split("/")[1] <= "k011":
            assert (d.mountpoint / p).read_bytes() == files[p]
    assert d.stats()["remote_fetched_bytes"] == fetched  # here before they were read
    assert since(before, redis_server).get("hgetall", 0) == 0  # and their names came with the set
    for p, data in files.items():
        assert (d.mountpoint / p).read_bytes() == data


def test_a_hostile_startup_set_is_refused_and_counted_never_fatal(mount_factory: MountFactory,
                                                                  redis_server: RedisServer, tmp_path: Path):
    from mithrilfs.shared.stores.records import new_record_id, record_time

    key = tmp_path / "key"
    key.write_bytes(b"k" * 32)
    signed = _remote(redis_server, "--remote-key-file", str(key))
    a = mount_factory("a", *signed)
    files = fill(a, dirs=2, per_dir=3, size=100)
    a.remount()
    for p in sorted(files):
        (a.mountpoint / p).read_bytes()
    a.umount()
    (good_id,) = redis_server.cli("ZRANGE", SET, "0", "-1").stdout.split()
    good = json.loads(redis_server.cli("GET", f"{SET}:{good_id}").stdout)["order"]
    path, entry = next(item for item in good if item[0].endswith(".bin"))
    forged = json.dumps(dict(json.loads(entry), s=5))  # its size changed, its signature kept
    for value in ("not json at all", json.dumps({"mithrilfs": 1, "order": [[path, forged], ["../x", entry],
                                                                            [path, "{}"], 7]}),
                  json.dumps({"mithrilfs": 1, "order": "x" * 1000})):
        rid = new_record_id()
        redis_server.cli("SET", f"{SET}:{rid}", value)
        redis_server.cli("ZADD", SET, str(record_time(rid)), rid)
    b = mount_factory("b", *signed)
    wait_for(lambda: b.stats()["prefetch"]["state"] == "done", 30, "the background prefetch")
    s = b.stats()
    assert s["prefetch"]["files"] == len(files) and s["remote_rejected"] >= 5, s
    for p, data in files.items():
        assert (b.mountpoint / p).read_bytes() == data


@pytest.mark.timeout(300)
def test_a_prefetch_asked_while_the_mounts_own_runs_joins_it(mount_factory: MountFactory, redis_server: RedisServer):
    """A plain mount prefetches its set in the background; ``prefetch`` asked meanwhile (a startup script
    written before that default) waits for it and prints its result, as ``mount --prefetch`` does, and so
    does a second one; ``prefetch --all`` asked meanwhile runs once it ended.  Through a proxy that makes
    every exchange with Redis cost 600 ms: the mount's prefetch still runs when they ask."""
    a = mount_factory("a", *_remote(redis_server))
    files = recorded_load(a, dirs=8, per_dir=40, size=200)
    with DelayProxy("127.0.0.1", redis_server.port, rtt_ms=600, protocol="redis", connect_rtts=0) as proxy:
        b = mount_factory("b", "--remote", f"redis://127.0.0.1:{proxy.port}/0", "--min-age", "0")
        assert b.stats()["prefetch"]["state"] == "running"
        with ThreadPoolExecutor(3) as pool:
            asked = [pool.submit(run_cli, "prefetch", str(b.mountpoint), *extra) for extra in ([], [], ["--all"])]
            joined, other, everything = (f.result() for f in asked)
        s = b.stats()
    for res in (joined, other, everything):
        assert res.returncode == 0, res.stderr
    # both report the mount's own prefetch, which fetched the whole set
    assert joined.stdout.startswith(f"prefetched {len(files)} files,") and other.stdout == joined.stdout
    assert "a prefetch of set default is already running" in everything.stderr
    first, = s["prefetch"]["earlier"]
    assert first["background"] and first["run"] == 1 and first["files"] == len(files), s["prefetch"]
    # --all ran after it: everything was here already
    assert (s["prefetch"]["set"], s["prefetch"]["run"], s["prefetch"]["state"]) == ("*", 2, "done"), s["prefetch"]
    assert everything.stdout.startswith("prefetched 0 files,"), everything.stdout
    assert s["physical_bytes"] == sum(len(v) for v in files.values())
