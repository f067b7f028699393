"""A shared tier you can trust: hostile entries, lost and stale data, permissions and secrets.

Each test reproduces one finding of an adversarial run against two nodes and a
real redis-server (issue 10) and fails without its fix.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import stat
import subprocess
import time
from pathlib import Path

import pytest
from conftest import (
    MountFactory,
    RedisServer,
    as_user,
    run_cli,
    traversable,
    wait_for,
    wait_unmounted,
    wait_uploaded,
    write_committed,
)
from test_shared_tier import _remote, blob_key, entry

ROOT_DIR = "mfs:default:d:"


def hget(redis_server: RedisServer, key: str, field: str) -> dict | None:
    out = redis_server.cli("--no-raw", "HGET", key, field).stdout.strip()
    raw = redis_server.cli("HGET", key, field).stdout.rstrip("\n")
    return json.loads(raw) if raw and out != "(nil)" else None


def listing_becomes(d: Path, expected: list[str], timeout: float = 20) -> None:
    """List *d* until it shows *expected*: a known directory re-syncs in the background, every few seconds."""
    wait_for(lambda: sorted(os.listdir(d)) == expected, timeout, f"{d} to list {expected}")


def daemon_rss_mib(pid: int) -> float:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmRSS")


# ----------------------------------------------------------------------
# wrong bytes, crashes and poison
# ----------------------------------------------------------------------
def test_entry_size_must_match_the_blob(mount_factory: MountFactory, redis_server: RedisServer):
    a = mount_factory("a", *_remote(redis_server))
    data = b"eighteen bytes!!!!"
    write_committed(a.mountpoint / "real.so", data)
    wait_uploaded(a)
    # entries pointing at the right blob with a wrong size: never served, never a short file
    redis_server.cli("HSET", ROOT_DIR, "short.so", entry(data, s=3), "long.so", entry(data, s=100))
    b = mount_factory("b", *_remote(redis_server))
    for name in ("short.so", "long.so"):
        with pytest.raises(OSError) as e:
            (b.mountpoint / name).read_bytes()
        # a failed fetch (EIO), or the name already gone: the read-ahead brought the content with its
        # real size, and names claiming another size for it were removed (ENOENT)
        assert e.value.errno in (errno.EIO, errno.ENOENT), name
    assert (b.mountpoint / "real.so").read_bytes() == data
    s = b.stats()
    assert s["remote_verify_failures"] + s["remote_rejected"] >= 1  # a lie is counted, whichever way it was met


def test_a_name_lying_about_a_size_never_makes_the_true_name_miss(mount_factory: MountFactory,
                                                                  redis_server: RedisServer):
    """A planted name in another directory claims 3 bytes for real.so's content; its lookup starts that
    directory's read-ahead, which finds no such blob. That miss is of that size: real.so, read after, gets
    its 18 bytes (the miss was kept by content alone, and real.so failed with EIO)."""
    a = mount_factory("a", *_remote(redis_server))
    data = b"eighteen bytes!!!!"
    write_committed(a.mountpoint / "real.so", data)
    (a.mountpoint / "d1").mkdir()
    write_committed(a.mountpoint / "d1" / "other.so", b"other")
    wait_uploaded(a)
    redis_server.cli("HSET", ROOT_DIR + "d1", "z.so", entry(data, s=3))
    b = mount_factory("b", *_remote(redis_server))
    assert (b.mountpoint / "d1" / "z.so").stat().st_size == 3  # looked up, not read: the read-ahead tries it
    wait_for(lambda: b.stats().get("remote_read_ahead", 0) >= 2, 30, "the read-ahead of d1")
    assert (b.mountpoint / "real.so").read_bytes() == data
    assert (b.mountpoint / "d1" / "other.so").read_bytes() == b"other"


def test_huge_claimed_size_streams_and_is_a_miss(mount_factory: MountFactory, redis_server: RedisServer):
    a = mount_factory("a", *_remote(redis_server))
    data = b"small"
    write_committed(a.mountpoint / "real", data)
    wait_uploaded(a)
    redis_server.cli("HSET", ROOT_DIR, "huge", entry(data, s=10**15), "absurd", entry(data, s=10**18))
    b = mount_factory("b", *_remote(redis_server), "--max-size", "20T")
    t = time.monotonic()
    fd = os.open(b.mountpoint / "huge", os.O_RDONLY)
    try:
        with pytest.raises(OSError) as e:
            os.read(fd, 4096)
    finally:
        os.close(fd)
    assert e.value.errno == errno.EIO
    assert time.monotonic() - t < 10
    assert not (b.mountpoint / "absurd").exists()  # past any real size: not an entry at all
    assert daemon_rss_mib(b.pid) < 300  # nothing was allocated by the claimed size
    assert (b.mountpoint / "real").read_bytes() == data


HOSTILE = {
    "nested": "[" * 4000 + "]" * 4000,  # deeper than Python's parser recursion, under the size limit
    "huge-value": json.dumps({"t": "d", "v": 1, "n": "x", "m": 493, "mt": 1, "tg": "x" * 100_000}),
    "big-size": json.dumps({"t": "f", "v": 1, "n": "x", "h": "ab" * 32, "s": 2**64, "m": 420, "mt": 1}),
    "big-mtime": json.dumps({"t": "f", "v": 1, "n": "x", "h": "ab" * 32, "s": 1, "m": 420, "mt": 2**64}),
    "negative": json.dumps({"t": "f", "v": 1, "n": "x", "h": "ab" * 32, "s": -1, "m": 420, "mt": 1}),
    "bool-size": json.dumps({"t": "f", "v": 1, "n": "x", "h": "ab" * 32, "s": True, "m": 420, "mt": 1}),
    "text-mode": json.dumps({"t": "f", "v": 1, "n": "x", "h": "ab" * 32, "s": 1, "m": "rwx", "mt": 1}),
    "bad-type": json.dumps({"t": "c", "v": 1, "n": "x", "m": 420, "mt": 1}),
    "unknown-key": json.dumps({"t": "d", "v": 1, "n": "x", "m": 493, "mt": 1, "evil": 1}),
    "no-version": json.dumps({"t": "d", "n": "x", "m": 493, "mt": 1}),
    "bad-hash": json.dumps({"t": "f", "v": 1, "n": "x", "h": "zz" * 32, "s": 1, "m": 420, "mt": 1}),
    "a/b": json.dumps({"t": "d", "v": 1, "n": "x", "m": 493, "mt": 1}),
    "..": json.dumps({"t": "d", "v": 1, "n": "x", "m": 493, "mt": 1}),
    "not-json": "{{{",
    "list": "[1, 2]",
    "link-nul": json.dumps({"t": "l", "v": 1, "n": "x", "m": 511, "mt": 1, "tg": "a\u0000b"}),
}


def test_hostile_entries_are_ignored_counted_and_never_stored(mount_factory: MountFactory,
                                                              redis_server: RedisServer):
    a = mount_factory("a", *_remote(redis_server))
    write_committed(a.mountpoint / "good.so", b"good")
    wait_uploaded(a)
    for name, value in HOSTILE.items():
        redis_server.cli("HSET", ROOT_DIR, name, value)
    b = mount_factory("b", *_remote(redis_server))
    # the directory stays listable: only the good entry appears (asked again if Redis did not answer)
    listing_becomes(b.mountpoint, ["good.so"], timeout=10)
    for name in HOSTILE:
        if "/" not in name and name != "..":
            assert not (b.mountpoint / name).exists(), name
    assert b.stats()["remote_rejected"] >= len(HOSTILE)
    assert (b.mountpoint / "good.so").read_bytes() == b"good"
    # nothing of them reached the index: gone from Redis, the store is clean and lists after a remount
    redis_server.cli("DEL", ROOT_DIR)
    b.remount()
    assert os.listdir(b.mountpoint) == ["good.so"]
    b.umount()
    res = run_cli("fsck", "--store", str(b.store))
    assert res.returncode == 0, res.stdout + res.stderr


# ----------------------------------------------------------------------
# lost or stale data
# ----------------------------------------------------------------------
def test_redis_restarted_empty_gets_everything_again(mount_factory: MountFactory, redis_server: RedisServer):
    a = mount_factory("a", *_remote(redis_server))
    (a.mountpoint / "k").mkdir()
    for i in range(40):
        write_committed(a.mountpoint / "k" / f"f{i}", f"kernel {i}".encode() * 50)
    wait_uploaded(a)
    redis_server.stop()
    redis_server.start()  # same port, no data
    wait_for(lambda: redis_server.cli("HLEN", "mfs:default:d:k").stdout.strip() == "40", 30,
             "the node to notice the empty Redis and upload again")
    assert a.stats()["remote_data_lost"] >= 1
    b = mount_factory("b", *_remote(redis_server))
    wait_uploaded(a)
    assert all((b.mountpoint / "k" / f"f{i}").read_bytes() == f"kernel {i}".encode() * 50 for i in range(40))


def test_upload_queue_survives_unmount_and_crash(mount_factory: MountFactory, redis_server: RedisServer):
    a = mount_factory("a", *_remote(redis_server))
    write_committed(a.mountpoint / "first", b"first")
    wait_uploaded(a)
    redis_server.stop()
    for i in range(30):
        write_committed(a.mountpoint / f"queued{i}", f"queued {i}".encode())
    wait_for(lambda: a.stats()["upload_queue"] >= 30, 10, "the queue to fill")
    res = run_cli("umount", str(a.mountpoint))
    assert res.returncode == 0
    assert "30 changes not yet in the shared tier" in res.stderr, res.stderr
    # a crash keeps the queue too
    a.mount()
    write_committed(a.mountpoint / "queued30", b"queued 30")
    wait_for(lambda: a.stats()["upload_queue"] >= 31, 10, "the queue to hold the new file")
    os.kill(a.pid, 9)
    subprocess.run(["fusermount3", "-u", "-z", str(a.mountpoint)], capture_output=True)
    wait_unmounted(a.mountpoint, timeout=30)  # the supervisor, last to hold the store's lock, is gone too
    redis_server.start()
    a.mount()
    wait_for(lambda: redis_server.cli("HLEN", ROOT_DIR).stdout.strip() == "32", 30, "the queued uploads")


def test_push_with_redis_down_fails_within_seconds(mount_factory: MountFactory, redis_server: RedisServer):
    a = mount_factory("a", *_remote(redis_server))
    write_committed(a.mountpoint / "f", b"x")
    wait_uploaded(a)
    redis_server.stop()
    t = time.monotonic()
    res = run_cli("push", str(a.mountpoint), timeout=60)
    assert time.monotonic() - t < 10
    assert res.returncode == 1
    assert "refused" in res.stderr.lower() and len(res.stderr.strip().splitlines()) == 1, res.stderr


def test_a_first_listing_redis_missed_is_asked_again(mount_factory: MountFactory, redis_server: RedisServer):
    a = mount_factory("a", *_remote(redis_server))
    write_committed(a.mountpoint / "good.so", b"good")
    wait_uploaded(a)
    b = mount_factory("b", *_remote(redis_server))
    redis_server.proc.send_signal(signal.SIGSTOP)  # a stall: the first listing times out
    try:
        assert os.listdir(b.mountpoint) == []
    finally:
        redis_server.proc.send_signal(signal.SIGCONT)
    assert run_cli("push", str(b.mountpoint)).returncode == 0  # Redis answers again: the back-off is over
    # the directory was never synced: this listing waits for its names (it used to show nothing for 5 s)
    assert os.listdir(b.mountpoint) == ["good.so"]


def test_blob_missing_one_chunk_is_uploaded_again(mount_factory: MountFactory, redis_server: RedisServer):
    env = {"MITHRILFS_REMOTE_CHUNK_BYTES": "1024"}
    a = mount_factory("a", *_remote(redis_server), env=env)
    data = os.urandom(5000)  # five chunks
    write_committed(a.mountpoint / "big.so", data)
    wait_uploaded(a)
    assert all(redis_server.cli("EXISTS", blob_key(data, i)).stdout.strip() == "1" for i in range(5))
    redis_server.cli("DEL", blob_key(data, 2))  # Redis evicted one chunk
    write_committed(a.mountpoint / "again.so", data)  # the same content published again
    wait_for(lambda: redis_server.cli("EXISTS", blob_key(data, 2)).stdout.strip() == "1", 20, "the chunk to return")
    b = mount_factory("b", *_remote(redis_server), env=env)
    assert (b.mountpoint / "big.so").read_bytes() == data


def test_deletes_reach_other_nodes_and_do_not_come_back(mount_factory: MountFactory, redis_server: RedisServer):
    a = mount_factory("a", *_remote(redis_server))
    b = mount_factory("b", *_remote(redis_server))
    (a.mountpoint / "bad").mkdir()
    for i in range(3):
        write_committed(a.mountpoint / "bad" / f"k{i}.so", b"broken kernel %d" % i)
    write_committed(a.mountpoint / "keep.so", b"keep")
    wait_uploaded(a)
    assert (b.mountpoint / "bad" / "k0.so").read_bytes() == b"broken kernel 0"  # B has them too
    assert sorted(os.listdir(b.mountpoint / "bad")) == ["k0.so", "k1.so", "k2.so"]
    subprocess.run(["rm", "-rf", str(a.mountpoint / "bad")], check=True)
    wait_uploaded(a)
    assert hget(redis_server, ROOT_DIR, "bad")["t"] == "x"
    time.sleep(5.5)  # past the directory re-sync interval: the old code brought it back here
    for _ in range(3):
        assert sorted(os.listdir(a.mountpoint)) == ["keep.so"]
        time.sleep(0.5)
    assert not (a.mountpoint / "bad").exists()
    # B drops its copies when it next looks at the tree, and a new node never sees them
    listing_becomes(b.mountpoint, ["keep.so"])
    assert not (b.mountpoint / "bad" / "k0.so").exists()
    c = mount_factory("c", *_remote(redis_server))
    assert not (c.mountpoint / "bad").exists() and sorted(os.listdir(c.mountpoint)) == ["keep.so"]
    # an eviction is local: no tombstone, other nodes keep the file
    run_cli("gc", str(a.mountpoint), "--to", "0", check=True)
    time.sleep(1)
    assert hget(redis_server, ROOT_DIR, "keep.so")["t"] == "f"
    assert (c.mountpoint / "keep.so").read_bytes() == b"keep"


def live_names(redis_server: RedisServer, key: str) -> list[str]:
    """Names of a directory hash that are not tombstones."""
    out = []
    for name in redis_server.cli("HKEYS", key).stdout.split():
        value = hget(redis_server, key, name)
        if value is not None and value["t"] != "x":
            out.append(name)
    return out


def test_temporary_names_are_never_published(mount_factory: MountFactory, redis_server: RedisServer):
    a = mount_factory("a", *_remote(redis_server))
    (a.mountpoint / "out").mkdir()
    # a writer that pauses mid-file: its tmp name is committed by the idle timer (and may be sent)
    slow = a.mountpoint / "out" / "slow.so.tmp"
    with open(slow, "wb") as f:
        f.write(b"first half ")
        f.flush()
        time.sleep(2.5)
        f.write(b"second half")
    os.rename(slow, a.mountpoint / "out" / "slow.so")
    end = time.monotonic() + 3
    i = 0
    while time.monotonic() < end:  # sustained writes: a tmp file renamed into place, back to back
        tmp = a.mountpoint / "out" / f"k{i}.so.tmp"
        with open(tmp, "wb") as f:
            f.write(b"kernel %d" % i)
        os.rename(tmp, a.mountpoint / "out" / f"k{i}.so")
        i += 1
    wait_uploaded(a)
    names = live_names(redis_server, "mfs:default:d:out")
    assert len(names) == i + 1 and not [n for n in names if n.endswith(".tmp")], [n for n in names if "tmp" in n]
    b = mount_factory("b", *_remote(redis_server))
    assert not [n for n in os.listdir(b.mountpoint / "out") if n.endswith(".tmp")]
    assert (b.mountpoint / "out" / "slow.so").read_bytes() == b"first half second half"


def test_one_version_per_path_and_conflicts_are_counted(mount_factory: MountFactory, redis_server: RedisServer):
    a = mount_factory("a", *_remote(redis_server))
    b = mount_factory("b", *_remote(redis_server))
    write_committed(a.mountpoint / "kernel.so", b"built on A")
    wait_uploaded(a)
    time.sleep(0.01)
    write_committed(b.mountpoint / "kernel.so", b"built on B")  # the newer commit
    wait_uploaded(b)
    assert b.stats()["remote_conflicts"] == 1  # B replaced different content from another writer
    c = mount_factory("c", *_remote(redis_server))
    assert (c.mountpoint / "kernel.so").read_bytes() == b"built on B"
    # A converges when it next looks at the directory (a known one re-syncs in the background)
    wait_for(lambda: os.listdir(a.mountpoint) and (a.mountpoint / "kernel.so").read_bytes() == b"built on B",
             20, "A to take B's newer commit")
    assert a.stats()["remote_conflicts"] == 1
    # an older version written late loses in Redis too: A republishing its content now is newer
    # (a later commit) and wins everywhere -- newest commit wins, whoever sends last
    write_committed(a.mountpoint / "kernel.so", b"built on A again")
    wait_uploaded(a)
    wait_for(lambda: os.listdir(b.mountpoint) and (b.mountpoint / "kernel.so").read_bytes() == b"built on A again",
             20, "B to take A's newer commit")
    events = [json.loads(line) for m in (a, b) for line in (m.store / "events.jsonl").read_text().splitlines()]
    assert any(e["event"] == "conflict" and e["path"] == "kernel.so" for e in events)


# ----------------------------------------------------------------------
# permissions and secrets
# ----------------------------------------------------------------------
def test_remote_entries_take_the_mount_owner_and_published_modes(mount_factory: MountFactory,
                                                                   redis_server: RedisServer):
    a = mount_factory("a", *_remote(redis_server))
    d = a.mountpoint / "inductor" / "ab"
    d.mkdir(parents=True)
    os.chmod(a.mountpoint / "inductor", 0o770)
    os.chmod(d, 0o750)
    write_committed(d / "kernel.so", b"code")
    os.chmod(d / "kernel.so", 0o640)
    wait_uploaded(a)
    traversable(mount_factory.root)
    b = mount_factory("b", *_remote(redis_server), "--allow-other")
    os.chown(b.mountpoint, 1000, 1000)  # the application's user owns its cache
    res = as_user(1000, "-c", f"open({str(b.mountpoint / 'inductor' / 'ab' / 'mine.so')!r}, 'wb').write(b'x');"
                        f"print(open({str(b.mountpoint / 'inductor' / 'ab' / 'kernel.so')!r}, 'rb').read())")
    assert res.returncode == 0, res.stderr
    assert "b'code'" in res.stdout
    st = os.stat(b.mountpoint / "inductor")
    assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (1000, 1000, 0o770)
    assert stat.S_IMODE(os.stat(b.mountpoint / "inductor" / "ab").st_mode) == 0o750
    assert stat.S_IMODE(os.stat(b.mountpoint / "inductor" / "ab" / "kernel.so").st_mode) == 0o640
    c = mount_factory("c", *_remote(redis_server, "--remote-owner", "2000:3000"))
    st = os.stat(c.mountpoint / "inductor" / "ab" / "kernel.so")
    assert (st.st_uid, st.st_gid) == (2000, 3000)


def cmdline(pid: int) -> str:
    return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()


def test_password_is_never_written_or_shown(mount_factory: MountFactory, tmp_path):
    from conftest import free_port

    secret = "s3cret-pa55word-xyz"
    redis = RedisServer(free_port(), password=secret).start()
    try:
        pw_file = tmp_path / "pw"
        pw_file.write_text(secret + "\n")
        store = tmp_path / "a-store"
        store.mkdir(mode=0o755)  # made by a container entrypoint
        os.chmod(store, 0o755)
        a = mount_factory("a", "--remote", redis.url, "--min-age", "0", "--remote-password-file", str(pw_file),
                          store=store)
        write_committed(a.mountpoint / "f", b"through an authenticated server")
        wait_uploaded(a)
        assert secret not in cmdline(a.pid)
        # a password in the URL works, and leaves the daemon's command line all the same
        url = f"redis://:{secret}@127.0.0.1:{redis.port}/0"
        b = mount_factory("b", "--remote", url, "--min-age", "0")
        assert (b.mountpoint / "f").read_bytes() == b"through an authenticated server"
        assert secret not in cmdline(b.pid)
        # errors are logged and shown without it
        redis.stop()
        write_committed(b.mountpoint / "g", b"queued")
        wait_for(lambda: b.stats()["remote_errors"] > 0, 20, "a remote error")
        assert secret not in json.dumps(b.stats())
        res = run_cli("push", str(b.mountpoint))
        assert res.returncode == 1 and secret not in res.stderr + res.stdout
        for m in (a, b):
            m.umount()
            log = (m.store / "mithrilfs.log").read_text()
            assert secret not in log
        assert "remote tier" in (b.store / "mithrilfs.log").read_text()  # the errors were logged
        # the store is private, including the directory that existed before
        for m in (a, b):
            assert stat.S_IMODE(m.store.stat().st_mode) == 0o700
            for p in m.store.rglob("*"):
                mode = stat.S_IMODE(p.lstat().st_mode)
                assert not mode & 0o077, (p, oct(mode))
    finally:
        redis.stop()


def test_signatures_cover_namespace_and_version(mount_factory: MountFactory, redis_server: RedisServer,
                                                 tmp_path):
    key = tmp_path / "key"
    key.write_bytes(os.urandom(32).hex().encode())
    signed = _remote(redis_server, "--remote-key-file", str(key))
    a = mount_factory("a", *signed, "--remote-namespace", "one")
    write_committed(a.mountpoint / "p.so", b"version 1")
    wait_uploaded(a)
    old = redis_server.cli("HGET", "mfs:one:d:", "p.so").stdout.rstrip("\n")
    # copied into another namespace (blob too): not valid there
    redis_server.cli("HSET", "mfs:two:d:", "p.so", old)
    redis_server.cli("SET", blob_key(b"version 1", ns="two"), "version 1")
    other = mount_factory("other", *signed, "--remote-namespace", "two")
    assert not (other.mountpoint / "p.so").exists()
    assert other.stats()["remote_rejected"] >= 1
    # a version field raised by hand breaks the signature
    forged = json.loads(old)
    forged["v"] += 10**9
    redis_server.cli("HSET", "mfs:one:d:", "bumped.so", json.dumps(forged))
    time.sleep(0.02)
    write_committed(a.mountpoint / "p.so", b"version 2")
    wait_uploaded(a)
    b = mount_factory("b", *signed, "--remote-namespace", "one")
    assert (b.mountpoint / "p.so").read_bytes() == b"version 2"
    assert not (b.mountpoint / "bumped.so").exists()
    # the old signed entry replayed over the newer one: the writer restores its version,
    # and a node that saw the newer version never goes back
    redis_server.cli("HSET", "mfs:one:d:", "p.so", old)
    wait_for(lambda: os.listdir(a.mountpoint) and json.loads(
        redis_server.cli("HGET", "mfs:one:d:", "p.so").stdout)["v"] > json.loads(old)["v"],
             20, "the writer to publish its newer version again")
    for _ in range(12):  # B re-syncs in the background meanwhile and keeps what it has
        os.listdir(b.mountpoint)
        time.sleep(0.5)
    assert (b.mountpoint / "p.so").read_bytes() == b"version 2"
    c = mount_factory("c", *signed, "--remote-namespace", "one")
    assert (c.mountpoint / "p.so").read_bytes() == b"version 2"
