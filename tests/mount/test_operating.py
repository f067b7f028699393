"""Operating a mount: stats counters, Prometheus, the event log, status, env, run, export/import."""

from __future__ import annotations

import json
import os
import re
import sys
import time
import urllib.request
from pathlib import Path

from conftest import Mount, MountFactory, free_port, is_mounted, run_cli, supervisor_pid, write_committed
from prometheus_client.parser import text_string_to_metric_families

N = 10_000


def _read_uncached(p: Path) -> bytes:
    """Read through the daemon: drop the kernel's cached pages of the file first."""
    with open(p, "rb") as f:
        os.posix_fadvise(f.fileno(), 0, 0, os.POSIX_FADV_DONTNEED)
        return f.read()


def test_counters_move_as_documented(mnt: Mount):
    root = mnt.mountpoint
    (root / "inductor").mkdir()
    (root / "triton").mkdir()
    payload = os.urandom(N)
    (root / "inductor" / "a").write_bytes(payload)  # miss (lookup before create), write
    (root / "triton" / "b").write_bytes(payload)  # miss, write
    with open(root / "inductor" / "a", "rb+") as f:
        os.fsync(f.fileno())  # commit point
    with open(root / "triton" / "b", "rb+") as f:
        os.fsync(f.fileno())  # commit point, deduplicated
    assert not (root / "inductor" / "missing").exists()  # miss
    assert not (root / "inductor" / "missing").exists()  # cached negative entry: not seen again
    s = mnt.stats()
    ind, tri = s["by_dir"]["inductor"], s["by_dir"]["triton"]
    assert {k: ind[k] for k in ("hits", "misses", "writes", "write_bytes", "commits", "dedup_hits")} == {
        "hits": 0, "misses": 2, "writes": 1, "write_bytes": N, "commits": 1, "dedup_hits": 0}
    assert {k: tri[k] for k in ("hits", "misses", "writes", "write_bytes", "commits", "dedup_hits")} == {
        "hits": 0, "misses": 1, "writes": 1, "write_bytes": N, "commits": 1, "dedup_hits": 1}
    assert s["by_dir"]["/"]["misses"] == 2  # the two mkdirs looked their names up first
    assert s["files"] == 2 and s["blobs"] == 1
    assert s["logical_bytes"] == 2 * N and s["physical_bytes"] == N and s["dedup_ratio"] == 2.0
    assert s["commits"] == 2 and s["dedup_hits"] == 1 and s["written_files"] == 0

    # a new mount: the kernel knows nothing, so every use reaches the daemon once
    mnt.remount()
    assert _read_uncached(root / "inductor" / "a") == payload  # hit (positive lookup), one read
    assert (root / "inductor" / "a").read_bytes() == payload  # the kernel's cache: not seen
    assert not (root / "inductor" / "missing").exists()  # miss
    s = mnt.stats()
    ind = s["by_dir"]["inductor"]
    assert {k: ind[k] for k in ("hits", "misses", "reads", "read_bytes", "writes", "commits", "evictions",
                                "corrupt_blobs")} == {
        "hits": 1, "misses": 1, "reads": 1, "read_bytes": N, "writes": 0, "commits": 0, "evictions": 0,
        "corrupt_blobs": 0}
    assert ind["hit_rate"] == 0.5
    assert s["hits"] == 1 and s["misses"] == 1 and s["hit_rate"] == 0.5
    for op in ("lookup", "read"):
        assert s["latency_us"][op]["samples"] > 0 and s["latency_us"][op]["p99"] >= s["latency_us"][op]["p50"] > 0
    table = run_cli("stats", str(root), check=True).stdout
    assert "inductor" in table
    # the rate says what it counts: lookups, not reads (a warm run's low rate is no failure to serve)
    assert re.search(r"hit rate +50\.0% of the name lookups that reached the daemon found a file", table), table
    status = run_cli("status", str(root), check=True).stdout
    assert "hit rate 50% of lookups" in status, status
    as_json = json.loads(run_cli("stats", str(root), "--json", check=True).stdout)
    assert as_json["by_dir"]["inductor"]["hits"] == 1


