#!/usr/bin/env python3
"""Filesystem micro-benchmarks: the mount vs a plain directory, side by side in one run.

Each benchmark runs the same Python loop on a plain directory (on the same
backing filesystem as the store) and on the mount, interleaved in ABBA order
over --reps repetitions; medians and the mount/plain ratio of ops/s are
printed (1.0 = as fast as plain; higher is better).

    .venv/bin/python scripts/bench/bench_fs.py [--reps 5] [--json] [--big-mib 256] [--million]
    .venv/bin/python scripts/bench/bench_fs.py --many 10000 [--reps 4]

Steady-state benchmarks run after one warm-up pass (names already seen by
the kernel).  First-touch latencies are taken right after a fresh mount.
--many N runs only the many-small-files test (N files created in one
directory with write + close, and with tmp + rename, then ``find``).
--million also builds a store of 1,000,000 files (directly through the
index, since writing them through FUSE takes long) and measures mount time,
daemon RSS and first-touch lookup latency on it.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import shutil
import stat as stat_mod
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

from _benchlib import CLI, abba, median, quartiles, request_times, requests_between, round_trip_us, temp_mount

N_FILES = 2000
SMALL = 4096


def _populate(d: Path, n: int = N_FILES) -> list[Path]:
    d.mkdir(parents=True, exist_ok=True)
    paths = [d / f"f{i:05d}.bin" for i in range(n)]
    for i, p in enumerate(paths):
        p.write_bytes(i.to_bytes(4, "little") * (SMALL // 4))
    return paths


def _ops_per_s(fn: Callable[[], int]) -> float:
    t = time.perf_counter()
    n = fn()
    return n / (time.perf_counter() - t)


def bench_stat(paths: list[Path]) -> Callable[[], int]:
    def run() -> int:
        for p in paths:
            os.stat(p)
        return len(paths)
    return run


def bench_missing(d: Path) -> Callable[[], int]:
    names = [d / f"missing{i:05d}" for i in range(N_FILES)]

    def run() -> int:
        for p in names:
            os.path.exists(p)
        return len(names)
    return run


def bench_create_rename(d: Path) -> Callable[[], int]:
    d.mkdir(exist_ok=True)
    data = b"k" * SMALL
    counter = [0]

    def run() -> int:
        for i in range(500):
            counter[0] += 1
            tmp = d / f"tmp.{counter[0]}"
            with open(tmp, "wb") as f:
                f.write(data)
            os.replace(tmp, d / f"final{i % 50}")
        return 500
    return run


def _create_many(d: Path, n: int, *, rename: bool) -> None:
    """n small files of distinct content in one new directory, as Inductor and Triton write them:
    write + close (committed by the idle timer), or a temporary name renamed into place."""
    d.mkdir()
    for i in range(n):
        data = i.to_bytes(4, "little") * (SMALL // 4)
        final = d / f"f{i:06d}"
        with open(d / f"tmp.{i}" if rename else final, "wb") as f:
            f.write(data)
        if rename:
            os.replace(d / f"tmp.{i}", final)


def _daemon_cpu_s(pid: int, thread: int | None = None) -> float:
    """User + system CPU seconds the daemon (or one *thread* of it: its event loop's is its pid) has used so far."""
    path = f"/proc/{pid}/stat" if thread is None else f"/proc/{pid}/task/{thread}/stat"
    fields = Path(path).read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _settle(mp: Path, timeout: float = 120) -> None:
    """Wait until the daemon has committed every written file (the idle timer's work is done)."""
    deadline = time.monotonic() + timeout
    while json.loads((mp / ".mithrilfs" / "stats.json").read_text())["written_files"] and time.monotonic() < deadline:
        time.sleep(0.1)


def many_files(roots: dict[str, Path], n: int, reps: int) -> dict:
    """--many N: N files created in one directory (write + close, and tmp + rename), then ``find``
    over them; ABBA order, each repetition in a new directory.  The mount's side also reports the
    daemon's CPU per file, commits included (it waits for the idle commits before the next timing):
    steadier than wall time on a busy machine, where the backing disk's own create cost swings), and
    its event loop's (the rest is its threads', chiefly the blob files they make ahead: the disk's
    creates, which cost plain's side as much), the
    requests the kernel sent per file, and the protocol floor: plain's time plus a bare round trip per
    request (``round_trip_us``), the least any daemon could take."""
    mp = roots["mount"]
    pid = int((mp / ".mithrilfs" / "pid").read_text())
    kinds = ("create_write", "create_rename")
    secs: dict[str, dict[str, list[float]]] = {k: {"plain": [], "mount": []} for k in (*kinds, "find")}
    cpu: dict[str, list[float]] = {k: [] for k in kinds}
    loop: dict[str, list[float]] = {k: [] for k in kinds}
    sent: dict[str, list[float]] = {k: [] for k in kinds}
    for rep, order in enumerate(abba(reps)):
        for side in order:
            for kind in kinds:
                d = roots[side] / f"many-{kind}-{rep}"
                c0, l0, r0 = _daemon_cpu_s(pid), _daemon_cpu_s(pid, pid), request_times(mp)
                t = time.perf_counter()
                _create_many(d, n, rename=kind == "create_rename")
                secs[kind][side].append(time.perf_counter() - t)
                if side == "mount":
                    ops = requests_between(r0, request_times(mp))
                    sent[kind].append(sum(k for op, (k, _) in ops.items() if op != "AFTER_REPLY"))
                    _settle(mp)
                    cpu[kind].append(_daemon_cpu_s(pid) - c0)
                    loop[kind].append(_daemon_cpu_s(pid, pid) - l0)
            t = time.perf_counter()
            subprocess.run(["find", str(roots[side] / f"many-create_write-{rep}")], stdout=subprocess.DEVNULL,
                           check=True)
            secs["find"][side].append(time.perf_counter() - t)
    some = roots["mount"] / "many-create_write-0" / "f000000"
    trips = round_trip_us(some, roots["plain"] / some.relative_to(roots["mount"]))
    rt_s = median(trips) / 1e6
    res: dict = {"files": n, "round_trip_us": [round(x, 1) for x in trips]}
    for kind, by_side in secs.items():
        pl, mo = median(by_side["plain"]), median(by_side["mount"])
        res[kind] = {"plain_s": round(pl, 3), "mount_s": round(mo, 3), "ratio": round(mo / pl, 2),
                     "plain_runs": [round(x, 2) for x in by_side["plain"]],
                     "mount_runs": [round(x, 2) for x in by_side["mount"]],
                     "ratio_runs": [round(m / p, 2) for m, p in zip(by_side["mount"], by_side["plain"])]}
        if kind in cpu:
            res[kind]["daemon_cpu_us_per_file"] = round(median(cpu[kind]) / n * 1e6)
            # the rest is its threads': the blob files made ahead (the backing disk's creates), checkpoints
            res[kind]["event_loop_cpu_us_per_file"] = round(median(loop[kind]) / n * 1e6)
            # the protocol floor: plain's time plus a bare round trip for each request the kernel sent
            floor_s = pl + median(sent[kind]) * rt_s
            res[kind].update(requests_per_file=round(median(sent[kind]) / n, 2), floor=round(floor_s / pl, 2))
    return res


def bench_open_read(paths: list[Path]) -> Callable[[], int]:
    def run() -> int:
        for p in paths:
            with open(p, "rb") as f:
                f.read()
        return len(paths)
    return run


def bench_open_read_one(path: Path) -> Callable[[], int]:
    """One cached 4 KiB file opened, read and closed in a loop (os calls: no isatty ioctl)."""
    def run() -> int:
        for _ in range(5000):
            fd = os.open(path, os.O_RDONLY)
            os.read(fd, 8192)
            os.close(fd)
        return 5000
    return run


def bench_python_open_read_one(path: Path) -> Callable[[], int]:
    """The same file through Python's ``open()``, which also asks ``isatty`` (an ioctl FUSE forwards)."""
    def run() -> int:
        for _ in range(2000):
            with open(path, "rb") as f:
                f.read()
        return 2000

    return run


def measure_pair(reps: int, make: Callable[[Path], Callable[[], int]], roots: dict[str, Path]) -> dict:
    fns = {side: make(root) for side, root in roots.items()}
    for fn in fns.values():
        fn()  # warm-up: steady state
    results: dict[str, list[float]] = {"plain": [], "mount": []}
    for order in abba(reps):
        for side in order:
            results[side].append(_ops_per_s(fns[side]))
    p, m = median(results["plain"]), median(results["mount"])
    return {"plain_ops_s": round(p), "mount_ops_s": round(m), "ratio": round(m / p, 3),
            "plain_iqr": [round(q) for q in quartiles(results["plain"])],
            "mount_iqr": [round(q) for q in quartiles(results["mount"])]}


def _percentile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(q * len(xs)))]


