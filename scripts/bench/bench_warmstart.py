"""Warm start of many Triton kernels: the mount against a plain directory, ABBA order.

A model with many Triton kernels warm-starts by asking Triton's cache for
each kernel: ``FileCacheManager(key).get_group(...)`` stats the group file,
reads it, stats every child it lists, and then every child file is read
(what ``triton.compiler.compile`` and ``CompiledKernel`` do on a hit).  This
script writes N kernels in Triton's own layout with Triton's own
``FileCacheManager`` (source, ttir, ttgir, llir, ptx and cubin of 20-70 KB,
the metadata json and the group file: 8 files a kernel), then loads them in
a fresh process, the same way, on both sides:

- first load after a remount (the plain side: dentries, inodes and their
  pages dropped with ``drop_caches``, which needs root),
- a second load right after.

Prints the median seconds per side, the ratio mount/plain and the spread;
then, for the mount, the requests that reached the daemon in each load by
opcode and the daemon's time on them (from ``stats.json`` before and after
each load), so a regression shows where it is; then the protocol floor:
one bare round trip on this machine (a tight loop of the TCGETS ioctl
Python's ``open()`` sends, answered ENOSYS from the daemon's dispatch table,
minus the same loop on the plain side) times the requests a load sends,
plus the plain side's time: no daemon doing no work at all could do better.
For the first load, a second floor adds what the mount must do besides
(integrity: a blob is verified before the kernel gets it): every blob of the
store read and hashed once, timed in a loop here (``verify_pass``).

    .venv/bin/python scripts/bench/bench_warmstart.py [--kernels 1500] [--reps 3] [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _benchlib import CLI, abba, cpu_wakeup_note, ratios, request_times, requests_between, round_trip_us, temp_mount

from mithrilfs.store.cas import hash_bytes

SUFFIXES = ("source", "ttir", "ttgir", "llir", "ptx", "cubin")

POPULATE = r"""
import json, os, random, sys
from triton.runtime.cache import FileCacheManager
n, seed = int(sys.argv[1]), int(sys.argv[2])
rnd = random.Random(seed)
keys = []
for i in range(n):
    key = format(rnd.getrandbits(256), "064x")
    mgr = FileCacheManager(key)
    group = {}
    for suffix in %(suffixes)r:
        size = rnd.randrange(20_000, 70_000)
        data = rnd.randbytes(size)
        group[f"kernel.{suffix}"] = mgr.put(data if suffix == "cubin" else data.hex()[:size], f"kernel.{suffix}")
    meta = {"name": f"kernel_{i}", "num_warps": 4, "num_stages": 3, "shared": 1024 * (i %% 64), "hash": key}
    group["kernel.json"] = mgr.put(json.dumps(meta), "kernel.json", binary=False)
    mgr.put_group("kernel.json", group)
    keys.append(key)
print(json.dumps(keys))
""" % {"suffixes": SUFFIXES}  # noqa: UP031 (a script template: its own braces stay)

LOAD = r"""
import json, sys, time
from triton.runtime.cache import FileCacheManager
keys = json.load(open(sys.argv[1]))
t = time.perf_counter()
total = 0
for key in keys:
    group = FileCacheManager(key).get_group("kernel.json")
    if group is None:
        sys.exit(f"kernel {key} is not in the cache")
    for name, path in group.items():
        with open(path, "rb") as f:
            total += len(f.read())
