"""An idle node asks its tier rarely and cheaply, and still never serves what the fleet deleted.

Nobody using a mount for ``MITHRILFS_IDLE_AFTER`` seconds makes it idle
(``sync.pulse``): it checks the feed every ``MITHRILFS_IDLE_PERIOD``
seconds, on a bucket with one conditional GET of the feed's head (no LIST
while nothing was announced), on Redis with one ``XREAD BLOCK`` that waits
in the server.  The first lookup after an idle spell waits for a check.
Each test counts the requests at a delay proxy in front of a real
SeaweedFS or a real redis-server.
"""

from __future__ import annotations

import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import MountFactory, RedisServer, SeaweedFS, free_port, run_cli, wait_for, wait_uploaded, write_committed

from mithrilfs.testing.delay_proxy import DelayProxy

pytestmark = pytest.mark.timeout(240)


def request_kind(method: str, target: str) -> str:
    """The proxy's label: "LIST" for a listing, else the method and the key's last component."""
    path, _, query = target.partition("?")
    if method == "LIST" or (method == "GET" and "list-type" in query):
        return "LIST"
    return f"{method} {path.rstrip('/').rsplit('/', 1)[-1]}"


@pytest.fixture
def bucket(shared_seaweedfs: SeaweedFS, request: pytest.FixtureRequest) -> str:
    name = "i-" + request.node.name.replace("_", "-")[-40:].strip("-").lower()
    shared_seaweedfs.create_bucket(name)
    return name


@pytest.fixture
def s3_proxy(shared_seaweedfs: SeaweedFS) -> Iterator[Any]:
    with DelayProxy("127.0.0.1", shared_seaweedfs.ports["s3"], protocol="http", label=request_kind) as p:
        yield p


