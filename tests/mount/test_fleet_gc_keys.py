"""gc and the prunings take only their own keys; use records, names and sweep markers as gc reads them.

A bucket's listing of a directory returns every key below it: another fleet
nested there (``s3://B/fleet/default/usage/team2``) or a planted object.
gc and every pruning delete only keys that parse as their own records, and
a ``--remote`` nested in another fleet's reserved directories is refused.
What gc reads is hostile: a use record's time must be a time, a name counts
only if nodes would serve it, and overlapping runs each remove only their
own sweep marker.  Against a real SeaweedFS and a real redis-server.
"""

from __future__ import annotations

import json
import math
import os
import subprocess
import time
from pathlib import Path

import obstore
import pytest
import redis
from conftest import CLI, MountFactory, RedisServer, SeaweedFS, run_cli, wait_for, wait_uploaded, write_committed

DAY = 86400.0
#: Writers trust blobs 0.5 s and publish within 2.5 s of checking them, so gc's grace is 3 s (``shared.usage``);
#: use records are flushed at each uploader step, a purge keeps the 2 newest records (``PURGES_READ`` 1).
TIMES = {"MITHRILFS_BLOB_TRUST_SECONDS": "0.5", "MITHRILFS_UPLOAD_LAG_SECONDS": "2.5",
         "MITHRILFS_USE_FLUSH_SECONDS": "0", "MITHRILFS_PURGES_READ": "1"}
GRACE = "3s"
#: Where fleet 2's objects are put, each below one of fleet 1's reserved directories (fleet 1: s3://B/fleet,
#: namespace default).  A purge key begins with an inverted version: this one reads as a very old purge.
NESTED = ("fleet/default/usage/team2/", f"fleet/default/purges/{(1 << 53) - 2:020d}-team2/",
          "fleet/default/changes/team2/", "fleet/default/startup/~default/team2/", "fleet/default/packs/team2/",
          "fleet/default/blobs/team2/")


def _objects(client, prefix: str) -> dict[str, bytes]:
    """Every object below *prefix*: key -> bytes."""
    return {meta["path"]: bytes(obstore.get(client, meta["path"]).bytes())
            for batch in obstore.list(client, prefix=prefix) for meta in batch}


def _direct(client, prefix: str) -> list[str]:
    """The keys right below *prefix* (not those of a fleet nested deeper)."""
    return sorted(k for k in _objects(client, prefix) if "/" not in k[len(prefix):])


def _gc(remote: tuple[str, ...], env: dict[str, str], *args: str) -> dict:
    res = run_cli("fleet", "gc", *remote, "--grace", GRACE, "--json", *args, env=dict(os.environ, **env))
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def test_a_remote_inside_another_fleets_reserved_directories_is_refused_in_one_line(tmp_path: Path,
                                                                                  redis_server: RedisServer):
    mp = tmp_path / "mnt"
    mp.mkdir()
    for args, inside in [
        (("--remote", "s3://bkt/fleet/default/usage/team2"), "'usage' of the fleet at s3://bkt/fleet"),
        (("--remote", "s3://bkt/fleet/default/packs/x"), "'packs' of the fleet at s3://bkt/fleet"),
        (("--remote", "s3://bkt/fleet/default/names/~a/b"), "'names' of the fleet at s3://bkt/fleet"),
        (("--remote", redis_server.url, "--remote", "s3://bkt/fleet/default/purges"), "'purges'"),
        (("--remote", "s3://bkt/fleet", "--remote-namespace", "startup"), "'startup' of the fleet at s3://bkt"),
    ]:
        for command in (("fleet", "gc"), ("mount", str(mp), "--store", str(tmp_path / "store"))):
            res = run_cli(*command, *args)
            assert res.returncode == 2 and inside in res.stderr, (command, args, res.stderr)
            assert len(res.stderr.strip().splitlines()) == 1 and "Traceback" not in res.stderr, res.stderr
    # beside another fleet's namespace, not inside its directories: tried (and the endpoint does not answer)
    res = run_cli("fleet", "gc", "--remote", "s3://bkt/fleet/default/team3", "--remote-endpoint", "http://127.0.0.1:1")
    assert res.returncode == 1 and "cannot connect" in res.stderr, res.stderr
    res = run_cli("fleet", "gc", "--remote", "s3://bkt/fleet", "--remote-namespace", "..")
    assert res.returncode == 2 and "invalid namespace" in res.stderr, res.stderr