def first_touch(mp: Path, store: Path, rel_paths: list[str]) -> dict:
    """Latency of lookups and first reads of names the kernel has not seen: right after a fresh mount.

    The open itself never reaches the daemon (the kernel opens files); the
    first read does, and it re-hashes the blob.
    """
    subprocess.run([*CLI, "umount", str(mp)], check=True)
    subprocess.run([*CLI, "mount", str(mp), "--store", str(store)], check=True)
    lookups, opens = [], []
    half = len(rel_paths) // 2
    for rel in rel_paths[:half]:
        t = time.perf_counter_ns()
        os.stat(mp / rel)
        lookups.append((time.perf_counter_ns() - t) / 1000)
    for rel in rel_paths[half:]:
        p = mp / rel
        os.stat(p)  # lookup first, so the open and first read alone are timed
        t = time.perf_counter_ns()
        fd = os.open(p, os.O_RDONLY)
        os.read(fd, 4096)
        os.close(fd)
        opens.append((time.perf_counter_ns() - t) / 1000)
    daemon = _daemon_latency(mp)
    return {"lookup_p50_us": round(_percentile(lookups, 0.5), 1), "lookup_p99_us": round(_percentile(lookups, 0.99), 1),
            "open_p50_us": round(_percentile(opens, 0.5), 1), "open_p99_us": round(_percentile(opens, 0.99), 1),
            "daemon_lookup_p99_us": daemon["lookup"]["p99"], "daemon_open_p99_us": daemon["read"]["p99"]}


