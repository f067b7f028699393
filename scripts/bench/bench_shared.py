"""The shared tier at scale, against a real redis-server on loopback.

Two measurements (issue 10):

* **Stall**: node B holds names it got from Redis; Redis then stalls for
  ``--stall`` seconds (``DEBUG SLEEP``).  B's ``stat`` of names it has, and a
  listing of a directory it knows, are timed during the stall next to the
  same on a plain directory: they must not wait on Redis.
* **Scale**: node A writes ``--files`` files (Triton-like: one directory per
  kernel, a few files each); time until its upload queue drains, Redis's
  memory, then node B (an empty store) lists the tree cold and reads every
  file, next to a plain directory holding the same files (ABBA order).

    .venv/bin/python scripts/bench/bench_shared.py --files 20000 --reps 2
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _benchlib import CLI, abba, median, redis_server


def mount(mp: Path, store: Path, url: str) -> None:
    subprocess.run([*CLI, "mount", str(mp), "--store", str(store), "--remote", url, "--min-age", "0"], check=True)


def umount(mp: Path) -> None:
    if subprocess.run([*CLI, "umount", str(mp)], capture_output=True).returncode != 0:
        subprocess.run(["fusermount3", "-u", "-z", str(mp)])


def stats(mp: Path) -> dict:
    return json.loads((mp / ".mithrilfs" / "stats.json").read_text())


def wait_drained(mp: Path, timeout: float = 1800) -> float:
    t = time.monotonic()
    while stats(mp)["upload_queue"]:
        if time.monotonic() - t > timeout:
            sys.exit("uploads did not drain")
        time.sleep(0.05)
    return time.monotonic() - t


def write_tree(root: Path, files: int, per_dir: int = 8) -> int:
    """Triton's layout: a directory per kernel with a few files; returns bytes written."""
    total = 0
    for i in range(files):
        d = root / "triton" / f"{i // per_dir:06x}"
        if i % per_dir == 0:
            d.mkdir(parents=True, exist_ok=True)
        data = os.urandom(512 + (i * 7919) % 12000)
        tmp = d / f".f{i % per_dir}.tmp"
        with open(tmp, "wb") as f:
            f.write(data)
        os.rename(tmp, d / f"f{i % per_dir}.bin")
        total += len(data)
    return total


def drop_caches() -> None:
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("3\n")
    except OSError:
        pass


def walk_and_read(root: Path) -> tuple[float, float, int]:
    """(seconds to list the tree, seconds to read every file, bytes read)."""
    t = time.perf_counter()
    paths = [Path(dp) / f for dp, _, fs in os.walk(root) for f in fs]
    listed = time.perf_counter() - t
    t = time.perf_counter()
    n = 0
    for p in paths:
        with open(p, "rb") as f:
            n += len(f.read())
    return listed, time.perf_counter() - t, n


def scale(args: argparse.Namespace, url: str, base: Path) -> dict:
    a_mp, a_store = base / "a-mnt", base / "a-store"
    plain = base / "plain"
    for d in (a_mp, plain):
        d.mkdir()
    mount(a_mp, a_store, url)
    try:
        t = time.monotonic()
        nbytes = write_tree(a_mp, args.files)
        wrote = time.monotonic() - t
        drained = wait_drained(a_mp)
        upload_s = time.monotonic() - t
    finally:
        umount(a_mp)
    write_tree(plain, args.files)
    mem = int(subprocess.run(["redis-cli", "-u", url, "INFO", "memory"], capture_output=True, text=True)
              .stdout.split("used_memory:")[1].split()[0])
    times: dict[str, dict[str, list[float]]] = {s: {"list": [], "read": []} for s in ("plain", "mount")}
    for rep, order in enumerate(abba(args.reps)):
        for side in order:
            drop_caches()
            if side == "plain":
                listed, read, n = walk_and_read(plain / "triton")
            else:
                b_mp, b_store = base / f"b{rep}-mnt", base / f"b{rep}-store"
                b_mp.mkdir()
                mount(b_mp, b_store, url)  # node B: an empty store
                try:
                    listed, read, n = walk_and_read(b_mp / "triton")
                finally:
                    umount(b_mp)
            if n != nbytes:
                sys.exit(f"{side}: read {n} bytes, expected {nbytes}")
            times[side]["list"].append(listed)
            times[side]["read"].append(read)
            print(f"rep {rep} {side:5s} list {listed:6.2f} s  read {read:6.2f} s", flush=True)
    out = {"files": args.files, "bytes": nbytes, "write_s": round(wrote, 2), "upload_done_s": round(upload_s, 2),
           "drain_after_write_s": round(drained, 2), "redis_used_memory": mem,
           "redis_bytes_per_file": round(mem / args.files)}
    for phase in ("list", "read"):
        p, m = median(times["plain"][phase]), median(times["mount"][phase])
        out[phase] = {"plain_s": round(p, 3), "mount_s": round(m, 3), "ratio": round(m / p, 2),
                      "mount_runs": [round(x, 2) for x in times["mount"][phase]]}
    out["read"]["mount_mb_s"] = round(nbytes / out["read"]["mount_s"] / 1e6, 1)
    return out