def test_gc_and_the_prunings_never_touch_a_fleet_nested_in_their_reserved_directories(
        mount_factory: MountFactory, shared_seaweedfs: SeaweedFS):
    """Fleet 2's real objects (names, packs, a blob, use records, a startup record, the feed, a purge) sit below
    fleet 1's ``usage/``, ``purges/``, ``changes/``, ``startup/~default/``, ``packs/`` and ``blobs/``; fleet 1 then
    runs gc (deleting a directory: its use records are compacted) and its announcers prune their journal, purges
    and startup records.  Fleet 1's own old keys go; every one of fleet 2's objects stays, byte for byte."""
    weed, bucket = shared_seaweedfs, "nested-fleets"
    weed.create_bucket(bucket)
    client = weed.client(bucket)
    env = {**weed.env(), **TIMES}

    two = mount_factory("two", "--remote", f"s3://{bucket}/team2", "--min-age", "0", env=env)
    files = {"kern/a.so": os.urandom(30_000), "kern/b.json": b'{"k": 1}', "big/blob.bin": os.urandom(2 << 20)}
    for rel, data in files.items():
        (two.mountpoint / rel).parent.mkdir(exist_ok=True)
        write_committed(two.mountpoint / rel, data)
    wait_uploaded(two, 60)
    for rel, data in files.items():  # read: its startup record names them
        assert (two.mountpoint / rel).read_bytes() == data
    run_cli("forget", "--fleet", str(two.mountpoint), "kern/b.json", check=True)  # the feed and a kept purge
    wait_for(lambda: two.stats()["upload_queue"] == 0, what="fleet 2's queue")
    two.umount()
    fleet2 = _objects(client, "team2/default/")
    assert {k.split("/")[2] for k in fleet2} >= {"names", "packs", "blobs", "usage", "startup", "changes", "purges"}
    nested = {place + k[len("team2/"):]: data for place in NESTED for k, data in fleet2.items()}
    for key, data in nested.items():
        obstore.put(client, key, data)

    # fleet 1's own old keys, for its prunings to delete: a journal object 8 days old, 17 old startup records
    old = time.time_ns() - 8 * int(DAY) * 10**9
    stale_change = f"fleet/default/changes/{old // 10**12:08d}/{old:020d}-old"
    obstore.put(client, stale_change, b"{}")
    for i in range(17):
        rid = f"{(1 << 63) - (time.time_ns() - (i + 1) * 3600 * 10**9):019d}-{i:08x}"
        obstore.put(client, f"fleet/default/startup/~default/{rid}", b'{"mithrilfs": 1, "order": []}')

    one = mount_factory("one", "--remote", f"s3://{bucket}/fleet", "--min-age", "0", env=env)
    for rel in ("old/o0/f", "keep/k0/f"):
        (one.mountpoint / rel).parent.mkdir(parents=True)
        write_committed(one.mountpoint / rel, rel.encode())
    wait_uploaded(one, 60)
    for rel in ("old/o0/f", "keep/k0/f"):
        assert (one.mountpoint / rel).read_bytes() == rel.encode()
    wait_for(lambda: one.stats()["remote_use_records"] >= 2, what="fleet 1's use records")
    for gone in ("gone1", "gone2", "gone3"):  # three purges kept; the announcer keeps the 2 newest
        run_cli("forget", "--fleet", str(one.mountpoint), gone, check=True)
    for key in _direct(client, "fleet/default/usage/"):
        obstore.delete(client, key)
    obstore.put(client, "fleet/default/usage/00000000000000000000-planted",
                json.dumps({"old/o0": time.time() - 3 * DAY, "keep/k0": time.time()}).encode())
    older = time.time() + 3.5
    wait_for(lambda: time.time() > older, what="the blobs to be older than the grace")
    res = _gc(("--remote", f"s3://{bucket}/fleet"), env, "--max-age", "1d")
    assert res["deleted"] == ["old/o0"], res
    one.umount()

    assert stale_change not in _objects(client, "fleet/default/changes/")  # the journal was pruned
    assert len(_direct(client, "fleet/default/startup/~default/")) == 16  # the records past the 16 newest went
    assert len(_direct(client, "fleet/default/purges/")) == 2
    # gc merged the records it read into one (the node went on writing its own)
    assert "fleet/default/usage/00000000000000000000-planted" not in _direct(client, "fleet/default/usage/")
    left = _objects(client, "fleet/")
    lost = sorted(k for k in nested if k not in left)
    assert not lost, f"{len(lost)} of fleet 2's {len(nested)} objects deleted, e.g. {lost[:3]}"
    assert all(left[k] == data for k, data in nested.items())


