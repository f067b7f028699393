"""LRU eviction under a byte budget on a real mount: budget, order, pinning, groups, policies."""

from __future__ import annotations

import errno
import json
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from conftest import (
    Mount,
    MountFactory,
    blob_files,
    run_cli,
    still_writing,
    supervisor_pid,
    wait_for,
    write_committed,
)

K = 1024


def store_bytes(store: Path) -> int:
    """Physical bytes as the disk sees them: blobs plus staging files."""
    total = 0
    for sub in ("objects", "staging"):
        for root, _, files in os.walk(store / sub):
            for f in files:
                try:
                    total += os.path.getsize(os.path.join(root, f))
                except FileNotFoundError:
                    pass
    return total


def write_files(d: Path, names, size=100 * K) -> dict[str, bytes]:
    data = {}
    for n in names:
        data[n] = os.urandom(size)
        write_committed(d / n, data[n])
    return data


def test_writing_five_times_the_budget_stays_within_it(mount_factory: MountFactory):
    budget = 1024 * K
    m = mount_factory("b", "--max-size", str(budget), "--min-age", "0")
    largest = 60 * K
    peak = 0
    stop = threading.Event()
    begun = 0  # bytes of the files the writer has begun
    index = sqlite3.connect(f"file:{m.store / 'index.sqlite3'}?mode=ro", uri=True, timeout=10,
                            check_same_thread=False)

    def held() -> dict[bytes, int]:
        """Content whose every name is gone (evicted) while the kernel still holds an inode of it: it goes
        at the kernel's FORGET, which the eviction's notification asks for (an mmapped library keeps its
        content this way, so the daemon must wait)."""
        return dict(index.execute(
            "SELECT b.hash, b.size FROM blobs b WHERE b.refcount > 0 AND NOT EXISTS"
            " (SELECT 1 FROM inodes i WHERE i.hash = b.hash AND i.nlink > 0)").fetchall())

    def sample():
        # a sample is a walk of the store, not an instant: what is committed while it walks may make room by
        # evicting blobs it already counted, so the bytes begun meanwhile are taken off (on a loaded machine
        # a slow walk spanned several commits and read 4 KiB over the bound with none of it there at once);
        # and the content waiting for the kernel's FORGET all through the walk is not the cache's (measured
        # beside two busy loops: up to 600 KB of it, and a quick quiet machine's walk read 2.28 MB)
        nonlocal peak
        while not stop.is_set():
            try:
                before, waiting = begun, held()
                walked = store_bytes(m.store)
                still = held()
            except sqlite3.OperationalError:  # the index busy a moment (a checkpoint): the next sample
                continue
            peak = max(peak, walked - (begun - before) - sum(size for h, size in waiting.items() if h in still))

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        written = 0
        i = 0
        while written < 5 * budget:
            size = 20 * K + (i * 7919) % (largest - 20 * K)
            begun += size
            write_committed(m.mountpoint / f"f{i:04d}", os.urandom(size))
            written += size
            i += 1
    finally:
        stop.set()
        sampler.join()
        index.close()
    # an evicted file the kernel still holds keeps its blob until the kernel lets it go
    wait_for(lambda: store_bytes(m.store) <= budget, 10, "the evicted blobs to go")
    assert m.stats()["physical_bytes"] == store_bytes(m.store)
    # a blob evicted after the walk counted it (for a file begun before the walk) and the file being
    # written: one file each above the budget
    assert peak <= budget + 2 * largest, f"peak {peak} above budget + the file being written + the walk's slack"
    st = m.stats()
    assert st["evictions"] > 0 and st["evicted_bytes"] >= written - budget
    # what is left is intact
    left = os.listdir(m.mountpoint)
    assert 0 < len(left) < i


def test_least_recently_used_go_first(mount_factory: MountFactory):
    m = mount_factory("lru", "--max-size", str(1024 * K), "--min-age", "0")
    d = m.mountpoint
    write_files(d, [f"old{i}" for i in range(8)])
    # a use reaches the daemon when the kernel looks a name up or revalidates it (at most once
    # a minute per file); a new mount's kernel knows no name yet
    m.remount()
    for i in range(4):  # touch half of them
        (d / f"old{i}").read_bytes()
    time.sleep(0.05)
    write_files(d, [f"new{i}" for i in range(4)])
    left = set(os.listdir(d))
    evicted = {f"old{i}" for i in range(8)} - left
    assert evicted, "nothing was evicted"
    assert evicted <= {f"old{i}" for i in range(4, 8)}, f"touched files were evicted: {evicted}"
    assert {f"old{i}" for i in range(4)} <= left


