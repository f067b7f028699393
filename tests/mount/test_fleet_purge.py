"""``forget --fleet`` and the change feed: a deletion reaches every mounted node within 10 s.

A process on node B that opens a path directly (Triton and Inductor do)
never lists its directory, so before the feed it kept reading a file
deleted on node A for as long as B held the name.  Each test runs against
a real redis-server and a real SeaweedFS bucket (issue 34).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import obstore
import pytest
from conftest import MountFactory, RedisServer, SeaweedFS, run_cli, wait_for, wait_uploaded, write_committed

#: The bound the issue sets: every mounted node stops serving a purged name within it.
BOUND = 10.0

#: Opens PATH by name in a loop (never listing its directory); prints "open" once, "gone" at ENOENT.
OPEN_LOOP = """
import sys, time
path, said = sys.argv[1], False
while True:
    try:
        with open(path, "rb") as f:
            f.read()
    except FileNotFoundError:
        print("gone", flush=True)
        break
    if not said:
        print("open", flush=True)
        said = True
    time.sleep(0.02)
"""


@dataclass
class Tier:
    """The mount options and daemon environment of one shared tier."""

    kind: str
    args: tuple[str, ...]
    env: dict[str, str] | None
    redis: RedisServer | None = None
    weed: SeaweedFS | None = None
    bucket: str = ""

    def plant(self, raw: bytes, key: str = "") -> None:
        """Write a record to the feed the way anyone with write access to the store could."""
        if self.redis is not None:
            import redis

            redis.Redis.from_url(self.redis.url).xadd("mfs:default:changes", {"r": raw})
        else:
            assert self.weed is not None
            now = time.time_ns()
            name = key or f"{now // 10**12:08d}/{now:020d}-planted{time.monotonic_ns() % 100000}"
            obstore.put(self.weed.client(self.bucket), f"cache/default/changes/{name}", raw)
            # and the feed's head, as every writer rewrites it after a record: followers list only then
            obstore.put(self.weed.client(self.bucket), "cache/default/feed", name.encode())


@pytest.fixture(params=["redis", "s3"])
def tier(request: pytest.FixtureRequest) -> Iterator[Tier]:
    if request.param == "redis":
        server: RedisServer = request.getfixturevalue("redis_server")
        yield Tier("redis", ("--remote", server.url, "--min-age", "0"), None, redis=server)
    else:
        weed: SeaweedFS = request.getfixturevalue("shared_seaweedfs")
        name = "f-" + request.node.name.replace("_", "-").replace("[", "-").replace("]", "")[-40:].strip("-").lower()
        weed.create_bucket(name)
        yield Tier("s3", ("--remote", f"s3://{name}/cache", "--min-age", "0"), weed.env(), weed=weed, bucket=name)


class OpenLoop:
    """A process on a node that opens one path by name, again and again."""

    def __init__(self, path: Path) -> None:
        self.proc = subprocess.Popen([sys.executable, "-c", OPEN_LOOP, str(path)], stdout=subprocess.PIPE, text=True)
        assert self.proc.stdout is not None
        assert self.proc.stdout.readline().strip() == "open", f"{path} could not be opened"

    def gone_within(self, since: float, timeout: float = 60) -> float:
        """Seconds from *since* until the loop got ENOENT (fails past *timeout*)."""
        wait_for(lambda: self.proc.poll() is not None, timeout, "the open-by-path loop to get ENOENT")
        took = time.monotonic() - since
        assert self.proc.stdout is not None and self.proc.stdout.read().strip() == "gone"
        return took

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        self.proc.wait()


def _entry(root: Path) -> None:
    """A cache entry: a directory with files and a subdirectory."""
    (root / "kern" / "sub").mkdir(parents=True)
    write_committed(root / "kern" / "k0.so", b"poisoned kernel 0")
    write_committed(root / "kern" / "k1.json", b'{"poisoned": 1}')
    write_committed(root / "kern" / "sub" / "k2.so", b"poisoned kernel 2")
    write_committed(root / "keep.so", b"keep")


def test_forget_fleet_reaches_a_process_opening_the_path_on_every_node(mount_factory: MountFactory, tier: Tier):
    a = mount_factory("a", *tier.args, env=tier.env)
    b = mount_factory("b", *tier.args, env=tier.env)
    _entry(a.mountpoint)
    wait_uploaded(a)
    assert (b.mountpoint / "kern" / "k0.so").read_bytes() == b"poisoned kernel 0"  # B holds them
    assert (b.mountpoint / "kern" / "sub" / "k2.so").read_bytes() == b"poisoned kernel 2"
    loop_b = OpenLoop(b.mountpoint / "kern" / "k0.so")
    loop_deep = OpenLoop(b.mountpoint / "kern" / "sub" / "k2.so")
    try:
        write_committed(a.mountpoint / "kern" / "late.so", b"queued on A, not sent yet")  # A's queue holds it
        start = time.monotonic()
        res = run_cli("forget", "--fleet", str(a.mountpoint), "kern")
        assert res.returncode == 0, res.stderr
        assert "forgot 1 path(s) on every node" in res.stdout
        for loop in (loop_b, loop_deep):
            took = loop.gone_within(start)
            assert took < BOUND, f"B served the purged name {took:.1f} s after the purge"
    finally:
        loop_b.stop()
        loop_deep.stop()
    assert not (a.mountpoint / "kern").exists() and not (b.mountpoint / "kern").exists()
    wait_for(lambda: a.stats()["upload_queue"] == 0, 30, "A's queue to drain")
    assert not (a.mountpoint / "kern").exists()  # A's queued upload did not bring late.so back
    b.remount()
    assert not (b.mountpoint / "kern" / "k0.so").exists() and not (b.mountpoint / "kern").exists()
    c = mount_factory("c", *tier.args, env=tier.env)
    assert not (c.mountpoint / "kern" / "late.so").exists() and not (c.mountpoint / "kern").exists()
    assert sorted(p.name for p in c.mountpoint.iterdir()) == ["keep.so"]
    assert (c.mountpoint / "keep.so").read_bytes() == b"keep"
    assert b.stats()["remote_changes_rejected"] == 0


def test_a_node_unmounted_during_the_purge_drops_the_names_at_its_mount(mount_factory: MountFactory, tier: Tier):
    a = mount_factory("a", *tier.args, env=tier.env)
    b = mount_factory("b", *tier.args, env=tier.env)
    _entry(a.mountpoint)
    wait_uploaded(a)
    assert (b.mountpoint / "kern" / "k0.so").read_bytes() == b"poisoned kernel 0"
    b.umount()
    run_cli("forget", "--fleet", str(a.mountpoint), str(a.mountpoint / "kern"), check=True)
    b.mount()
    # its index still holds the names: the feed, read from where B left it, takes them out
    start = time.monotonic()
    wait_for(lambda: not (b.mountpoint / "kern" / "k0.so").exists(), 30, "B to drop the purged name")
    assert time.monotonic() - start < BOUND
    assert (b.mountpoint / "keep.so").read_bytes() == b"keep"


def test_a_plain_unlink_reaches_an_open_by_path_loop_on_another_node(mount_factory: MountFactory, tier: Tier):
    a = mount_factory("a", *tier.args, env=tier.env)
    b = mount_factory("b", *tier.args, env=tier.env)
    write_committed(a.mountpoint / "k.so", b"a kernel")
    write_committed(a.mountpoint / "keep.so", b"keep")
    wait_uploaded(a)
    assert (b.mountpoint / "k.so").read_bytes() == b"a kernel"
    loop = OpenLoop(b.mountpoint / "k.so")
    try:
        start = time.monotonic()
        (a.mountpoint / "k.so").unlink()
        took = loop.gone_within(start)
        assert took < BOUND, f"B served the deleted name {took:.1f} s after the unlink"
    finally:
        loop.stop()
    assert (b.mountpoint / "keep.so").read_bytes() == b"keep"


def test_hostile_feed_records_are_refused_and_counted(mount_factory: MountFactory, tier: Tier):
    b = mount_factory("b", *tier.args, env=tier.env)
    write_committed(b.mountpoint / "victim.so", b"still here")
    write_committed(b.mountpoint / "k.so", b"goes")
    wait_uploaded(b)
    version = time.time_ns() // 1000 + 10**6

    def record(x: object, **extra: object) -> bytes:
        return json.dumps({"mithrilfs_change": 1, "n": "intruder-1", "x": x, **extra}).encode()

    hostile = [
        b"{not json",
        b"[" * 100_000,  # deep, and larger than any record
        record([["../victim.so", version, 0]]),
        record([["/victim.so", version, 0]]),
        record([["a/../victim.so", version, 1]]),
        record([["victim.so", True, 0]]),
        record([["victim.so", -5, 1]]),
        record([["victim.so", version, 0]], extra_field=1),
        record([["victim.so\u0000", version, 0]]),
        record([["x" * 300, version, 0]]),
        record([]),
        json.dumps({"mithrilfs_change": 1, "n": "../../etc", "x": [["victim.so", version, 0]]}).encode(),
        record([["victim.so", version, 0]] * 300),  # more paths than a record holds
    ]
    for raw in hostile:
        tier.plant(raw)
    if tier.weed is not None:  # keys that cannot be journal records
        now = time.time_ns()
        tier.plant(record([["victim.so", version, 0]]), key=f"{now // 10**12:08d}/{now:020d}-not a record")
        ahead = now + 7200 * 10**9  # in the current bucket, dated two hours ahead
        tier.plant(record([["victim.so", version, 0]]), key=f"{now // 10**12:08d}/{ahead:020d}-from-the-future")
    # a good one after them: the follower went on (it drops the name here; with no tombstone in the tier,
    # a record alone deletes nothing for good: the name comes back at a lookup once the directory is
    # synced again, ``MISS_RESYNC_SECONDS`` after its last sync)
    tier.plant(record([["k.so", version, 0]]))
    wait_for(lambda: b.stats()["remote_changes_applied"] == 1, 30, "the good record to be applied")
    expected = len(hostile) + (2 if tier.weed is not None else 0)
    wait_for(lambda: b.stats()["remote_changes_rejected"] >= expected, 10, "every hostile record to be counted")
    assert (b.mountpoint / "victim.so").read_bytes() == b"still here"
    wait_for(lambda: (b.mountpoint / "k.so").exists(), 30, "the name to come back from the tier")
    assert (b.mountpoint / "k.so").read_bytes() == b"goes"
    res = run_cli("status", str(b.mountpoint))
    assert res.returncode == 0, res.stderr


def test_forget_errors_are_one_line(mount_factory: MountFactory, redis_server: RedisServer, tmp_path: Path):
    local = mount_factory("local")
    shared = mount_factory("shared", "--remote", redis_server.url)
    cases = [
        (("forget", "--fleet", str(local.mountpoint), "x"), "mounted without --remote"),
        (("forget", "--fleet", str(shared.mountpoint), str(tmp_path / "elsewhere")), "is outside the mount"),
        (("forget", "--fleet", str(shared.mountpoint), "a/../../b"), "is outside the mount"),
        (("forget", "--fleet", str(shared.mountpoint), "."), "is the mount itself"),
        (("forget", "--fleet", str(shared.mountpoint), ".mithrilfs/stats.json"), "control directory"),
        (("forget", str(shared.mountpoint), "x"), "say --fleet"),
        (("forget", "--fleet", str(tmp_path), "x"), "not a mithrilfs mount"),
    ]
    for args, message in cases:
        res = run_cli(*args)
        assert res.returncode != 0, args
        assert message in res.stderr and len(res.stderr.strip().splitlines()) == 1, (args, res.stderr)
        assert "Traceback" not in res.stderr
    redis_server.stop()
    res = run_cli("forget", "--fleet", str(shared.mountpoint), "x")
    assert res.returncode == 1 and "nothing was forgotten" in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1


def test_the_daemon_refuses_to_forget_its_control_directory(mount_factory: MountFactory, redis_server: RedisServer):
    """The CLI refuses it; a request written to the control file directly is refused the same way, and no
    tombstone for ``.mithrilfs`` reaches the tier."""
    import redis

    m = mount_factory("m", "--remote", redis_server.url, "--min-age", "0")
    for paths in ([".mithrilfs"], [".mithrilfs/stats.json"], ["kern", ".mithrilfs"]):
        fd = os.open(m.mountpoint / ".mithrilfs" / "forget", os.O_RDWR)
        try:
            os.write(fd, json.dumps(paths).encode())
            answer = json.loads(os.pread(fd, 1 << 16, 0))
        finally:
            os.close(fd)
        assert "control directory" in answer.get("error", ""), (paths, answer)
    assert redis.Redis.from_url(redis_server.url).hgetall("mfs:default:d:") == {}
    assert m.stats()["remote_tombstones"] == 0


def test_an_upload_queued_before_the_purge_never_brings_the_name_back(mount_factory: MountFactory,
                                                                       redis_server: RedisServer):
    """B's write is queued while B cannot reach Redis (its ACL user is refused every command); A purges the
    entry; when B's queue drains, its older version loses to the tombstone and goes from B too."""
    redis_server.cli("ACL", "SETUSER", "nodeb", "on", ">secret-b", "~*", "+@all")
    remote_b = redis_server.url.replace("redis://", "redis://nodeb:secret-b@")
    a = mount_factory("a", "--remote", redis_server.url, "--min-age", "0")
    b = mount_factory("b", "--remote", remote_b, "--min-age", "0")
    _entry(a.mountpoint)
    wait_uploaded(a)
    assert (b.mountpoint / "kern" / "k0.so").read_bytes() == b"poisoned kernel 0"
    redis_server.cli("ACL", "SETUSER", "nodeb", "-@all")  # B's connections stay, each command is refused
    write_committed(b.mountpoint / "kern" / "from-b.so", b"written on B before the purge")
    wait_for(lambda: b.stats()["remote_errors"] > 0, 20, "B's uploads to fail")
    assert b.stats()["upload_queue"] > 0
    run_cli("forget", "--fleet", str(a.mountpoint), "kern", check=True)
    redis_server.cli("ACL", "SETUSER", "nodeb", "+@all")
    wait_for(lambda: b.stats()["upload_queue"] == 0, 60, "B's queue to drain")
    wait_for(lambda: not (b.mountpoint / "kern" / "from-b.so").exists(), 30, "B to drop its own older write")
    raw = redis_server.cli("HGET", "mfs:default:d:kern", "from-b.so").stdout.strip()
    assert json.loads(raw)["t"] == "x", raw  # the tombstone won in the tier
    c = mount_factory("c", "--remote", redis_server.url, "--min-age", "0")
    assert not (c.mountpoint / "kern").exists() and not (c.mountpoint / "kern" / "from-b.so").exists()