print(json.dumps({"seconds": time.perf_counter() - t, "bytes": total, "files": len(keys) * 8}))
"""


def run_json(code: str, args: list[str], cache: Path) -> dict:
    env = dict(os.environ, TRITON_CACHE_DIR=str(cache))
    res = subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True, timeout=3600)
    if res.returncode != 0:
        sys.exit(f"benchmark step failed:\n{res.stderr[-2000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def drop_plain_caches() -> None:
    """Forget cached dentries, inodes and their pages, as a remount does for the mount."""
    os.sync()
    try:
        with open("/proc/sys/vm/drop_caches", "w") as f:
            f.write("2\n")
    except OSError as e:
        sys.exit(f"cannot drop the kernel's caches ({e.strerror}): run as root")


def remount(mp: Path) -> None:
    """Unmount and mount again (``temp_mount`` keeps the store beside the mount point)."""
    subprocess.run([*CLI, "umount", str(mp)], check=True)
    subprocess.run([*CLI, "mount", str(mp), "--store", str(mp.parent / "store")], check=True)


def verify_pass(objects: Path) -> tuple[int, float]:
    """Every blob file under *objects* opened, read whole and hashed as the daemon verifies a small blob
    (``Blobs._read_whole``, ``hash_bytes``; not ``hash_file``, whose ``stat`` and buffered file object the
    daemon does not pay): count, seconds."""
    paths = [str(p) for p in objects.glob("??/*")]
    start = time.perf_counter()
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            hash_bytes(os.read(fd, os.fstat(fd).st_size))
        finally:
            os.close(fd)
    return len(paths), time.perf_counter() - start


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernels", type=int, default=1500)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()

    times: dict[str, dict[str, list[float]]] = {s: {"first": [], "second": []} for s in ("plain", "mount")}
    daemon: dict[str, list[dict[str, list[float]]]] = {"first": [], "second": []}
    with temp_mount() as (mp, plain):
        caches = {"plain": plain / "triton", "mount": mp / "triton"}
        keys_file = mp.parent / "keys.json"
        seed = random.randrange(1 << 30)
        for cache in caches.values():
            keys = run_json(POPULATE, [str(args.kernels), str(seed)], cache)
            keys_file.write_text(json.dumps(keys))
        if not args.json:
            print(f"{args.kernels} kernels ({args.kernels * 8} files) written on both sides", flush=True)
        for rep, order in enumerate(abba(args.reps)):
            for side in order:
                if side == "mount":
                    remount(mp)
                else:
                    drop_plain_caches()
                for phase in ("first", "second"):
                    before = request_times(mp) if side == "mount" else {}
                    run = run_json(LOAD, [str(keys_file)], caches[side])
                    times[side][phase].append(run["seconds"])
                    if side == "mount":
                        daemon[phase].append(requests_between(before, request_times(mp)))
                    if not args.json:
                        print(f"rep {rep} {side:5s} {phase:6s} load {run['seconds']:7.3f} s", flush=True)
        transport = json.loads((mp / ".mithrilfs" / "stats.json").read_text()).get("transport", "/dev/fuse read/write")
        some_file = next(p for p in sorted(caches["mount"].rglob("*")) if p.is_file())
        trips = round_trip_us(some_file, caches["plain"] / some_file.relative_to(caches["mount"]))
        passes = [verify_pass(mp.parent / "store" / "objects") for _ in range(3)]
    result = ratios(times, ("first", "second"))
    per_op = {phase: median_requests(runs) for phase, runs in daemon.items()}
    rt = statistics.median(trips)
    floor = {}
    for phase, ops in per_op.items():
        sent = sum(n for op, (n, _) in ops.items() if op != "AFTER_REPLY")
        plain_s = result[phase]["plain_s"]
        floor[phase] = {"requests": sent, "seconds": plain_s + sent * rt / 1e6,
                        "ratio": (plain_s + sent * rt / 1e6) / plain_s}
    blobs, verify_s = passes[0][0], statistics.median(s for _, s in passes)
    verified = floor["first"]["seconds"] + verify_s
    floor["first_verified"] = {"blobs": blobs, "verify_seconds": verify_s, "seconds": verified,
                               "ratio": verified / result["first"]["plain_s"]}
    if args.json:
        print(json.dumps({"kernels": args.kernels, "cpuidle": cpu_wakeup_note(), "transport": transport, **result,
                          "daemon": per_op,
                          "round_trip_us": trips, "floor": floor}))
        return 0
    print(f"\n{args.kernels} kernels, {args.kernels * 8} files ({cpu_wakeup_note()}); requests served over {transport}")
    print(f"{'load':22s} {'runs':>4s} {'plain (s)':>10s} {'mount (s)':>10s} {'mount/plain':>12s}   quartiles plain | mount")
    for phase, label in (("first", "first after remount"), ("second", "second")):
        r = result[phase]
        (p1, p3), (m1, m3) = r["plain_iqr_s"], r["mount_iqr_s"]
        print(f"{label:22s} {r['runs']:4d} {r['plain_s']:10.3f} {r['mount_s']:10.3f} {r['ratio']:11.2f}x"
              f"   {p1:.3f}-{p3:.3f} | {m1:.3f}-{m3:.3f}")
    print("\nrequests that reached the daemon per load (median over the mount's loads)")
    print(f"{'load':8s} {'opcode':12s} {'requests':>9s} {'daemon (s)':>11s} {'us each':>8s}")
    for phase, ops in per_op.items():
        for op, (n, secs) in ops.items():
            print(f"{phase:8s} {op:12s} {n:9.0f} {secs:11.3f} {secs / n * 1e6 if n else 0:8.1f}")
        total_n = sum(n for n, _ in ops.values())
        total_s = sum(s for _, s in ops.values())
        print(f"{phase:8s} {'all':12s} {total_n:9.0f} {total_s:11.3f}")
    print(f"\nprotocol floor: a bare round trip (TCGETS ioctl, mount minus plain) {rt:.1f} us "
          f"(runs {', '.join(f'{t:.1f}' for t in trips)}); plain + requests x round trip:")
    for phase in ("first", "second"):
        f = floor[phase]
        print(f"{phase:8s} {f['requests']:6.0f} requests  floor {f['seconds']:.3f} s = {f['ratio']:.2f}x plain"
              f"   (measured {result[phase]['ratio']:.2f}x)")
    f = floor["first_verified"]
    print(f"first, with each of the store's {f['blobs']} blobs read and hashed once (a blob is verified before the"
          f" kernel gets it; {f['verify_seconds']:.3f} s a pass here, median of {len(passes)}):"
          f" floor {f['seconds']:.3f} s = {f['ratio']:.2f}x plain")
    return 0


def median_requests(runs: list[dict[str, list[float]]]) -> dict[str, list[float]]:
    """Per opcode, the median request count and daemon seconds over the runs (most time first)."""
    ops = {op for run in runs for op in run}
    out = {op: [statistics.median(run.get(op, [0, 0.0])[i] for run in runs) for i in (0, 1)] for op in ops}
    return dict(sorted(out.items(), key=lambda kv: -kv[1][1]))


if __name__ == "__main__":
    sys.exit(main())