def timed_stats(paths: list[Path]) -> list[float]:
    lat = []
    for p in paths:
        t = time.perf_counter()
        os.stat(p)
        lat.append(time.perf_counter() - t)
    return lat


def stall(args: argparse.Namespace, url: str, base: Path) -> dict:
    a_mp, b_mp, plain = base / "sa-mnt", base / "sb-mnt", base / "s-plain"
    for d in (a_mp, b_mp, plain):
        d.mkdir()
    mount(a_mp, base / "sa-store", url)
    try:
        (a_mp / "k").mkdir()
        for i in range(args.stall_files):
            (a_mp / "k" / f"f{i}").write_bytes(b"x" * 100)
            (plain / f"f{i}").write_bytes(b"x" * 100)
        os.sync()
        subprocess.run([*CLI, "run", "--mount", str(a_mp), "--", "true"], capture_output=True)  # commit
        wait_drained(a_mp)
    finally:
        umount(a_mp)
    mount(b_mp, base / "sb-store", url)
    try:
        os.listdir(b_mp / "k")  # B now holds the names (placeholders), synced once
        names = [b_mp / "k" / f"f{i}" for i in range(args.stall_files)]
        plain_names = [plain / f"f{i}" for i in range(args.stall_files)]
        sleeper = threading.Thread(target=subprocess.run, args=(
            ["redis-cli", "-u", url, "DEBUG", "SLEEP", str(args.stall)],), kwargs={"capture_output": True})
        time.sleep(DIR_SYNC_WAIT)  # past the directory re-sync interval: a listing would ask Redis again
        drop_caches()  # the kernel forgets the entries: every stat is a LOOKUP to the daemon
        sleeper.start()
        time.sleep(0.2)
        t0 = time.perf_counter()
        mount_lat = timed_stats(names)
        t = time.perf_counter()
        os.listdir(b_mp / "k")
        list_s = time.perf_counter() - t
        stalled_for = time.perf_counter() - t0
        plain_lat = timed_stats(plain_names)
        sleeper.join()
    finally:
        umount(b_mp)
    return {"stall_s": args.stall, "names": len(names), "measured_within_s": round(stalled_for, 3),
            "mount_stat_median_us": round(statistics.median(mount_lat) * 1e6, 1),
            "mount_stat_max_ms": round(max(mount_lat) * 1e3, 2),
            "plain_stat_median_us": round(statistics.median(plain_lat) * 1e6, 1),
            "mount_listing_ms": round(list_s * 1e3, 2)}


DIR_SYNC_WAIT = 5.5


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--files", type=int, default=20000)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--stall", type=float, default=10.0)
    ap.add_argument("--stall-files", type=int, default=2000)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    with redis_server() as url, tempfile.TemporaryDirectory(prefix="mithrilfs-bench-shared-") as tmp:
        base = Path(tmp)
        result = {"stall": stall(args, url, base)}
        print(json.dumps(result["stall"]), flush=True)
        result["scale"] = scale(args, url, base)
    if args.json:
        print(json.dumps(result))
        return
    st, sc = result["stall"], result["scale"]
    print(f"\nRedis stalled {st['stall_s']:.0f} s: node B stat of {st['names']} names it holds: median "
          f"{st['mount_stat_median_us']:.0f} us, max {st['mount_stat_max_ms']:.1f} ms (plain median "
          f"{st['plain_stat_median_us']:.0f} us); listing their directory {st['mount_listing_ms']:.1f} ms")
    print(f"{sc['files']} files, {sc['bytes'] / 1e6:.0f} MB: written in {sc['write_s']:.1f} s, all uploaded after "
          f"{sc['upload_done_s']:.1f} s; Redis uses {sc['redis_used_memory'] / 1e6:.0f} MB "
          f"({sc['redis_bytes_per_file']} B per file)")
    for phase in ("list", "read"):
        r = sc[phase]
        print(f"node B cold {phase:4s}: {r['mount_s']:6.2f} s vs plain {r['plain_s']:6.2f} s = {r['ratio']:.1f}x"
              f"  (runs {r['mount_runs']})")
    print(f"node B cold read throughput: {sc['read']['mount_mb_s']} MB/s")


if __name__ == "__main__":
    main()
