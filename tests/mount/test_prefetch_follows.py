"""The background prefetch follows its reader, against a real redis-server behind a slow proxy: a read of a
file whose blob the prefetch has queued starts that batch and waits for it instead of fetching on its own,
and a blob that batch finds bad answers the read that waited for it at once."""

from __future__ import annotations

import errno

import pytest
from conftest import MountFactory, RedisServer, wait_for
from test_shared_tier import _remote, blob_key
from test_startup_sets import recorded_load

from mithrilfs.testing.delay_proxy import DelayProxy

#: Each exchange with Redis costs this long: the prefetch's fifteen batches take seconds, four at a time.
RTT_MS = 800


def queued_all(b, files: dict[str, bytes]) -> None:
    """Wait until the background prefetch has every file of the set queued (its names are all here)."""
    wait_for(lambda: b.stats()["prefetch"].get("total_files") == len(files), 60, "the set's names")


@pytest.mark.timeout(300)
def test_a_read_of_what_the_prefetch_has_queued_starts_its_batch_rather_than_fetch_alone(
        mount_factory: MountFactory, redis_server: RedisServer):
    """A new node's workload reads the set backwards while the background prefetch brings it forwards: every
    read it overtakes starts the batch holding its file (``hurried``) and waits for it; no read fetches a blob
    of its own, each blob comes once, every byte is right."""
    a = mount_factory("a", *_remote(redis_server))
    files = recorded_load(a, dirs=6, per_dir=40, size=200)
    with DelayProxy("127.0.0.1", redis_server.port, rtt_ms=RTT_MS, protocol="redis", connect_rtts=0) as proxy:
        b = mount_factory("b", "--remote", f"redis://127.0.0.1:{proxy.port}/0", "--min-age", "0")
        queued_all(b, files)
        for p in sorted(files, reverse=True):  # the last of the set first: queued, nobody bringing it yet
            assert (b.mountpoint / p).read_bytes() == files[p]
        wait_for(lambda: b.stats()["prefetch"]["state"] == "done", 60, "the background prefetch")
        s = b.stats()
    assert s.get("remote_read_fetches", 0) == 0, s  # no read paid a round trip of its own
    assert s["prefetch"]["hurried"] >= 1, s["prefetch"]
    assert s["prefetch"]["files"] == len(files) and s["prefetch"]["misses"] == 0, s["prefetch"]
    assert s["remote_fetch_joined"] >= 1, s
    assert s["remote_fetched_bytes"] == sum(len(v) for v in files.values()), s  # none fetched twice


@pytest.mark.timeout(300)
def test_a_bad_blob_in_a_batch_a_read_started_fails_that_read_without_asking_again(
        mount_factory: MountFactory, redis_server: RedisServer):
    """The last file of the set is corrupt in Redis (its size kept): its read, while the prefetch has it
    queued, starts its batch, waits, and fails with EIO on that batch's answer; the blob is asked for (and
    found bad) once, not a second time by the read."""
    a = mount_factory("a", *_remote(redis_server))
    files = recorded_load(a, dirs=6, per_dir=40, size=200)
    bad = sorted(files)[-1]
    redis_server.cli("SET", blob_key(files[bad]), "x" * len(files[bad]))
    with DelayProxy("127.0.0.1", redis_server.port, rtt_ms=RTT_MS, protocol="redis", connect_rtts=0) as proxy:
        b = mount_factory("b", "--remote", f"redis://127.0.0.1:{proxy.port}/0", "--min-age", "0")
        queued_all(b, files)
        with pytest.raises(OSError) as e:
            (b.mountpoint / bad).read_bytes()
        assert e.value.errno == errno.EIO  # never the corrupt bytes
        wait_for(lambda: b.stats()["prefetch"]["state"] == "done", 60, "the background prefetch")
        s = b.stats()
        for p in sorted(files)[:-1]:
            assert (b.mountpoint / p).read_bytes() == files[p]
    assert s["prefetch"]["hurried"] >= 1 and s["prefetch"]["misses"] == 1, s["prefetch"]
    assert s["remote_verify_failures"] == 1, s  # the batch's answer, not the read's own second request
    assert s.get("remote_read_fetches", 0) == 0, s