def test_prometheus_endpoint_serves_the_same_values(mount_factory: MountFactory):
    port = free_port()  # this worker's share: a port derived from the pid collided with another worker's server
    m = mount_factory("prom", "--metrics-port", str(port))
    (m.mountpoint / "inductor").mkdir()
    write_committed(m.mountpoint / "inductor" / "x", b"abc")
    write_committed(m.mountpoint / "inductor" / "y", b"abc")
    time.sleep(1.5)  # the exporter's snapshot refreshes every second
    stats = m.stats()
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5).read().decode()
    samples = {}
    for family in text_string_to_metric_families(body):
        for sample in family.samples:
            samples[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    assert samples[("mithrilfs_files", ())] == stats["files"] == 2
    assert samples[("mithrilfs_physical_bytes", ())] == stats["physical_bytes"] == 3
    assert samples[("mithrilfs_commits_total", (("dir", "inductor"),))] == stats["by_dir"]["inductor"]["commits"] == 2
    assert samples[("mithrilfs_dedup_hits_total", (("dir", "inductor"),))] == 1
    assert samples[("mithrilfs_dedup_ratio", ())] == stats["dedup_ratio"] == 2.0


def test_metrics_port_in_use_fails_the_mount(mount_factory: MountFactory, tmp_path):
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        sock.listen()
        port = sock.getsockname()[1]
        (tmp_path / "mp").mkdir()
        res = run_cli("mount", str(tmp_path / "mp"), "--store", str(tmp_path / "s"), "--metrics-port", str(port))
    assert res.returncode == 1 and "metrics" in res.stderr and len(res.stderr.strip().splitlines()) == 1
    assert not is_mounted(tmp_path / "mp")


def test_event_log_lines_include_eviction(mount_factory: MountFactory):
    m = mount_factory("ev", "--min-age", "0")
    for i in range(4):
        write_committed(m.mountpoint / f"f{i}", os.urandom(1000))
    run_cli("gc", str(m.mountpoint), "--to", "0", check=True)
    m.umount()
    lines = (m.store / "events.jsonl").read_text().splitlines()
    events = [json.loads(line) for line in lines]  # every line is one JSON object
    assert all(isinstance(e, dict) and "ts" in e and "event" in e for e in events)
    kinds = [e["event"] for e in events]
    assert kinds[0] == "mount" and kinds[-1] == "unmount"
    ev = next(e for e in events if e["event"] == "eviction")
    assert ev["reason"] == "gc" and ev["units"] == 4 and ev["bytes"] == 4000


def test_event_log_rotates(tmp_path):
    from mithrilfs.observe.events import EventLog

    log = EventLog(tmp_path / "events.jsonl", max_bytes=500, keep=2)
    for i in range(50):
        log.emit("summary", i=i)
    assert (tmp_path / "events.jsonl").stat().st_size <= 500
    assert (tmp_path / "events.jsonl.1").exists() and (tmp_path / "events.jsonl.2").exists()
    assert not (tmp_path / "events.jsonl.3").exists()
    last = json.loads((tmp_path / "events.jsonl").read_text().splitlines()[-1])
    assert last["i"] == 49


def test_status_and_env(mnt: Mount, tmp_path):
    res = run_cli("status", str(mnt.mountpoint))
    lines = res.stdout.strip().splitlines()
    assert res.returncode == 0 and "live" in lines[0] and len(lines) == 2, res.stdout  # no shared tier: no level
    assert lines[1].startswith("  requests served over /dev/fuse read/write; passthrough off"), res.stdout
    res = run_cli("env", str(mnt.mountpoint), check=True)
    assert res.stdout.splitlines()[:2] == [
        f"export TORCHINDUCTOR_CACHE_DIR={mnt.mountpoint}/inductor",
        f"export TRITON_CACHE_DIR={mnt.mountpoint}/triton",
    ]  # and every other JIT cache of the catalog (tests/e2e/test_jit_caches.py)
    assert (mnt.mountpoint / "inductor").is_dir() and (mnt.mountpoint / "triton").is_dir()
    mnt.umount()
    res = run_cli("status", str(mnt.mountpoint))
    assert res.returncode == 1 and "not mounted" in res.stdout
    res = run_cli("env", str(tmp_path))
    assert res.returncode == 2 and "not a mithrilfs mount" in res.stderr


def test_status_of_a_dead_daemon(mnt: Mount):
    import signal

    os.kill(supervisor_pid(mnt.mountpoint), signal.SIGKILL)  # else it would take the mount over
    os.kill(mnt.pid, signal.SIGKILL)
    time.sleep(0.5)
    res = run_cli("status", str(mnt.mountpoint))
    assert res.returncode == 1 and "stale" in res.stdout


def test_run_mounts_runs_and_unmounts(tmp_path):
    store = tmp_path / "store"
    code = (
        "import os, sys; d = os.environ['TORCHINDUCTOR_CACHE_DIR'];"
        "open(os.path.join(d, 'artifact'), 'w').write('x' * 100);"
        "print(d); sys.exit(3)"
    )
    res = run_cli("run", "--store", str(store), "--", sys.executable, "-c", code)
    assert res.returncode == 3
    mp = Path(res.stdout.strip()).parent
    assert not mp.exists() or not is_mounted(mp)
    assert "1 files written" in res.stderr and "exit status 3" in res.stderr
    assert "lookups found a file" in res.stderr  # says what its hits count
    with open("/proc/self/mounts") as f:
        assert str(mp) not in f.read()
    # the artifact is in the store: mount it and look
    (tmp_path / "mp").mkdir()
    m = Mount(tmp_path / "mp", store)
    try:
        m.mount()
        assert (m.mountpoint / "inductor" / "artifact").read_text() == "x" * 100
    finally:
        m.force_cleanup()


def test_run_uses_an_existing_mount_and_leaves_it(mnt: Mount):
    res = run_cli("run", "--mount", str(mnt.mountpoint), "--", "sh", "-c", 'test -d "$TRITON_CACHE_DIR"')
    assert res.returncode == 0
    assert is_mounted(mnt.mountpoint)
    res = run_cli("run", "--mount", str(mnt.mountpoint))
    assert res.returncode == 2 and "needs a command" in res.stderr


def test_export_import_roundtrip_and_merge(mount_factory: MountFactory, tmp_path):
    a = mount_factory("src")
    (a.mountpoint / "inductor" / "ab").mkdir(parents=True)
    files = {"inductor/ab/k.so": os.urandom(5000), "inductor/ab/k.cpp": b"int x;", "top.txt": b"hello",
             "dup.txt": b"hello"}
    for rel, data in files.items():
        write_committed(a.mountpoint / rel, data)
    os.symlink("top.txt", a.mountpoint / "link")
    os.chmod(a.mountpoint / "inductor" / "ab" / "k.so", 0o755)
    archive = tmp_path / "cache.tar"
    res = run_cli("export", str(a.mountpoint), str(archive), check=True)
    assert "exported 7 entries, 3 blobs" in res.stdout

    # into an empty store: identical tree and contents
    b_store = tmp_path / "b-store"
    res = run_cli("import", str(archive), "--store", str(b_store), check=True)
    assert "7 added" in res.stdout
    b = mount_factory("dst", store=b_store)
    for rel, data in files.items():
        assert (b.mountpoint / rel).read_bytes() == data
    assert os.readlink(b.mountpoint / "link") == "top.txt"
    assert (b.mountpoint / "inductor" / "ab" / "k.so").stat().st_mode & 0o777 == 0o755
    assert b.stats()["blobs"] == 3

    # merging: an older archive entry never replaces newer content; nothing else is lost
    write_committed(b.mountpoint / "top.txt", b"newer here")
    write_committed(b.mountpoint / "only-in-b", b"mine")
    b.umount()
    res = run_cli("import", str(archive), "--store", str(b_store), check=True)
    assert "0 added" in res.stdout and "0 replaced" in res.stdout
    b.mount()
    assert (b.mountpoint / "top.txt").read_bytes() == b"newer here"
    assert (b.mountpoint / "only-in-b").read_bytes() == b"mine"
    # a newer archive entry does replace
    time.sleep(0.01)
    write_committed(a.mountpoint / "top.txt", b"newest in a")
    archive2 = tmp_path / "cache2.tar"
    run_cli("export", str(a.mountpoint), str(archive2), check=True)
    b.umount()
    res = run_cli("import", str(archive2), "--store", str(b_store), check=True)
    assert "1 replaced" in res.stdout
    b.mount()
    assert (b.mountpoint / "top.txt").read_bytes() == b"newest in a"
    assert (b.mountpoint / "only-in-b").read_bytes() == b"mine"


def test_import_verifies_blobs(mount_factory: MountFactory, tmp_path):
    import tarfile

    a = mount_factory("v")
    write_committed(a.mountpoint / "good", b"good bytes")
    write_committed(a.mountpoint / "bad", b"will be altered")
    a.umount()
    archive = tmp_path / "store-export.tar"
    run_cli("export", "--store", str(a.store), str(archive), check=True)
    tampered = tmp_path / "tampered.tar"
    with tarfile.open(archive) as src, tarfile.open(tampered, "w") as dst:
        for member in src.getmembers():
            data = src.extractfile(member).read()
            if data == b"will be altered":
                data = b"evil bytes here"
            member.size = len(data)
            import io

            dst.addfile(member, io.BytesIO(data))
    store = tmp_path / "fresh"
    res = run_cli("import", str(tampered), "--store", str(store))
    assert res.returncode == 1 and "1 corrupt blobs skipped" in res.stdout  # rejected: not a silent success
    b = mount_factory("vb", store=store)
    assert sorted(os.listdir(b.mountpoint)) == ["good"]
    assert (b.mountpoint / "good").read_bytes() == b"good bytes"


def test_export_import_bad_input(mnt: Mount, tmp_path):
    res = run_cli("export", str(tmp_path / "x.tar"))
    assert res.returncode == 2
    (tmp_path / "junk.tar").write_bytes(b"not a tar at all")
    res = run_cli("import", str(tmp_path / "junk.tar"), "--store", str(tmp_path / "s"))
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "s").exists()
    res = run_cli("import", str(tmp_path / "absent.tar"), "--store", str(tmp_path / "s"))
    assert res.returncode == 2 and "no such archive" in res.stderr
    run_cli("export", str(mnt.mountpoint), str(tmp_path / "ok.tar"), check=True)
    res = run_cli("import", str(tmp_path / "ok.tar"), "--store", str(mnt.store))
    assert res.returncode == 1 and "in use" in res.stderr