def test_forget_fleet_with_redis_in_front_of_a_bucket(mount_factory: MountFactory, redis_server: RedisServer,
                                                      shared_seaweedfs: SeaweedFS):
    """Redis in front of a bucket: the record goes to both, nodes follow Redis; a node on the bucket alone
    (sharing its names) reads the journal."""
    shared_seaweedfs.create_bucket("layered-forget")
    env = shared_seaweedfs.env()
    both = ("--remote", redis_server.url, "--remote", "s3://layered-forget/cache", "--min-age", "0")
    a = mount_factory("a", *both, env=env)
    b = mount_factory("b", *both, env=env)
    s3_only = mount_factory("s", "--remote", "s3://layered-forget/cache", "--min-age", "0", env=env)
    _entry(a.mountpoint)
    wait_uploaded(a)
    loops = []
    for m in (b, s3_only):
        assert (m.mountpoint / "kern" / "k0.so").read_bytes() == b"poisoned kernel 0"
        loops.append(OpenLoop(m.mountpoint / "kern" / "k0.so"))
    try:
        start = time.monotonic()
        run_cli("forget", "--fleet", str(a.mountpoint), "kern", check=True)
        for loop in loops:
            assert loop.gone_within(start) < BOUND
    finally:
        for loop in loops:
            loop.stop()
    c = mount_factory("c", *both, env=env)
    assert not (c.mountpoint / "kern").exists()


