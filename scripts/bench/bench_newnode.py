"""A new node warm-starts from the shared tier: Triton kernels, node A local vs node B from the tier.

Node A writes N kernels in Triton's own layout (``bench_warmstart``'s
workload: 8 files a kernel) into a mount with ``--remote``; its uploads go
to a real redis-server on loopback (``--remote redis``), a real SeaweedFS
bucket (``--remote s3``), or Redis in front of the bucket (``--remote
redis+s3``).  Then, repeatedly and in rotating order:

- **A**: node A's own store, remounted, loads every kernel (its reads record
  the startup set, as a real workload's first minutes would);
- **B+prefetch**: node B, an empty store, mounts at A's path with
  ``--prefetch`` (the startup set, fetched before ``mount`` returns), then loads;
- **B lazy**: node B, an empty store, mounts and loads, fetching as Triton asks.

B mounts at A's path after A unmounted (Triton's group files hold absolute
paths; one node at a time needs no separate mount namespace).  Prints the
load times, the ratios to A, and the prefetch throughput.

    .venv/bin/python scripts/bench/bench_newnode.py --kernels 1500 --reps 2 --remote s3
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _benchlib import CLI, median, redis_server, seaweedfs_s3
from bench_warmstart import LOAD, POPULATE, run_json

#: The mount's --remote arguments and the AWS variables, set once the servers run.
REMOTE: list[str] = []
ENV: dict[str, str] = {}


def mount(mp: Path, store: Path, *extra: str) -> str:
    res = subprocess.run([*CLI, "mount", str(mp), "--store", str(store), *REMOTE, "--min-age", "0", *extra],
                         capture_output=True, text=True, env=dict(os.environ, **ENV))
    if res.returncode != 0:
        sys.exit(f"mount failed: {res.stderr}")
    return res.stderr


def umount(mp: Path) -> None:
    subprocess.run([*CLI, "umount", str(mp)], check=True, capture_output=True)


def drained(mp: Path) -> None:
    while json.loads((mp / ".mithrilfs" / "stats.json").read_text())["upload_queue"]:
        time.sleep(0.1)


def used_memory(url: str) -> int:
    info = subprocess.run(["redis-cli", "-u", url, "INFO", "memory"], capture_output=True, text=True).stdout
    return int(info.split("used_memory:")[1].split()[0])


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernels", type=int, default=1500)
    ap.add_argument("--reps", type=int, default=2)
    ap.add_argument("--remote", choices=("redis", "s3", "redis+s3"), default="redis",
                    help="the shared tier: Redis, a SeaweedFS bucket, or Redis in front of the bucket")
    ap.add_argument("--base", default=None, metavar="DIR",
                    help="where the stores and the mount point go (default: the temp dir); /dev/shm takes the"
                         " disk's file creation out of the figures")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    times: dict[str, list[float]] = {"A": [], "B+prefetch": [], "B lazy": []}
    prefetch_mb_s: list[float] = []
    prefetch_s: list[float] = []
    with contextlib.ExitStack() as servers, tempfile.TemporaryDirectory(prefix="mithrilfs-bench-newnode-",
                                                                           dir=args.base) as tmp:
        if "redis" in args.remote:
            REMOTE.extend(["--remote", servers.enter_context(redis_server())])
        if "s3" in args.remote:
            ENV.update(servers.enter_context(seaweedfs_s3()))
            REMOTE.extend(["--remote", "s3://bench/newnode"])
        base = Path(tmp)
        mp = base / "mnt"
        mp.mkdir()
        keys_file = base / "keys.json"
        mount(mp, base / "store-a")
        t = time.monotonic()
        keys = run_json(POPULATE, [str(args.kernels), str(random.randrange(1 << 30))], mp / "triton")
        keys_file.write_text(json.dumps(keys))
        drained(mp)
        umount(mp)
        print(f"{args.kernels} kernels written and uploaded by node A in {time.monotonic() - t:.1f} s", flush=True)
        redis_url = next((r for r in REMOTE if r.startswith("redis://")), None)
        redis_memory = None if redis_url is None else used_memory(redis_url)
        names_only = None
        if redis_url is not None and args.remote == "redis+s3":
            # Redis in front of the bucket keeps blobs HOT_TTL after their last use: once that passed
            # for all of them, Redis holds the names alone (the bucket serves the blobs, filling Redis again)
            import redis

            client = redis.Redis.from_url(redis_url)
            for key in client.scan_iter(match="mfs:*:b:*", count=1000):
                client.delete(key)
            names_only = used_memory(redis_url)
        order = ["A", "B+prefetch", "B lazy"]
        for rep in range(args.reps):
            for node in order if rep % 2 == 0 else ["A", *reversed(order[1:])]:
                if node == "A":
                    mount(mp, base / "store-a")
                elif node == "B+prefetch":
                    out = mount(mp, base / f"store-b{rep}p", "--prefetch")
                    m = re.search(r"prefetched (\d+) files, .* in ([\d.]+) s \(([\d.]+) (\w+)/s\)", out)
                    if m is None:
                        sys.exit(f"no prefetch summary: {out}")
                    rate = float(m.group(3)) * {"B": 1e-6, "KiB": 1024 / 1e6, "MiB": 1.048576, "GiB": 1073.741824}[
                        m.group(4)]
                    prefetch_mb_s.append(rate)
                    prefetch_s.append(float(m.group(2)))
                    print(f"rep {rep} prefetch: {out.strip()}", flush=True)
                else:
                    mount(mp, base / f"store-b{rep}l")
                try:
                    run = run_json(LOAD, [str(keys_file)], mp / "triton")
                finally:
                    umount(mp)
                times[node].append(run["seconds"])
                print(f"rep {rep} {node:10s} load {run['seconds']:7.2f} s", flush=True)
    a = median(times["A"])
    result = {"remote": args.remote, "kernels": args.kernels, "files": args.kernels * 8,
              **{k: {"median_s": round(median(v), 3), "runs": [round(x, 3) for x in v]} for k, v in times.items()},
              "prefetch_ratio": round(median(times["B+prefetch"]) / a, 2),
              "lazy_ratio": round(median(times["B lazy"]) / a, 2),
              "prefetch_seconds": round(median(prefetch_s), 2), "prefetch_mb_s": round(median(prefetch_mb_s), 1),
              "redis_used_memory": redis_memory, "redis_names_only_memory": names_only}
    if args.json:
        print(json.dumps(result))
        return 0
    print(f"\n{args.kernels} kernels ({args.kernels * 8} files) through {args.remote}: load, median of {args.reps}")
    print(f"node A (its own store, remounted)   {median(times['A']):7.2f} s")
    print(f"node B after mount --prefetch       {median(times['B+prefetch']):7.2f} s  = {result['prefetch_ratio']:.2f}x A"
          f"  (target 1.2x); the prefetch itself {result['prefetch_seconds']:.1f} s,"
          f" {result['prefetch_mb_s']:.0f} MB/s (target 100)")
    print(f"node B lazy (no prefetch)           {median(times['B lazy']):7.2f} s  = {result['lazy_ratio']:.2f}x A"
          f"  (target 2x)")
    if redis_memory is not None:
        print(f"Redis memory after node A's upload  {redis_memory / 1e6:7.1f} MB"
              + (f"; {names_only / 1e6:.1f} MB once the blobs' time to live passed (names only)"
                 if names_only is not None else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())
