"""The shared tier through a real redis-server: read-through, write-behind, trust, outages."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from conftest import Mount, MountFactory, RedisServer, run_cli, wait_for, wait_uploaded, write_committed

from mithrilfs.testing import own_namespace


def _remote(redis_server: RedisServer, *extra: str) -> tuple[str, ...]:
    return ("--remote", redis_server.url, "--min-age", "0", *extra)


def blob_key(data: bytes, i: int = 0, ns: str = "default") -> str:
    from mithrilfs.store.cas import hash_bytes

    return f"mfs:{ns}:b:{{{hash_bytes(data).hex()}}}:{i}"


def entry(data: bytes | None = None, **fields) -> str:
    """A remote entry's JSON, as a node would write it (fields override)."""
    from mithrilfs.store.cas import hash_bytes

    d = {"t": "f", "v": int(time.time() * 1e6), "n": "forger", "m": 0o644, "mt": 1}
    if data is not None:
        d.update(h=hash_bytes(data).hex(), s=len(data))
    d.update(fields)
    return json.dumps(d)


def test_names_and_blobs_flow_between_nodes(mount_factory: MountFactory, redis_server: RedisServer):
    a = mount_factory("a", *_remote(redis_server))
    b = mount_factory("b", *_remote(redis_server))
    (a.mountpoint / "inductor" / "ab").mkdir(parents=True)
    payload = os.urandom(200_000)
    tmp = a.mountpoint / "inductor" / "ab" / "tmp.123"
    tmp.write_bytes(payload)  # published by the rename
    os.replace(tmp, a.mountpoint / "inductor" / "ab" / "kernel.so")
    os.symlink("ab/kernel.so", a.mountpoint / "inductor" / "link")
    wait_uploaded(a)
    # B, with an empty store, sees the names with their size, lists them, and gets verified bytes
    p = b.mountpoint / "inductor" / "ab" / "kernel.so"
    assert p.stat().st_size == len(payload)
    assert os.listdir(b.mountpoint / "inductor" / "ab") == ["kernel.so"]  # the tmp name was never published
    assert p.read_bytes() == payload
    assert os.readlink(b.mountpoint / "inductor" / "link") == "ab/kernel.so"
    s = b.stats()
    assert s["remote_fetched_bytes"] == len(payload) and s["remote_verify_failures"] == 0
    assert s["physical_bytes"] == len(payload)  # fetched content counts in B's budget
    uploads_only_missing_and_evicted_comes_back(a, b, b.mountpoint / "inductor" / "ab" / "kernel.so", payload)


def uploads_only_missing_and_evicted_comes_back(a: Mount, b: Mount, p: Path, payload: bytes) -> None:
    """Whatever the tier: the same content written again moves no bytes, and B's copy (at *p*), evicted
    like any file, comes back from the tier."""
    before = a.stats()["remote_uploaded_bytes"]
    write_committed(a.mountpoint / "inductor" / "copy.so", payload)
    time.sleep(0.1)
    assert wait_uploaded(a)["remote_uploaded_bytes"] == before
    run_cli("gc", str(b.mountpoint), "--to", "0", check=True)
    assert b.stats()["physical_bytes"] == 0
    assert p.read_bytes() == payload


def test_tampered_blob_in_redis_is_never_served(mount_factory: MountFactory, redis_server: RedisServer):
    a = mount_factory("a", *_remote(redis_server))
    b = mount_factory("b", *_remote(redis_server))
    write_committed(a.mountpoint / "k.so", b"genuine kernel")
    wait_uploaded(a)
    assert redis_server.cli("SET", blob_key(b"genuine kernel"), "evilish kernel").stdout.strip() == "OK"
    # the lookup reads the small file ahead, and finds it bad before the read comes (as on a loaded machine,
    # where the read then asked the tier a second time)
    os.stat(b.mountpoint / "k.so")
    wait_for(lambda: b.stats()["remote_verify_failures"] == 1, 30, "the read-ahead to reject the blob")
    with pytest.raises(OSError) as e:
        (b.mountpoint / "k.so").read_bytes()
    assert e.value.errno == errno.EIO  # never the bad bytes, and not asked again
    s = b.stats()
    assert s["remote_verify_failures"] == 1
    with pytest.raises(OSError) as e:  # the name went; when Redis names it again, the fetch is refused again
        time.sleep(1.1)
        (b.mountpoint / "k.so").read_bytes()
    assert e.value.errno in (errno.EIO, errno.ENOENT)
    assert b.stats()["remote_verify_failures"] >= 1