def test_files_being_written_are_never_evicted_open_ones_keep_working(mount_factory: MountFactory):
    """The kernel opens files itself: an open file's name may go, its content stays until it is closed."""
    m = mount_factory("pin", "--max-size", str(512 * K), "--min-age", "0")
    d = m.mountpoint
    held = write_files(d, ["reading"])["reading"]
    reader = open(d / "reading", "rb")
    writer = open(d / "writing", "wb")
    writer.write(b"w" * 100 * K)
    writer.flush()
    try:
        with still_writing(writer.fileno(), b"w"):
            write_files(d, [f"filler{i}" for i in range(15)])
            run_cli("gc", str(d), "--to", "0", check=True)
        names = set(os.listdir(d))
        assert "writing" in names  # uncommitted writes pin a file
        assert "reading" not in names  # evicted while open...
        assert reader.read() == held  # ...and still readable to the end
        writer.write(b"x")
    finally:
        reader.close()
        writer.close()
    assert (d / "writing").read_bytes() == b"w" * 100 * K + b"x"
    os.replace(d / "writing", d / "written")  # a commit point: no longer pinned
    out = run_cli("gc", str(d), "--to", "0", check=True)
    assert "evicted" in out.stdout
    assert os.listdir(d) == []
    deadline = time.monotonic() + 10
    while store_bytes(m.store) and time.monotonic() < deadline:
        time.sleep(0.05)  # content the kernel still held goes at its FORGET
    assert store_bytes(m.store) == 0


SO_HOLDER = textwrap.dedent(
    """
    import ctypes, sys
    lib = ctypes.CDLL(sys.argv[1])
    print(lib.add(2, 3), flush=True)
    sys.stdin.readline()  # the name is evicted meanwhile
    print(lib.add(20, 3), flush=True)
    sys.stdin.readline()  # still mapped until told to go: the test reads what it holds first
    """
)