def _daemon_latency(mp: Path) -> dict:
    """The daemon's own view (request in to reply out): what is left of a client-side
    latency beyond it is the kernel's and the scheduler's (wake-ups on a busy VM)."""
    return json.loads((mp / ".mithrilfs" / "stats.json").read_text())["latency_us"]


def _drop_file_cache(p: Path) -> None:
    """Make the next read come from disk on both sides: for the mount that means
    the kernel's FUSE pages *and* the blob's pages in the store, so as root
    drop the whole page cache; otherwise drop what fadvise can reach."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("1")
        return
    except OSError:
        pass
    fd = os.open(p, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def big_file(roots: dict[str, Path], mib: int, reps: int) -> dict:
    chunk = os.urandom(1 << 20)
    out: dict[str, dict[str, list[float]]] = {s: {"write": [], "first_read": [], "repeat_read": []} for s in roots}
    for order in abba(reps):
        for side in order:
            p = roots[side] / "big.bin"
            t = time.perf_counter()
            with open(p, "wb") as f:
                for _ in range(mib):
                    f.write(chunk)
            out[side]["write"].append(mib / (time.perf_counter() - t))
            _drop_file_cache(p)
            for phase in ("first_read", "repeat_read"):
                t = time.perf_counter()
                with open(p, "rb") as f:
                    while f.read(1 << 20):
                        pass
                out[side][phase].append(mib / (time.perf_counter() - t))
            os.unlink(p)
    res = {}
    for phase in ("write", "first_read", "repeat_read"):
        pl, mo = median(out["plain"][phase]), median(out["mount"][phase])
        res[phase] = {"plain_mib_s": round(pl), "mount_mib_s": round(mo), "ratio": round(mo / pl, 3),
                      "plain_runs": [round(x) for x in out["plain"][phase]],
                      "mount_runs": [round(x) for x in out["mount"][phase]]}
    return res


def _touch_pages(fd: int) -> int:
    """Map the open file *fd* read-only and touch every page (one byte a page)."""
    with mmap.mmap(fd, 0, prot=mmap.PROT_READ) as m:
        return len(m[::mmap.PAGESIZE])


_libc = ctypes.CDLL(None, use_errno=True)
_libc.mmap.restype = ctypes.c_void_p
_libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
_libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]


def _touch_pages_no_fstat(fd: int, size: int, pmd: list[int] | None = None) -> int:
    """As ``_touch_pages``, without the ``fstat`` Python's ``mmap`` makes (``mmap(2)`` through ctypes).

    On the mount with passthrough that ``fstat`` costs a GETATTR round trip (each passthrough map marks
    the inode's atime stale), so this is the mapping alone.  *pmd*, when given, gets the kilobytes of
    the mapping the kernel mapped with 2 MiB entries (``FilePmdMapped`` in smaps).
    """
    addr = _libc.mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
    if addr in (None, ctypes.c_void_p(-1).value):
        raise OSError(ctypes.get_errno(), "mmap")
    try:
        n = len(memoryview((ctypes.c_char * size).from_address(addr)).cast("B")[::mmap.PAGESIZE].tobytes())
        if pmd is not None:
            pmd.append(_pmd_mapped_kib(addr))
        return n
    finally:
        _libc.munmap(addr, size)


def _pmd_mapped_kib(addr: int) -> int:
    """``FilePmdMapped`` of this process's mapping at *addr* (kB)."""
    inside = False
    for line in Path("/proc/self/smaps").read_text().splitlines():
        if not line.split(" ", 1)[0].endswith(":"):  # a mapping's first line: "start-end perms ..."
            inside = line.startswith(f"{addr:x}-")
        elif inside and line.startswith("FilePmdMapped:"):
            return int(line.split()[1])
    return 0


def _open_mmap(p: Path) -> int:
    """Open *p*, map it and touch every page: what a program loading a file does."""
    with open(p, "rb") as f:
        return _touch_pages(f.fileno())


def _read_whole(p: Path, buf: bytearray) -> int:
    """Open *p* and read() all of it into *buf* (1 MiB at a time, no allocation)."""
    view, n = memoryview(buf), 0
    with open(p, "rb", buffering=0) as f:
        while k := f.readinto(view[n : n + (1 << 20)]):
            n += k
    return n


def committed_big(roots: dict[str, Path], mib: int, reps: int) -> dict:
    """A committed *mib* MiB file (written, fsynced, closed) read whole with the page cache warm, mount vs
    plain in ABBA order, milliseconds per read: ``mmap`` maps an already open file and touches every
    page, ``mmap_no_fstat`` the same without Python's ``fstat`` (the mapping alone: on the mount with
    passthrough that ``fstat`` is a GETATTR round trip), ``open_mmap`` opens it first (plus the open's
    and the ``fstat``'s round trips on the mount), ``read`` opens it and read()s it whole.  Each side's
    ``pmd_kib`` is how much of a mapping the kernel mapped with 2 MiB entries (large folios)."""
    data = os.urandom(mib << 20)
    paths = {}
    for side, root in roots.items():
        paths[side] = root / "committed.bin"
        with open(paths[side], "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
    buf = bytearray(mib << 20)
    fds = {str(p): os.open(p, os.O_RDONLY) for p in paths.values()}
    size = mib << 20
    ways: dict[str, Callable[[Path], int]] = {
        "mmap": lambda p: _touch_pages(fds[str(p)]),
        "mmap_no_fstat": lambda p: _touch_pages_no_fstat(fds[str(p)], size),
        "open_mmap": _open_mmap, "read": lambda p: _read_whole(p, buf)}
    res: dict = {}
    for way, fn in ways.items():
        for p in paths.values():
            fn(p)  # warm: the page cache (and the mount's verification of the blob)
        runs: dict[str, list[float]] = {"plain": [], "mount": []}
        for order in abba(max(4, reps * 4)):
            for side in order:
                t = time.perf_counter()
                fn(paths[side])
                runs[side].append((time.perf_counter() - t) * 1e3)
        pl, mo = median(runs["plain"]), median(runs["mount"])
        res[way] = {"plain_ms": round(pl, 2), "mount_ms": round(mo, 2), "ratio": round(pl / mo, 3),
                    "plain_iqr": [round(q, 2) for q in quartiles(runs["plain"])],
                    "mount_iqr": [round(q, 2) for q in quartiles(runs["mount"])]}
    for side, p in paths.items():
        pmd: list[int] = []
        _touch_pages_no_fstat(fds[str(p)], size, pmd)
        res.setdefault("pmd_kib", {})[side] = pmd[0]
    # the floor of the ``mmap`` row: plain's map plus the one round trip the mount cannot avoid, the
    # GETATTR at the ``fstat`` after a passthrough map (timed as the ``mmap`` row leaves it: right after one)
    after: dict[str, list[float]] = {"plain": [], "mount": []}
    for order in abba(max(4, reps * 4)):
        for side in order:
            fd = fds[str(paths[side])]
            _touch_pages_no_fstat(fd, size)
            t = time.perf_counter()
            os.fstat(fd)
            after[side].append((time.perf_counter() - t) * 1e6)
    extra_ms = max(0.0, median(after["mount"]) - median(after["plain"])) / 1e3
    res["fstat_after_map_us"] = {side: round(median(v), 1) for side, v in after.items()}
    res["mmap_floor"] = round(res["mmap"]["plain_ms"] / (res["mmap"]["plain_ms"] + extra_ms), 3)
    for fd in fds.values():
        os.close(fd)
    for p in paths.values():
        p.unlink()
    return res


def million(base: Path, n: int = 1_000_000) -> dict:
    """Build an n-file store through the index, then time mount, RSS and first-touch lookups."""
    from mithrilfs.store.open import open_store

    root = Path(tempfile.mkdtemp(prefix="mithrilfs-1m-", dir=base))
    store_dir, mp = root / "store", root / "mnt"
    mp.mkdir()
    store = open_store(store_dir)
    digest, _ = store.blobs.add_bytes(b"x" * 100)
    ns, db = store.ns, store.ns.db
    now = time.time_ns()
    with ns.txn():
        dirs = []
        for d in range(1000):
            node = ns.create_inode(stat_mod.S_IFDIR | 0o755, 0, 0, nlink=2)
            ns.link(1, f"d{d:03d}".encode(), node.id)
            dirs.append(node.id)
        first = db.execute("SELECT coalesce(max(id), 0) + 1 FROM inodes").fetchone()[0]
        db.executemany(
            "INSERT INTO inodes (id, mode, uid, gid, nlink, size, atime_ns, mtime_ns, ctime_ns, hash)"
            " VALUES (?, ?, 0, 0, 1, 100, ?, ?, ?, ?)",
            ((first + i, stat_mod.S_IFREG | 0o644, now, now, now, digest) for i in range(n)),
        )
        db.executemany(
            "INSERT INTO dentries (parent, name, inode) VALUES (?, ?, ?)",
            ((dirs[i % 1000], f"f{i}".encode(), first + i) for i in range(n)),
        )
        db.execute("UPDATE blobs SET refcount = ? WHERE hash = ?", (n, digest))
        ns.set_meta("clean", "1")
    store.close()
    t = time.perf_counter()
    subprocess.run([*CLI, "mount", str(mp), "--store", str(store_dir)], check=True)
    mount_s = time.perf_counter() - t
    try:
        pid = int((mp / ".mithrilfs" / "pid").read_text())
        import random

        rnd = random.Random(0)
        lat = []
        for _ in range(2000):
            i = rnd.randrange(n)
            t0 = time.perf_counter_ns()
            os.stat(mp / f"d{i % 1000:03d}" / f"f{i}")
            lat.append((time.perf_counter_ns() - t0) / 1000)
        daemon = _daemon_latency(mp)
        rss = 0
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) // 1024
    finally:
        subprocess.run([*CLI, "umount", str(mp)])
        shutil.rmtree(root, ignore_errors=True)
    return {"files": n, "mount_s": round(mount_s, 2), "daemon_rss_mib": rss,
            "first_touch_lookup_p50_us": round(_percentile(lat, 0.5), 1),
            "first_touch_lookup_p99_us": round(_percentile(lat, 0.99), 1),
            "daemon_lookup_p99_us": daemon["lookup"]["p99"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--big-mib", type=int, default=256, help="size of the large-file test (default 256)")
    ap.add_argument("--million", action="store_true", help="also run the 1,000,000-file namespace test")
    ap.add_argument("--many", type=int, metavar="N",
                    help="only the many-files test: N files created in one directory, both ways, and find")
    ap.add_argument("--json", action="store_true")
    ap.add_argument("--mount-option", action="append", default=[], metavar="ARG",
                    help="pass ARG to mount (e.g. --mount-option=--passthrough --mount-option=on)")
    args = ap.parse_args()

    results: dict = {}
    if args.many:
        with temp_mount("--max-size", "100G", *args.mount_option) as (mp, plain):
            results["many"] = many_files({"plain": plain, "mount": mp}, args.many, args.reps)
        if args.json:
            print(json.dumps(results))
            return 0
        r = results["many"]
        print(f"{r['files']} files in one directory, {args.reps} runs each (seconds; ratio mount/plain, per run)")
        print(f"protocol floor: a bare round trip (TCGETS ioctl, mount minus plain) {r['round_trip_us']} us")
        for kind in ("create_write", "create_rename", "find"):
            k = r[kind]
            cpu = (f"  daemon CPU {k['daemon_cpu_us_per_file']} us/file (event loop"
                   f" {k['event_loop_cpu_us_per_file']}), {k['requests_per_file']} requests/file,"
                   f" floor {k['floor']}x" if "daemon_cpu_us_per_file" in k else "")
            print(f"{kind:14s} plain {k['plain_s']:7.2f} s  mount {k['mount_s']:7.2f} s  {k['ratio']:6.2f}x"
                  f"  runs {k['ratio_runs']}  plain {k['plain_runs']} mount {k['mount_runs']}{cpu}")
        return 0
    with temp_mount(*args.mount_option) as (mp, plain):
        store = mp.parent / "store"
        roots = {"plain": plain, "mount": mp}
        files = {side: _populate(r / "cached") for side, r in roots.items()}
        results["stat"] = measure_pair(args.reps, lambda r: bench_stat(files["plain" if r == plain else "mount"]), roots)
        results["lookup_missing"] = measure_pair(args.reps, lambda r: bench_missing(r / "cached"), roots)
        results["create_rename_4k"] = measure_pair(args.reps, lambda r: bench_create_rename(r / "cr"), roots)
        results["open_read_close_4k"] = measure_pair(
            args.reps, lambda r: bench_open_read(files["plain" if r == plain else "mount"]), roots)
        results["same_file_orc_4k"] = measure_pair(
            args.reps, lambda r: bench_open_read_one(files["plain" if r == plain else "mount"][0]), roots)
        results["python_open_read_4k"] = measure_pair(
            args.reps, lambda r: bench_python_open_read_one(files["plain" if r == plain else "mount"][0]), roots)
        results["big_file"] = big_file(roots, args.big_mib, max(2, args.reps))
        results["committed_big"] = committed_big(roots, args.big_mib, args.reps)
        results["first_touch"] = first_touch(mp, store, [os.path.relpath(p, mp) for p in files["mount"]])
    if args.million:
        results["million"] = million(Path(tempfile.gettempdir()))

    if args.json:
        print(json.dumps(results))
        return 0
    print(f"{'benchmark':24s} {'plain':>12s} {'mount':>12s} {'mount/plain':>12s}   quartiles plain | mount (/s)")
    for name in ("stat", "lookup_missing", "create_rename_4k", "open_read_close_4k", "same_file_orc_4k",
                 "python_open_read_4k"):
        r = results[name]
        (p1, p3), (m1, m3) = r["plain_iqr"], r["mount_iqr"]
        print(f"{name:24s} {r['plain_ops_s']:>10d}/s {r['mount_ops_s']:>10d}/s {r['ratio']:>11.3f}x"
              f"   {p1}-{p3} | {m1}-{m3}")
    for phase, r in results["big_file"].items():
        print(f"{f'{args.big_mib}MiB ' + phase:24s} {r['plain_mib_s']:>8d}MiB/s {r['mount_mib_s']:>8d}MiB/s {r['ratio']:>11.3f}x"
              f"   runs: plain {r['plain_runs']} mount {r['mount_runs']}")
    for way, r in results["committed_big"].items():
        if way == "pmd_kib":
            print(f"{f'{args.big_mib}MiB mapped with 2 MiB entries':24s} plain {r['plain']} KiB, mount {r['mount']} KiB")
            continue
        if way == "fstat_after_map_us":
            print(f"{'fstat after a map':24s} plain {r['plain']} us, mount {r['mount']} us: the mmap row's floor"
                  f" {results['committed_big']['mmap_floor']}x (plain's map + that GETATTR)")
            continue
        if way == "mmap_floor":
            continue
        (p1, p3), (m1, m3) = r["plain_iqr"], r["mount_iqr"]
        print(f"{f'{args.big_mib}MiB committed ' + way:24s} {r['plain_ms']:>9.2f} ms {r['mount_ms']:>9.2f} ms"
              f" {r['ratio']:>11.3f}x   {p1}-{p3} | {m1}-{m3} (ms; ratio plain/mount time)")
    ft = results["first_touch"]
    print(f"first touch: lookup p50 {ft['lookup_p50_us']} us p99 {ft['lookup_p99_us']} us;"
          f" open+first read p50 {ft['open_p50_us']} us p99 {ft['open_p99_us']} us"
          f" (inside the daemon: lookup p99 {ft['daemon_lookup_p99_us']} us, read p99 {ft['daemon_open_p99_us']} us)")
    if "million" in results:
        mm = results["million"]
        print(f"1M files: mount {mm['mount_s']} s, daemon RSS {mm['daemon_rss_mib']} MiB, first-touch lookup"
              f" p50 {mm['first_touch_lookup_p50_us']} us p99 {mm['first_touch_lookup_p99_us']} us"
              f" (inside the daemon p99 {mm['daemon_lookup_p99_us']} us)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
