"""A new node starts warm: batched names, startup sets and prefetch, against a real redis-server."""

from __future__ import annotations

import errno
import json
import os
import time

import pytest
from conftest import MountFactory, RedisServer, run_cli, wait_for, wait_uploaded, write_committed
from test_shared_tier import _remote, blob_key


def fill(m, dirs: int, per_dir: int, size: int = 3000) -> dict[str, bytes]:
    files = {}
    for d in range(dirs):
        (m.mountpoint / "triton" / f"k{d:03d}").mkdir(parents=True, exist_ok=True)
        for i in range(per_dir):
            path = f"triton/k{d:03d}/f{i}.bin"
            files[path] = os.urandom(size)
            write_committed(m.mountpoint / path, files[path])
    wait_uploaded(m)
    return files


def calls(redis_server: RedisServer, command: str) -> int:
    for line in redis_server.cli("INFO", "commandstats").stdout.splitlines():
        if line.startswith(f"cmdstat_{command}:"):
            return int(line.split("calls=")[1].split(",")[0])
    return 0


def test_cold_walk_costs_one_request_per_directory(mount_factory: MountFactory, redis_server: RedisServer):
    a = mount_factory("a", *_remote(redis_server))
    fill(a, dirs=10, per_dir=20, size=100)
    b = mount_factory("b", *_remote(redis_server))
    before = {c: calls(redis_server, c) for c in ("hget", "hgetall")}
    for d in range(10):
        for i in range(20):  # the framework's way: stat, then open, name by name
            assert (b.mountpoint / "triton" / f"k{d:03d}" / f"f{i}.bin").stat().st_size == 100
        # a name that exists nowhere, right after: answered from the directory just synced
        assert not (b.mountpoint / "triton" / f"k{d:03d}" / "absent.bin").exists()
    assert calls(redis_server, "hget") == before["hget"]
    assert calls(redis_server, "hgetall") - before["hgetall"] <= 12  # root, triton and ten kernels


def test_prefetch_all_brings_verified_names_and_blobs(mount_factory: MountFactory, redis_server: RedisServer):
    a = mount_factory("a", *_remote(redis_server))
    files = fill(a, dirs=5, per_dir=10)
    b = mount_factory("b", *_remote(redis_server))
    res = run_cli("prefetch", str(b.mountpoint), "--all")
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("prefetched 50 files") and "0 misses" in res.stdout, res.stdout
    s = b.stats()
    assert s["physical_bytes"] == sum(len(v) for v in files.values())
    redis_server.stop()  # everything is local now
    for path, data in files.items():
        assert (b.mountpoint / path).read_bytes() == data


def test_startup_set_is_recorded_merged_and_prefetched(mount_factory: MountFactory, redis_server: RedisServer):
    a = mount_factory("a", *_remote(redis_server))
    files = fill(a, dirs=4, per_dir=10)
    paths = sorted(files)
    # two nodes run workloads that read different files first: their sets merge
    b = mount_factory("b", *_remote(redis_server, "--startup-set", "serve"))
    c = mount_factory("c", *_remote(redis_server, "--startup-set", "serve"))
    for p in paths[:3]:
        assert (b.mountpoint / p).read_bytes() == files[p]
    for p in paths[2:6]:
        assert (c.mountpoint / p).read_bytes() == files[p]
    b.umount()  # each writes its record at its unmount (or once a minute while it records)
    c.umount()
    assert redis_server.cli("ZCARD", "mfs:default:startup:{serve}").stdout.strip() == "2"
    # a new node prefetches the set as it mounts, and holds exactly those files
    d = mount_factory("d", *_remote(redis_server, "--startup-set", "serve", "--prefetch"))
    s = d.stats()
    assert s["prefetch"]["state"] == "done" and s["prefetch"]["files"] == 6, s["prefetch"]
    assert s["physical_bytes"] == sum(len(files[p]) for p in paths[:6])
    redis_server.stop()
    for p in paths[:6]:
        assert (d.mountpoint / p).read_bytes() == files[p]
    with pytest.raises(OSError):  # outside the set: still lazy, and Redis is gone
        (d.mountpoint / paths[-1]).read_bytes()


def test_prefetch_respects_budget_and_a_bad_blob_is_a_miss(mount_factory: MountFactory, redis_server: RedisServer):
    a = mount_factory("a", *_remote(redis_server))
    files = fill(a, dirs=1, per_dir=12, size=100_000)
    names = sorted(files)
    redis_server.cli("SET", blob_key(files[names[0]]), "x" * 100_000)  # corrupt, same size
    redis_server.cli("DEL", blob_key(files[names[1]]))  # lost by Redis
    b = mount_factory("b", *_remote(redis_server))
    res = run_cli("prefetch", str(b.mountpoint), "--all")
    assert res.returncode == 0, res.stderr
    state = b.stats()["prefetch"]
    assert (state["files"], state["misses"]) == (10, 2), state
    assert b.stats()["remote_verify_failures"] == 1
    with pytest.raises(OSError) as e:
        (b.mountpoint / names[0]).read_bytes()
    assert e.value.errno == errno.EIO  # never the corrupt bytes
    # a node whose budget holds 6 of the 12 fetches no more than that
    c = mount_factory("c", *_remote(redis_server, "--max-size", "800K", "--low-watermark", "75%"))
    res = run_cli("prefetch", str(c.mountpoint), "--all")
    assert res.returncode == 0, res.stderr
    state = c.stats()["prefetch"]
    assert state["files"] + state["misses"] == 6 and state["skipped_for_budget"] == 6, state
    assert "left out for the budget" in res.stdout
    assert c.stats()["physical_bytes"] <= 800 * 1024 * 0.75