def test_mmapped_so_survives_eviction_and_is_freed_after_exit(mount_factory: MountFactory, tmp_path):
    m = mount_factory("mmap", "--max-size", str(1024 * K), "--min-age", "0")
    d = m.mountpoint
    src = tmp_path / "kern.c"
    src.write_text("int add(int a, int b) { return a + b + 1000; }\n" + "char pad[300000] = {1};\n")
    so = d / "libkern.so"
    subprocess.run(["g++", "-shared", "-fPIC", "-O1", "-o", str(so), "-x", "c", str(src)], check=True)
    so_size = so.stat().st_size
    assert so_size > 300 * K
    holder = subprocess.Popen([sys.executable, "-c", SO_HOLDER, str(so)], stdin=subprocess.PIPE,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "1005"
        # fill the cache past its budget: the .so is the least recently used and goes first
        write_files(d, [f"filler{i}" for i in range(12)])
        time.sleep(0.5)
        run_cli("gc", str(d), check=True)
        assert "libkern.so" not in os.listdir(d)
        s = m.stats()
        assert s["physical_bytes"] <= 1024 * K  # the budget holds, the mapped bytes counted in it
        holder.stdin.write("go\n")
        holder.stdin.flush()
        assert holder.stdout.readline().strip() == "1023"  # the mapping keeps working
        held = m.stats()["physical_bytes"]  # read while the holder still maps the .so
        assert held >= so_size
    finally:
        holder.stdin.close()
        holder.wait(timeout=30)
    deadline = time.monotonic() + 10
    while m.stats()["physical_bytes"] > held - so_size and time.monotonic() < deadline:
        time.sleep(0.05)  # the kernel forgets the inode once the process is gone
    assert m.stats()["physical_bytes"] <= held - so_size


def test_unlinked_open_content_counts_until_closed(mount_factory: MountFactory):
    m = mount_factory("ul", "--max-size", str(4096 * K), "--min-age", "0")
    write_files(m.mountpoint, ["victim"], size=300 * K)
    f = open(m.mountpoint / "victim", "rb")
    (m.mountpoint / "victim").unlink()
    assert m.stats()["physical_bytes"] == 300 * K
    f.close()
    deadline = time.monotonic() + 10
    while m.stats()["physical_bytes"] and time.monotonic() < deadline:
        time.sleep(0.05)  # the kernel's forget arrives asynchronously
    assert m.stats()["physical_bytes"] == 0


def test_young_files_are_kept_for_min_age(mount_factory: MountFactory):
    m = mount_factory("young", "--max-size", str(256 * K), "--min-age", "1h")
    write_files(m.mountpoint, [f"f{i}" for i in range(6)])
    assert len(os.listdir(m.mountpoint)) == 6  # over budget, but nothing is old enough


TRITON_PUT = textwrap.dedent(
    """
    import os, sys
    from triton.runtime.cache import FileCacheManager
    for k in range(int(sys.argv[1])):
        m = FileCacheManager(f"key{k}")
        group = {n: m.put(os.urandom(40_000), n) for n in ("k.cubin", "k.ptx", "k.ttir")}
        m.put_group("k.json", group)
    """
)
TRITON_GET = textwrap.dedent(
    """
    import json, os, sys
    from triton.runtime.cache import FileCacheManager
    out = {}
    for k in range(int(sys.argv[1])):
        g = FileCacheManager(f"key{k}").get_group("k.json")
        out[k] = None if g is None else sorted(g)
    print(json.dumps(out))
    """
)


def test_triton_groups_evicted_whole_or_not_at_all(mount_factory: MountFactory):
    m = mount_factory("tri", "--max-size", "100M", "--min-age", "0")
    env = dict(os.environ, TRITON_CACHE_DIR=str(m.mountpoint / "triton"))
    n = 12
    subprocess.run([sys.executable, "-c", TRITON_PUT, str(n)], env=env, check=True, timeout=120)
    run_cli("gc", str(m.mountpoint), "--to", str(store_bytes(m.store) // 2), check=True)
    for k in range(n):
        d = m.mountpoint / "triton" / f"key{k}"
        names = sorted(os.listdir(d)) if d.exists() else []
        assert names in ([], ["__grp__k.json", "k.cubin", "k.ptx", "k.ttir"]), f"half group: {names}"
    res = subprocess.run([sys.executable, "-c", TRITON_GET, str(n)], env=env, capture_output=True, text=True,
                         check=True, timeout=120)
    groups = json.loads(res.stdout)
    assert set(map(str, range(n))) == set(groups)
    kept = [g for g in groups.values() if g is not None]
    assert 0 < len(kept) < n
    assert all(g == ["k.cubin", "k.ptx", "k.ttir"] for g in kept)


def test_recency_survives_remount(mount_factory: MountFactory):
    m = mount_factory("rec", "--max-size", "100M", "--min-age", "0")
    d = m.mountpoint
    write_files(d, ["a", "b", "c"])
    time.sleep(0.05)
    t_touch = time.time_ns()
    (d / "a").read_bytes()  # a: written first, used last
    m.remount()
    assert (d / "a").stat().st_atime_ns >= t_touch - 10_000_000
    run_cli("gc", str(d), "--to", str(200 * K), check=True)
    assert sorted(os.listdir(d)) == ["a", "c"]


def test_idle_ttl_evicts_unused_files_under_budget(mount_factory: MountFactory):
    m = mount_factory("ttl", "--idle-ttl", "2s", "--min-age", "0")
    d = m.mountpoint
    write_files(d, ["idle", "busy"], size=10 * K)
    deadline = time.monotonic() + 6
    while time.monotonic() < deadline:
        (d / "busy").read_bytes()
        time.sleep(0.2)
    assert sorted(os.listdir(d)) == ["busy"]
    assert m.stats()["evictions"] == 1


def test_min_entries_is_a_floor(mount_factory: MountFactory):
    m = mount_factory("floor", "--min-entries", "3", "--min-age", "0")
    write_files(m.mountpoint, [f"f{i}" for i in range(6)], size=10 * K)
    out = run_cli("gc", str(m.mountpoint), "--to", "0", check=True)
    assert out.stdout.startswith("evicted 3 files,")
    assert sorted(os.listdir(m.mountpoint)) == ["f3", "f4", "f5"]


def test_gc_to_size_and_report(mount_factory: MountFactory):
    m = mount_factory("gc", "--min-age", "0")
    data = write_files(m.mountpoint, [f"f{i}" for i in range(10)])
    out = run_cli("gc", str(m.mountpoint), "--to", "500K", check=True)
    wait_for(lambda: store_bytes(m.store) <= 500 * K, 10, "the evicted blobs to go")
    assert out.stdout.startswith("evicted 5 files, 500.0 KiB")
    for name in os.listdir(m.mountpoint):
        assert (m.mountpoint / name).read_bytes() == data[name]
    events = m.stats()
    assert events["evictions"] == 5 and events["evicted_bytes"] == 500 * K


def test_gc_bad_input(mnt, tmp_path):
    res = run_cli("gc", str(mnt.mountpoint), "--to", "lots")
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1
    res = run_cli("gc", str(tmp_path))
    assert res.returncode == 2 and "not a mithrilfs mount" in res.stderr


def test_bad_budget_options(tmp_path):
    (tmp_path / "mp").mkdir()
    for args, needle in (
        (["--max-size", "ten gigs"], "invalid size"),
        (["--max-size", "0"], "positive"),
        (["--high-watermark", "150%"], "between"),
        (["--high-watermark", "80%", "--low-watermark", "90%"], "watermarks"),
        (["--idle-ttl", "soon"], "invalid duration"),
        (["--min-entries", "-1"], "invalid count"),
    ):
        res = run_cli("mount", str(tmp_path / "mp"), "--store", str(tmp_path / "s"), *args)
        assert res.returncode == 2, (args, res.stderr)
        assert needle in res.stderr and len(res.stderr.strip().splitlines()) == 1
    assert not (tmp_path / "s").exists()


def left_whole(m: Mount, data: dict[str, bytes]) -> list[str]:
    """The files eviction left in the mount's root, each checked to read back as it was written."""
    left = os.listdir(m.mountpoint)
    for name in left:
        assert (m.mountpoint / name).read_bytes() == data[name]
    return left


@pytest.fixture
def small_disk(tmpfs):
    """A 4 MiB disk for the store, so the backing disk fills before the budget."""
    return tmpfs("4m")


def test_full_backing_disk_evicts_and_retries(mount_factory: MountFactory, small_disk: Path):
    m = mount_factory("full", "--max-size", "1G", "--min-age", "0", store=small_disk / "store")
    data = {}
    for i in range(40):  # 8 MiB through a 4 MiB disk
        data[f"f{i}"] = os.urandom(200 * K)
        write_committed(m.mountpoint / f"f{i}", data[f"f{i}"])
    left = left_whole(m, data)
    assert "f39" in left and len(left) < 40
    assert m.stats()["evictions"] > 0


def test_a_full_disk_waits_for_the_evicted_content_the_kernel_still_holds(mount_factory: MountFactory,
                                                                          small_disk: Path):
    """The slice a full disk evicts can be content the kernel still holds (open files here; inodes the
    kernel had cached and forgets a moment after the eviction's notification in the flake of the test
    above): it goes only at FORGET.  A write's retry waits for that room; it used to retry at once and
    fail with ENOSPC though the room was on its way.  The files are closed only once the daemon says it
    waits, so the test does not depend on who is quicker."""
    m = mount_factory("held", "--max-size", "1G", "--min-age", "0", store=small_disk / "store")
    data = write_files(m.mountpoint, [f"old{i}" for i in range(5)], size=400 * K)
    held = {name: os.open(m.mountpoint / name, os.O_RDONLY) for name in data}
    closed: list[str] = []
    stop = threading.Event()

    def close_the_evicted_while_the_daemon_waits() -> None:
        while held and not stop.wait(0.01):
            if m.stats()["full_disk_waits"]:
                for name in [n for n in held if not (m.mountpoint / n).exists()]:
                    os.close(held.pop(name))
                    closed.append(name)

    closer = threading.Thread(target=close_the_evicted_while_the_daemon_waits)
    closer.start()
    try:
        for i in range(12):  # 4.8 MiB more through a 4 MiB disk: the old files make room
            data[f"new{i}"] = os.urandom(400 * K)
            write_committed(m.mountpoint / f"new{i}", data[f"new{i}"])
    finally:
        stop.set()
        closer.join()
        for fd in held.values():
            os.close(fd)
    assert closed  # the daemon waited for evicted files the kernel held
    assert "new11" in left_whole(m, data)


def test_a_full_disk_waits_for_the_supervisor_to_let_go_of_files_just_written(mount_factory: MountFactory,
                                                                                small_disk: Path):
    """The supervisor holds a descriptor of every file being written (its staging content outlives a
    crash of the daemon) until the daemon's "committed" message reaches it: evicted content written a
    moment ago keeps its blocks until then.  Here the supervisor is stopped while the files are written,
    and let go on only once the daemon says it waits; the write used to fail with ENOSPC at once."""
    m = mount_factory("sup", "--max-size", "1G", "--min-age", "0", store=small_disk / "store")
    supervisor = supervisor_pid(m.mountpoint)
    assert supervisor is not None
    data: dict[str, bytes] = {}
    os.kill(supervisor, signal.SIGSTOP)
    try:
        data |= write_files(m.mountpoint, [f"old{i}" for i in range(5)], size=400 * K)
        waited = threading.Event()

        def resume_the_supervisor_once_the_daemon_waits() -> None:
            while not waited.is_set() and not m.stats()["full_disk_waits"]:
                time.sleep(0.01)
            waited.set()
            os.kill(supervisor, signal.SIGCONT)

        resumer = threading.Thread(target=resume_the_supervisor_once_the_daemon_waits)
        resumer.start()
        try:
            for i in range(6):  # 2.4 MiB more: the old files make room
                data[f"new{i}"] = os.urandom(400 * K)
                write_committed(m.mountpoint / f"new{i}", data[f"new{i}"])
            assert waited.is_set()  # the disk was full, and the daemon waited for the room
        finally:
            waited.set()
            resumer.join()
    finally:
        os.kill(supervisor, signal.SIGCONT)
    assert "new5" in left_whole(m, data)


def test_a_full_disk_does_not_wait_for_ever_for_files_kept_open(mount_factory: MountFactory, small_disk: Path):
    """Evicted files kept open never give their content back: the write waits a bounded time, then fails
    with ENOSPC (no silent hang), and the daemon says why; once they are closed, writes fit again."""
    m = mount_factory("kept", "--max-size", "1G", "--min-age", "0", store=small_disk / "store")
    data = write_files(m.mountpoint, [f"old{i}" for i in range(5)], size=400 * K)
    held = [os.open(m.mountpoint / name, os.O_RDONLY) for name in data]
    try:
        with pytest.raises(OSError) as failed:  # only the open files can make room for it
            write_committed(m.mountpoint / "big", os.urandom(2048 * K))
        assert failed.value.errno == errno.ENOSPC
        assert "the room evicting made has not come" in (m.store / "mithrilfs.log").read_text()
    finally:
        for fd in held:
            os.close(fd)
    wait_for(lambda: len(blob_files(m.store)) == len(os.listdir(m.mountpoint)), 20,
             "the evicted files' content to go once they are closed")
    again = write_files(m.mountpoint, ["again0", "again1"], size=400 * K)
    assert all((m.mountpoint / n).read_bytes() == d for n, d in again.items())


def test_unclean_stop_leaves_no_phantom_bytes(mount_factory: MountFactory):
    """After a kill -9 of the daemon and its supervisor (no takeover), the recovery at the next mount
    drops the idle-committed (unconfirmed) files and deletes their blobs: the budget must count what is
    left on disk, not what was there at the crash (it used to, and evicted files it had room for)."""
    m = mount_factory("phantom", "--max-size", str(4096 * K), "--min-age", "0")
    kept = write_files(m.mountpoint, ["kept0"], size=1024 * K)
    for name in ("dropped0", "dropped1"):  # closed, never confirmed: committed by the idle timer only
        (m.mountpoint / name).write_bytes(os.urandom(1024 * K))
    wait_for(lambda: len(blob_files(m.store)) == 3, 20, "the idle timer to commit the unconfirmed files")
    supervisor = supervisor_pid(m.mountpoint)
    assert supervisor is not None and m.pid is not None
    os.kill(supervisor, signal.SIGKILL)  # else it would take the mount over: this is an unclean stop
    os.kill(m.pid, signal.SIGKILL)
    wait_for(lambda: not os.path.exists(f"/proc/{m.pid}"), 20, "the daemon to die")
    m.pid = None
    m.mount()  # cleans the stale mount, recovers the store
    assert sorted(os.listdir(m.mountpoint)) == ["kept0"]
    s = m.stats()
    assert s["files"] == 1 and s["physical_bytes"] == store_bytes(m.store) == 1024 * K, s["physical_bytes"]
    # room for these within the budget: nothing may be evicted for bytes that are not there
    kept |= write_files(m.mountpoint, ["more0", "more1"], size=1024 * K)
    s = m.stats()
    assert s["evictions"] == 0 and s["physical_bytes"] == store_bytes(m.store) == 3072 * K
    assert sorted(os.listdir(m.mountpoint)) == sorted(kept)
    assert all((m.mountpoint / n).read_bytes() == d for n, d in kept.items())