def test_a_node_whose_records_were_trimmed_away_reconciles_everything_it_holds(mount_factory: MountFactory,
                                                                                redis_server: RedisServer):
    """B was away while the purge's record was trimmed from the stream (MAXLEN): at its mount it cannot
    know what it missed, so it reconciles every directory it holds with the tier."""
    a = mount_factory("a", "--remote", redis_server.url, "--min-age", "0")
    b = mount_factory("b", "--remote", redis_server.url, "--min-age", "0")
    _entry(a.mountpoint)
    wait_uploaded(a)
    assert (b.mountpoint / "kern" / "sub" / "k2.so").read_bytes() == b"poisoned kernel 2"
    b.umount()
    run_cli("forget", "--fleet", str(a.mountpoint), "kern", check=True)
    redis_server.cli("XTRIM", "mfs:default:changes", "MAXLEN", "0")
    b.mount()
    start = time.monotonic()
    wait_for(lambda: not (b.mountpoint / "kern" / "sub" / "k2.so").exists(), 30, "B to drop the purged names")
    assert time.monotonic() - start < BOUND
    assert b.stats()["remote_feed_resyncs"] == 1
    assert (b.mountpoint / "keep.so").read_bytes() == b"keep"


def test_a_new_node_never_gets_a_purged_name_back_from_a_startup_set_recorded_before(
        mount_factory: MountFactory, tier: Tier):
    """B's load recorded the entry's files in the startup set; the entry is purged, and the feed's record of
    it is gone (trimmed; a bucket's journal keeps days); a new node D, which never read the feed, creates
    the set's names without listing their directories: the purge holds there too, from the record the tier
    keeps beside the sets (D brought the poisoned kernel back before). A planted record is refused."""
    a = mount_factory("a", *tier.args, env=tier.env)
    _entry(a.mountpoint)
    wait_uploaded(a)
    b = mount_factory("b", *tier.args, env=tier.env)
    assert (b.mountpoint / "kern" / "sub" / "k2.so").read_bytes() == b"poisoned kernel 2"
    assert (b.mountpoint / "keep.so").read_bytes() == b"keep"
    b.umount()  # writes its record: kern, kern/sub, kern/sub/k2.so, keep.so
    run_cli("forget", "--fleet", str(a.mountpoint), "kern", check=True)
    if tier.redis is not None:
        tier.redis.cli("XTRIM", "mfs:default:changes", "MAXLEN", "0")
        tier.redis.cli("ZADD", "mfs:default:purges", "1", '{"not": "a record"}')
    else:
        assert tier.weed is not None
        client = tier.weed.client(tier.bucket)
        for batch in obstore.list(client, prefix="cache/default/changes/"):
            for meta in batch:
                obstore.delete(client, meta["path"])
        obstore.put(client, f"cache/default/purges/{(1 << 53) - 1:020d}-planted", b'{"not": "a record"}')
    d = mount_factory("d", *tier.args, env=tier.env)
    wait_for(lambda: d.stats()["prefetch"]["state"] == "done", 30, "the background prefetch")
    s = d.stats()
    assert s["prefetch"]["files"] == 1, s["prefetch"]  # keep.so, from the set
    assert s["startup_set_paths"] == 1, s
    assert s["remote_changes_rejected"] == 1, s
    assert not (d.mountpoint / "kern" / "sub" / "k2.so").exists()
    assert not (d.mountpoint / "kern").exists()
    assert (d.mountpoint / "keep.so").read_bytes() == b"keep"