def test_entries_without_valid_hmac_are_ignored(mount_factory: MountFactory, redis_server: RedisServer, tmp_path):
    key = tmp_path / "key"
    key.write_bytes(os.urandom(32).hex().encode())
    a = mount_factory("a", *_remote(redis_server, "--remote-key-file", str(key)))
    b = mount_factory("b", *_remote(redis_server, "--remote-key-file", str(key)))
    write_committed(a.mountpoint / "signed.so", b"from a trusted node")
    wait_uploaded(a)
    assert (b.mountpoint / "signed.so").read_bytes() == b"from a trusted node"
    # someone with write access to Redis but without the key plants an entry and a blob
    evil = b"attacker code"
    redis_server.cli("SET", blob_key(evil), evil.decode())
    redis_server.cli("HSET", "mfs:default:d:", "forged.so", entry(evil, m=0o755))
    redis_server.cli("HSET", "mfs:default:d:", "signed.so", entry(evil, m=0o755, mac="00" * 32))
    time.sleep(1.1)  # past the interval after which a missing name re-syncs its directory
    assert not (b.mountpoint / "forged.so").exists()
    assert b.stats()["remote_rejected"] >= 1
    # a third node without the key does see it (the key is what protects)
    c = mount_factory("c", *_remote(redis_server))
    assert (c.mountpoint / "forged.so").read_bytes() == evil


def test_redis_outage_keeps_local_cache_working_and_uploads_catch_up(
    mount_factory: MountFactory, redis_server: RedisServer
):
    b = mount_factory("b", *_remote(redis_server))
    write_committed(b.mountpoint / "before", b"uploaded while up")
    wait_uploaded(b)
    redis_server.stop()
    for i in range(3):
        write_committed(b.mountpoint / f"during{i}", f"written while down {i}".encode())
    t = time.monotonic()
    for i in range(20):
        assert not (b.mountpoint / f"missing{i}").exists()
    assert time.monotonic() - t < 10, "lookups must not wait on a dead Redis each time"
    assert (b.mountpoint / "before").read_bytes() == b"uploaded while up"
    assert (b.mountpoint / "during1").read_bytes() == b"written while down 1"
    wait_for(lambda: b.stats()["remote_errors"] > 0, 20, "a remote error (the uploader's next attempt fails)")
    s = b.stats()
    assert s["remote_errors"] > 0 and s["upload_queue"] >= 1, {k: v for k, v in s.items() if k.startswith(("remote", "upload"))}
    redis_server.start()  # same port, empty: the queued uploads must arrive
    deadline = time.monotonic() + 60
    while redis_server.cli("HEXISTS", "mfs:default:d:", "during2").stdout.strip() != "1":
        assert time.monotonic() < deadline, "uploads did not resume after Redis came back"
        time.sleep(0.2)
    for i in range(3):
        assert redis_server.cli("HEXISTS", "mfs:default:d:", f"during{i}").stdout.strip() == "1"


def test_push_seeds_a_namespace(mount_factory: MountFactory, redis_server: RedisServer):
    a = mount_factory("a", "--min-age", "0")  # filled without a remote
    for i in range(5):
        write_committed(a.mountpoint / f"f{i}", os.urandom(1000))
    a.umount()
    a.extra = _remote(redis_server)
    a.mount()
    # the first mount of a store on a tier uploads what it holds, unasked
    assert wait_uploaded(a)["remote_uploaded_bytes"] == 5000
    assert redis_server.cli("HLEN", "mfs:default:d:").stdout.strip() == "5"
    # the names and blobs go, but the epoch stays (as if deleted by hand): only push sends them again
    redis_server.cli("EVAL", "local e = redis.call('GET', KEYS[1]); redis.call('FLUSHALL');"
                     " redis.call('SET', KEYS[1], e)", "1", "mfs:default:epoch")
    res = run_cli("push", str(a.mountpoint), check=True)
    assert res.stdout.startswith("pushed 5 files") and "4.9 KiB" in res.stdout
    assert redis_server.cli("HLEN", "mfs:default:d:").stdout.strip() == "5"
    res = run_cli("push", str(mount_factory("plain").mountpoint))
    assert res.returncode == 2 and "without --remote" in res.stderr


def test_an_empty_file_renamed_into_place_reaches_other_nodes(mount_factory: MountFactory,
                                                              redis_server: RedisServer):
    """A framework publishes a cache file by rename, an empty one too (nothing written, nothing to commit):
    the rename sends it, and another node finds it, empty."""
    a = mount_factory("a", *_remote(redis_server))
    (a.mountpoint / "entry.tmp").write_bytes(b"")
    os.rename(a.mountpoint / "entry.tmp", a.mountpoint / "entry")
    wait_for(lambda: redis_server.cli("HKEYS", "mfs:default:d:").stdout.split() == ["entry"], 20,
             "the renamed file to be published")
    b = mount_factory("b", *_remote(redis_server))
    assert (b.mountpoint / "entry").read_bytes() == b""
    assert (b.mountpoint / "entry").is_file()


