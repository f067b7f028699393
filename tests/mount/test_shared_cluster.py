"""The shared tier on a real three-master Redis Cluster."""

from __future__ import annotations

import os
import subprocess

from conftest import MountFactory, RedisCluster, wait_for, wait_uploaded, write_committed
from test_shared_tier import blob_key


def _remote(cluster: RedisCluster) -> tuple[str, ...]:
    return ("--remote", cluster.url, "--remote-cluster", "--min-age", "0")


def test_cluster_shares_names_and_blobs(mount_factory: MountFactory, redis_cluster: RedisCluster):
    env = {"MITHRILFS_REMOTE_CHUNK_BYTES": "1024"}
    a = mount_factory("a", *_remote(redis_cluster), env=env)
    b = mount_factory("b", *_remote(redis_cluster), env=env)
    (a.mountpoint / "triton").mkdir()
    files = {f"triton/k{i}/kernel.so": os.urandom(5000 if i == 0 else 300) for i in range(30)}
    for path, data in files.items():
        (a.mountpoint / path).parent.mkdir(exist_ok=True)
        write_committed(a.mountpoint / path, data)
    wait_uploaded(a)
    # the names landed on every master, and all chunks of a blob in one slot
    port = redis_cluster.ports[0]
    big = files["triton/k0/kernel.so"]
    slots = {redis_cluster.cli(port, "CLUSTER", "KEYSLOT", blob_key(big, i)).stdout.strip() for i in range(5)}
    assert len(slots) == 1
    counts = [int(redis_cluster.cli(p, "DBSIZE").stdout) for p in redis_cluster.ports]
    assert all(c > 0 for c in counts), counts
    for path, data in files.items():
        assert (b.mountpoint / path).read_bytes() == data
    # a deletion reaches the other node through the cluster too
    subprocess.run(["rm", "-rf", str(a.mountpoint / "triton" / "k1")], check=True)
    wait_uploaded(a)
    # B re-syncs a known directory in the background
    wait_for(lambda: "k1" not in os.listdir(b.mountpoint / "triton"), 20, "the deletion to reach B")


def test_cluster_master_restarted_empty_gets_its_share_again(mount_factory: MountFactory,
                                                             redis_cluster: RedisCluster):
    a = mount_factory("a", *_remote(redis_cluster))
    for i in range(40):
        write_committed(a.mountpoint / f"f{i}", b"kernel %d" % i)
    wait_uploaded(a)
    victim = redis_cluster.ports[1]
    assert int(redis_cluster.cli(victim, "DBSIZE").stdout) > 0
    before = redis_cluster.run_id(victim)
    redis_cluster.restart_empty(victim)
    # a new process with no save file: empty when it started (the node may already be refilling it,
    # so its DBSIZE is no proof of that; its run id is)
    assert redis_cluster.run_id(victim) != before
    wait_for(lambda: a.stats()["remote_data_lost"] > 0 and not a.stats()["upload_queue"], 30,
             "the node to notice the master's loss and upload again")
    assert int(redis_cluster.cli(victim, "DBSIZE").stdout) > 0  # its share is back
    b = mount_factory("b", *_remote(redis_cluster))
    for i in range(40):
        assert (b.mountpoint / f"f{i}").read_bytes() == b"kernel %d" % i


def test_fleet_gc_of_a_cluster_keeps_what_was_used_and_deletes_the_rest(mount_factory: MountFactory,
                                                                        redis_cluster: RedisCluster):
    """``fleet gc`` on a three-master cluster: names, use records and blobs live on different masters
    (a blob's chunks in one slot), and gc deletes the entries unused for days, their blobs, nothing else;
    a new node reads what is left."""
    import json
    import time

    import redis.cluster
    from conftest import run_cli

    times = {"MITHRILFS_BLOB_TRUST_SECONDS": "0.5", "MITHRILFS_UPLOAD_LAG_SECONDS": "2.5",
             "MITHRILFS_USE_FLUSH_SECONDS": "0"}
    a = mount_factory("a", *_remote(redis_cluster), env=times)
    files = {f"triton/k{i}/{f}": os.urandom(3000) for i in range(6) for f in ("kernel.so", "kernel.json")}
    for path, data in files.items():
        (a.mountpoint / path).parent.mkdir(parents=True, exist_ok=True)
        write_committed(a.mountpoint / path, data)
    wait_uploaded(a)
    wait_for(lambda: a.stats()["remote_use_records"] >= 6, 30, "the writer's use records")
    r = redis.cluster.RedisCluster.from_url(redis_cluster.url)
    old = time.time() - 3 * 86400
    r.zadd("mfs:default:used", {f"triton/k{i}": old for i in range(3)})
    written = time.time() + 3.5
    wait_for(lambda: time.time() > written, what="the blobs to be older than the grace")
    res = run_cli("fleet", "gc", *_remote(redis_cluster)[:3], "--max-age", "1d", "--grace", "3s", "--json",
                  env=dict(os.environ, **times))
    assert res.returncode == 0, res.stderr
    report = json.loads(res.stdout)
    assert sorted(report["deleted"]) == ["triton/k0", "triton/k1", "triton/k2"], report
    assert report["deleted_names"] == 6 and report["deleted_blobs"] == 6 and report["freed_bytes"] == 18_000
    for path, data in files.items():
        kept = path.split("/")[1] in ("k3", "k4", "k5")
        assert bool(r.exists(blob_key(data, 0))) == kept, path
    c = mount_factory("c", *_remote(redis_cluster))
    assert sorted(os.listdir(c.mountpoint / "triton")) == ["k3", "k4", "k5"]
    for path, data in files.items():
        if path.split("/")[1] in ("k3", "k4", "k5"):
            assert (c.mountpoint / path).read_bytes() == data