def _s3(shared_seaweedfs: SeaweedFS, bucket: str, proxy: Any | None = None, **env: str
        ) -> tuple[tuple[str, ...], dict[str, str]]:
    base = shared_seaweedfs.env()
    if proxy is not None:
        base |= {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{proxy.port}"}
    return ("--remote", f"s3://{bucket}/cache", "--min-age", "0"), base | env


def _entry(root: Path) -> None:
    (root / "kern").mkdir()
    for i in range(2):
        write_committed(root / "kern" / f"k{i}.so", b"kernel %d" % i)


def test_an_idle_node_on_a_bucket_sends_conditional_gets_only_and_a_changed_head_wakes_it(
        mount_factory: MountFactory, shared_seaweedfs: SeaweedFS, bucket: str, s3_proxy: Any):
    args, env = _s3(shared_seaweedfs, bucket)
    a = mount_factory("a", *args, env=env)
    _entry(a.mountpoint)
    wait_uploaded(a)
    b_args, b_env = _s3(shared_seaweedfs, bucket, s3_proxy, MITHRILFS_IDLE_AFTER="1", MITHRILFS_IDLE_PERIOD="0.5")
    port = free_port()
    b = mount_factory("b", *b_args, "--metrics-port", str(port), env=b_env)
    assert (b.mountpoint / "kern" / "k0.so").read_bytes() == b"kernel 0"  # B holds the directory
    wait_for(lambda: b.stats()["remote_idle"] == 1, 30, "B to be idle")
    checks = b.stats()["remote_feed_checks"]
    wait_for(lambda: b.stats()["remote_feed_checks"] >= checks + 3, 30, "B to check the feed, idle")
    s3_proxy.reset()
    checks = b.stats()["remote_feed_checks"]
    wait_for(lambda: b.stats()["remote_feed_checks"] >= checks + 6, 30, "B to check the feed six more times")
    asked = s3_proxy.labels()
    assert set(asked) == {"GET feed"}, asked  # no LIST, no epoch, no summary: one conditional GET a check
    assert asked["GET feed"] <= b.stats()["remote_feed_checks"] - checks + 1, asked
    # a name deleted on A: its announcement changes the head, and the next check lists and applies it
    (a.mountpoint / "kern" / "k1.so").unlink()
    wait_for(lambda: b.stats()["remote_changes_applied"] >= 1, 30, "B to learn of the deletion")
    assert s3_proxy.labels().get("LIST", 0) >= 1
    stats = b.stats()
    assert stats["remote_idle_seconds"] > 0 and stats["remote_idle_requests"] > 0

    def per_hour() -> str:
        metrics = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode()
        return next((line for line in metrics.splitlines() if line.startswith("mithrilfs_remote_idle_requests_per_hour ")), "")

    # once 10 s of idleness are counted: the rate, in stats and the metrics
    wait_for(lambda: b.stats()["remote_idle_requests_per_hour"] is not None and per_hour(), 120, "an hourly rate")
    assert float(per_hour().split()[1]) > 0


def test_the_first_lookup_after_an_idle_spell_waits_for_the_fleets_news(
        mount_factory: MountFactory, shared_seaweedfs: SeaweedFS, bucket: str):
    """B's follower sleeps for an hour while idle; a purge on A reaches B's next lookup all the same."""
    args, env = _s3(shared_seaweedfs, bucket)
    a = mount_factory("a", *args, env=env)
    _entry(a.mountpoint)
    wait_uploaded(a)
    b = mount_factory("b", *args, env=env | {"MITHRILFS_IDLE_AFTER": "1", "MITHRILFS_IDLE_PERIOD": "3600"})
    # k0 read: the directory's names are in B's index, k1's too, but the kernel never looked k1 up
    assert (b.mountpoint / "kern" / "k0.so").read_bytes() == b"kernel 0"
    wait_for(lambda: b.stats()["remote_idle"] == 1, 30, "B to be idle")
    checks = b.stats()["remote_feed_checks"]
    # one check made while idle: after it, the follower sleeps its idle period
    wait_for(lambda: b.stats()["remote_feed_checks"] > checks, 30, "B to check the feed once idle")
    checks = b.stats()["remote_feed_checks"]
    run_cli("forget", "--fleet", str(a.mountpoint), "kern/k1.so", check=True)
    assert b.stats()["remote_feed_checks"] == checks  # B's follower sleeps: nothing told it yet
    assert not (b.mountpoint / "kern" / "k1.so").exists()
    assert b.stats()["remote_changes_applied"] >= 1
    assert b.stats()["remote_idle"] == 0


@pytest.fixture
def redis_proxy(redis_server: RedisServer) -> Iterator[Any]:
    with DelayProxy("127.0.0.1", redis_server.port, protocol="redis") as p:
        yield p


def test_an_idle_node_on_redis_waits_in_the_server_and_hears_a_deletion_at_once(
        mount_factory: MountFactory, redis_server: RedisServer, redis_proxy: Any):
    a = mount_factory("a", "--remote", redis_server.url, "--min-age", "0")
    _entry(a.mountpoint)
    wait_uploaded(a)
    b = mount_factory("b", "--remote", f"redis://127.0.0.1:{redis_proxy.port}/0", "--min-age", "0",
                      env={"MITHRILFS_IDLE_AFTER": "1", "MITHRILFS_IDLE_PERIOD": "1"})
    assert (b.mountpoint / "kern" / "k0.so").read_bytes() == b"kernel 0"
    wait_for(lambda: b.stats()["remote_idle"] == 1, 30, "B to be idle")
    checks = b.stats()["remote_feed_checks"]
    wait_for(lambda: b.stats()["remote_feed_checks"] >= checks + 2, 30, "B to wait in the server twice")
    redis_proxy.reset()
    checks = b.stats()["remote_feed_checks"]
    wait_for(lambda: b.stats()["remote_feed_checks"] >= checks + 4, 30, "B to wait in the server four more times")
    commands = {k: v for k, v in redis_proxy.counts().items() if k.isupper()}
    assert set(commands) == {"XREAD"}, commands  # nothing but the waits
    assert commands["XREAD"] <= b.stats()["remote_feed_checks"] - checks + 1, commands


def test_a_deletion_reaches_a_node_waiting_in_redis_without_a_poll(
        mount_factory: MountFactory, redis_server: RedisServer):
    a = mount_factory("a", "--remote", redis_server.url, "--min-age", "0")
    _entry(a.mountpoint)
    wait_uploaded(a)
    b = mount_factory("b", "--remote", redis_server.url, "--min-age", "0",
                      env={"MITHRILFS_IDLE_AFTER": "1", "MITHRILFS_IDLE_PERIOD": "3600"})
    assert (b.mountpoint / "kern" / "k0.so").read_bytes() == b"kernel 0"
    wait_for(lambda: b.stats()["remote_idle"] == 1, 30, "B to be idle")
    checks = b.stats()["remote_feed_checks"]
    (a.mountpoint / "kern" / "k0.so").unlink()
    # B waits in the server for 100 s at a time: only the record's arrival answers its wait so soon
    wait_for(lambda: b.stats()["remote_changes_applied"] >= 1, 30, "B to hear of the deletion")
    assert b.stats()["remote_feed_checks"] <= checks + 2  # the wait it was in, answered; the next one begun