@pytest.mark.parametrize("kind", ["redis", "s3"])
def test_use_records_that_are_no_time_are_refused_and_their_directories_still_age(
        kind: str, mount_factory: MountFactory, redis_server: RedisServer, request: pytest.FixtureRequest):
    """JSON's ``NaN``, ``Infinity`` and ``1e999`` (a bucket's records), Redis's ``inf`` and ``-inf``: merged with
    ``max`` they kept a directory from ever aging (or, ``-inf``, aged it at once).  Refused and counted; Redis's
    scores are written over, so the directory ages from this run."""
    if kind == "s3":
        weed: SeaweedFS = request.getfixturevalue("shared_seaweedfs")
        weed.create_bucket("gc-not-a-time")
        remote, env = ("--remote", "s3://gc-not-a-time/cache"), {**weed.env(), **TIMES}
    else:
        remote, env = ("--remote", redis_server.url), dict(TIMES)
    a = mount_factory("a", *remote, "--min-age", "0", env=env)
    for i in range(3):
        (a.mountpoint / f"k{i}").mkdir()
        write_committed(a.mountpoint / f"k{i}" / "f", os.urandom(1000))
    wait_uploaded(a, 60)
    wait_for(lambda: a.stats()["remote_use_records"] >= 3, what="the writer's use records")
    days = time.time() - 3 * DAY
    if kind == "s3":
        client = weed.client("gc-not-a-time")
        for key in _direct(client, "cache/default/usage/"):
            obstore.delete(client, key)
        obstore.put(client, "cache/default/usage/00000000000000000000-planted",
                    json.dumps({f"k{i}": days for i in range(3)}).encode())
        obstore.put(client, "cache/default/usage/00000000000000000001-poison",
                    b'{"k0": NaN, "k1": Infinity, "k2": 1e999}')  # read after the planted one: max() keeps them
        res = _gc(remote, env, "--max-age", "1d")
        assert sorted(res["deleted"]) == ["k0", "k1", "k2"] and res.get("rejected") == 3, res
        return
    r = redis.Redis.from_url(redis_server.url)
    r.zadd("mfs:default:used", {"k0": days, "k1": math.inf, "k2": -math.inf})
    before = time.time()
    res = _gc(remote, env, "--max-age", "1d")
    assert res["deleted"] == ["k0"] and res.get("rejected") == 2, res
    for d in ("k1", "k2"):  # refused scores written over with the run's time: they age from now on
        score = r.zscore("mfs:default:used", d)
        assert score is not None and before - 1 <= score <= time.time(), (d, score)
    later = time.time() + 2.5
    wait_for(lambda: time.time() > later, what="the two directories to be unused for 2 s")
    assert sorted(_gc(remote, env, "--max-age", "2s")["deleted"]) == ["k1", "k2"]


def test_in_signed_mode_gc_counts_only_names_nodes_serve(mount_factory: MountFactory, redis_server: RedisServer,
                                                        tmp_path: Path):
    """Unsigned tombstones planted beside signed names, and in a directory of their own, are no names (refused,
    counted), and gc does not link (sign) that directory into its parent."""
    key = tmp_path / "key"
    key.write_bytes(os.urandom(32).hex().encode())
    signed = ("--remote", redis_server.url, "--remote-key-file", str(key))
    a = mount_factory("a", *signed, "--min-age", "0", env=dict(TIMES))
    (a.mountpoint / "e1").mkdir()
    for f in ("f", "g"):
        write_committed(a.mountpoint / "e1" / f, f.encode() * 100)
    wait_uploaded(a, 60)
    r = redis.Redis.from_url(redis_server.url)
    planted = json.dumps({"t": "x", "v": time.time_ns() // 1000, "n": "planted"})
    r.hset("mfs:default:d:e1", "planted", planted)
    r.hset("mfs:default:d:ghost", "planted", planted)
    for args in (("--dry-run",), ()):
        res = _gc(signed, TIMES, "--max-age", "1d", *args)
        assert (res["names"], res["dirs"], res.get("rejected")) == (2, 1, 2), (args, res)
    assert res["relinked"] == 0 and b"ghost" not in r.hgetall("mfs:default:d:"), res


def test_overlapping_gc_runs_each_remove_only_their_own_sweep_marker(shared_seaweedfs: SeaweedFS, tmp_path: Path):
    """Two runs sweep at once; the first to end leaves the second's marker, so writers still hold their names
    back (``S3Store.sweeping``, what a writer asks after uploading) until the second ends too."""
    from mithrilfs.shared.stores.connect import RemoteSpec, open_remote
    from mithrilfs.shared.stores.s3.settings import S3Settings

    weed = shared_seaweedfs
    weed.create_bucket("gc-overlap")
    env = {**weed.env(), **TIMES}
    store = open_remote(RemoteSpec("s3://gc-overlap/cache", s3=S3Settings(
        endpoint=weed.endpoint, access_key_id=weed.access_key, secret_access_key=weed.secret_key)))
    runs = []
    for name in ("first", "second"):
        flag = tmp_path / f"pause-{name}"
        proc = subprocess.Popen([*CLI, "fleet", "gc", "--remote", "s3://gc-overlap/cache", "--grace", GRACE, "--json"],
                                stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                                env=dict(os.environ, **env, MITHRILFS_TEST_GC_PAUSE=f"sweep:{flag}"))
        wait_for(lambda f=flag, p=proc: f.exists() or p.poll() is not None, what=f"the {name} run to sweep")
        assert proc.poll() is None, proc.communicate()
        runs.append((proc, flag))
    try:
        assert store.sweeping()
        for i, (proc, flag) in enumerate(runs):
            flag.unlink()
            _, err = proc.communicate(timeout=120)
            assert proc.returncode == 0, err
            assert store.sweeping() == (i == 0), f"after run {i + 1} ended"
        assert _direct(weed.client("gc-overlap"), "cache/default/gc-sweeps/") == []
    finally:
        for proc, flag in runs:
            flag.unlink(missing_ok=True)
            if proc.poll() is None:
                proc.kill()
                proc.communicate()
        store.close()