@pytest.mark.timeout(120)
def test_a_prefetch_cut_by_kill9_is_run_by_the_successor(mount_factory: MountFactory, redis_server: RedisServer):
    """The daemon dies with the prefetch command read and not answered: the kernel resends it to the
    successor, whose tier may not have started yet.  It must run it, not answer "the store is read-only"."""
    a = mount_factory("a", *_remote(redis_server))
    fill(a, dirs=2, per_dir=5)
    b = mount_factory("b", *_remote(redis_server), env={"MITHRILFS_TEST_CRASH_AT": "prefetch_command"})
    res = run_cli("prefetch", str(b.mountpoint), "--all", timeout=60)
    assert res.returncode == 0, res.stderr
    assert res.stdout.startswith("prefetched 10 files"), res.stdout
    stats = b.stats()
    assert stats["restarts"] == 1 and stats["last_restart_cause"] == "crash" and stats["pid"] != b.pid
    b.pid = stats["pid"]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("crash_at", ["prefetch_fetch", "command_answer_read"])
def test_a_prefetch_whose_daemon_is_killed_while_it_runs_is_finished_by_the_successor(
        mount_factory: MountFactory, redis_server: RedisServer, crash_at: str):
    """Killed after it answered the command: the successor knows of no prefetch (it is "idle"), so the
    CLI asks it again instead of reporting "prefetch failed: None".  Killed before the CLI read that
    answer (``command_answer_read``; a loaded machine's ``prefetch_fetch`` too), the successor has no
    answer to give: the CLI asks it again instead of failing with "gave no answer"."""
    a = mount_factory("a", *_remote(redis_server))
    files = fill(a, dirs=2, per_dir=5)
    b = mount_factory("b", *_remote(redis_server), env={"MITHRILFS_TEST_CRASH_AT": crash_at})
    res = run_cli("prefetch", str(b.mountpoint), "--all", timeout=60)
    assert res.returncode == 0, res.stderr
    # killed before fetching: the successor fetches all 10; killed as the answer is read, the first daemon
    # may have fetched them already (a loaded run: "prefetched 0 files"), and they are not fetched twice
    assert res.stdout.startswith("prefetched 10 files" if crash_at == "prefetch_fetch" else "prefetched "), res.stdout
    stats = b.stats()
    assert stats["restarts"] == 1 and stats["physical_bytes"] == sum(len(v) for v in files.values())
    b.pid = stats["pid"]


def test_prefetch_with_redis_down_fails_within_seconds(mount_factory: MountFactory, redis_server: RedisServer):
    b = mount_factory("b", *_remote(redis_server))
    redis_server.stop()
    t = time.monotonic()
    res = run_cli("prefetch", str(b.mountpoint), "--all", timeout=60)
    assert time.monotonic() - t < 10
    assert res.returncode == 1 and "refused" in res.stderr.lower(), res.stderr
    assert len(res.stderr.strip().splitlines()) == 1
    res = run_cli("prefetch", str(mount_factory("plain").mountpoint))
    assert res.returncode == 2 and "without --remote" in res.stderr


def test_sidecar_prefetches_before_the_app_is_let_in(mount_factory: MountFactory, redis_server: RedisServer,
                                                     tmp_path):
    import signal

    from conftest import MITHRILFS_BIN, is_mounted, running_entrypoint

    a = mount_factory("a", *_remote(redis_server))
    files = fill(a, dirs=3, per_dir=10)
    b = mount_factory("b", *_remote(redis_server))  # a node that ran the workload: its first reads
    for p in files:
        (b.mountpoint / p).read_bytes()
    b.umount()  # its record is written
    mp, store = tmp_path / "cache", tmp_path / "sidecar-store"
    env = dict(os.environ, MITHRILFS_MOUNTPOINT=str(mp), MITHRILFS_STORE=str(store), MITHRILFS_MIN_AGE="0",
               MITHRILFS_REMOTE=redis_server.url, MITHRILFS_PREFETCH="1", MITHRILFS_BIN=MITHRILFS_BIN)
    with running_entrypoint(env, mp, store) as proc:
        wait_for(lambda: is_mounted(mp) and run_cli("status", "--ready", str(mp)).returncode == 0, 60,
                 "the startup probe to pass")
        s = json.loads((mp / ".mithrilfs" / "stats.json").read_text())
        assert s["prefetch"]["state"] == "done" and s["prefetch"]["files"] == 30
        assert s["physical_bytes"] == sum(len(v) for v in files.values())  # warm before the app starts
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