def test_a_set_entry_older_than_the_purges_a_node_read_is_listed_not_trusted(mount_factory: MountFactory,
                                                                              tier: Tier):
    """A node reads only the newest purge records (``PURGES_READ``, here 1 of 2): an entry of the set older
    than the newest record it left unread might be covered by it, so its directory is listed instead (the
    tombstone there wins), and what the listing still holds is prefetched."""
    a = mount_factory("a", *tier.args, env=tier.env)
    _entry(a.mountpoint)
    (a.mountpoint / "other").mkdir()
    write_committed(a.mountpoint / "other" / "o.so", b"other")
    wait_uploaded(a)
    b = mount_factory("b", *tier.args, env=tier.env)
    for p in ("kern/sub/k2.so", "keep.so"):
        (b.mountpoint / p).read_bytes()
    b.umount()
    run_cli("forget", "--fleet", str(a.mountpoint), "kern", check=True)  # older: left unread by D
    run_cli("forget", "--fleet", str(a.mountpoint), "other", check=True)
    d = mount_factory("d", *tier.args, env=dict(tier.env or {}, MITHRILFS_PURGES_READ="1"))
    wait_for(lambda: d.stats()["prefetch"]["state"] == "done", 30, "the background prefetch")
    s = d.stats()
    assert s["startup_set_paths"] == 0, s  # nothing taken from the set as it is
    assert s["prefetch"]["files"] == 1, s["prefetch"]  # keep.so, its directory listed
    assert not (d.mountpoint / "kern").exists()
    assert (d.mountpoint / "keep.so").read_bytes() == b"keep"