def test_a_fifo_or_socket_stays_on_its_node(mount_factory: MountFactory, redis_server: RedisServer):
    """The tier holds files, directories and symlinks: a fifo renamed into place (which queues it) or a
    socket is not sent as an empty regular file to every other node."""
    import socket

    a = mount_factory("a", *_remote(redis_server))
    os.mkfifo(a.mountpoint / "pipe.tmp")
    os.rename(a.mountpoint / "pipe.tmp", a.mountpoint / "pipe")
    with socket.socket(socket.AF_UNIX) as sock:
        sock.bind(str(a.mountpoint / "sock.tmp"))
        os.rename(a.mountpoint / "sock.tmp", a.mountpoint / "sock")
    write_committed(a.mountpoint / "kernel", b"k")
    wait_uploaded(a)
    run_cli("push", str(a.mountpoint), check=True)
    assert redis_server.cli("HKEYS", "mfs:default:d:").stdout.split() == ["kernel"]


def test_namespaces_are_separate(mount_factory: MountFactory, redis_server: RedisServer):
    a = mount_factory("a", *_remote(redis_server, "--remote-namespace", "team-a"))
    b = mount_factory("b", *_remote(redis_server, "--remote-namespace", "team-b"))
    write_committed(a.mountpoint / "only-a", b"x")
    wait_uploaded(a)
    assert not (b.mountpoint / "only-a").exists()


def test_bad_remote_options(tmp_path):
    (tmp_path / "mp").mkdir()
    short = tmp_path / "short"
    short.write_bytes(b"abc")
    for args, needle in (
        (["--remote", "http://x"], "invalid remote"),
        (["--remote", "redis://127.0.0.1:6379/zero"], "database"),
        (["--remote-key-file", str(short)], "needs --remote"),
        (["--remote", "redis://127.0.0.1:1/0", "--remote-key-file", str(short)], "fewer than 16"),
        (["--remote", "redis://127.0.0.1:1/0", "--remote-key-file", str(tmp_path / "absent")], "cannot read"),
        (["--remote", "redis://127.0.0.1:1/0", "--remote-namespace", "a b"], "invalid namespace"),
    ):
        res = run_cli("mount", str(tmp_path / "mp"), "--store", str(tmp_path / "s"), *args)
        assert res.returncode == 2, (args, res.stderr)
        assert needle in res.stderr and len(res.stderr.strip().splitlines()) == 1


TRITON_PUT = textwrap.dedent(
    """
    import sys
    from triton.runtime.cache import FileCacheManager
    m = FileCacheManager("kern")
    group = {n: m.put(("payload of " + n).encode() * 100, n) for n in ("k.cubin", "k.ptx")}
    m.put_group("k.json", group)
    """
)
TRITON_GET = textwrap.dedent(
    """
    import json
    from triton.runtime.cache import FileCacheManager
    g = FileCacheManager("kern").get_group("k.json")
    print(json.dumps(None if g is None else {k: open(p, "rb").read().decode()[:20] for k, p in g.items()}))
    """
)


def test_triton_groups_across_nodes_at_the_same_path(mount_factory: MountFactory, redis_server: RedisServer,
                                                     tmp_path):
    a = mount_factory("a", *_remote(redis_server))
    env = dict(os.environ, TRITON_CACHE_DIR=str(a.mountpoint / "triton"))
    subprocess.run([sys.executable, "-c", TRITON_PUT], env=env, check=True, timeout=120)
    wait_uploaded(a)
    # node B: its own mount namespace, its own empty store, mounted at A's path
    store_b = tmp_path / "store-b"
    script = (  # A's mount is not kept in that namespace
        f"{sys.executable} -m mithrilfs mount {a.mountpoint} --store {store_b} --remote {redis_server.url} && "
        f"{sys.executable} -c '{TRITON_GET}'; rc=$?; "
        f"{sys.executable} -m mithrilfs umount {a.mountpoint}; exit $rc"
    )
    res = subprocess.run(own_namespace.argv(["sh", "-c", script]), env=env,
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stderr
    got = json.loads(res.stdout.strip().splitlines()[-1])
    assert got == {"k.cubin": "payload of k.cubinpa", "k.ptx": "payload of k.ptxpayl"}
    assert (store_b / "objects").exists() and any((store_b / "objects").rglob("*"))
