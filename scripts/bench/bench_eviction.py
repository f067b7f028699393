#!/usr/bin/env python3
"""Eviction at scale: N small files over budget, time to evict, daemon memory.

Writes N distinct small files into the mount (and the same into a plain
directory), then asks the daemon to evict half of them (``mithrilfs gc
--to``) and times it; as the reference, times deleting the same number of
files from the plain directory.  Prints files/s for both, their ratio, and
the daemon's peak RSS (VmHWM).

    .venv/bin/python scripts/bench/bench_eviction.py --files 100000 [--json]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

from _benchlib import CLI, temp_mount


def _populate(args: tuple[str, int, int, int]) -> None:
    root, start, stop, size = args
    base = Path(root)
    for i in range(start, stop):
        d = base / f"{i % 256:02x}"
        d.mkdir(exist_ok=True)
        (d / f"f{i}").write_bytes(i.to_bytes(8, "little") * (size // 8))


def populate(root: Path, n: int, size: int, workers: int = 4) -> float:
    t = time.perf_counter()
    chunks = [(str(root), k * n // workers, (k + 1) * n // workers, size) for k in range(workers)]
    with ProcessPoolExecutor(workers) as pool:
        list(pool.map(_populate, chunks))
    return time.perf_counter() - t


def vm_hwm_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1])
    return 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", type=int, default=100_000, help="number of files (default 100000)")
    ap.add_argument("--size", type=int, default=1024, help="bytes per file (default 1024)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    n, size = args.files, args.size
    with temp_mount("--min-age", "0") as (mp, plain):
        pid = int((mp / ".mithrilfs" / "pid").read_text())
        write_mount = populate(mp, n, size)
        write_plain = populate(plain, n, size)
        stats = json.loads((mp / ".mithrilfs" / "stats.json").read_text())
        target = stats["physical_bytes"] // 2

        t = time.perf_counter()
        out = subprocess.run([*CLI, "gc", str(mp), "--to", str(target)], capture_output=True, text=True, check=True)
        evict_s = time.perf_counter() - t
        after = json.loads((mp / ".mithrilfs" / "stats.json").read_text())
        evicted = after["evicted_files"]

        victims = sorted((plain / f"{i % 256:02x}" / f"f{i}" for i in range(evicted)), key=str)
        t = time.perf_counter()
        for p in victims:
            os.unlink(p)
        unlink_s = time.perf_counter() - t
        result = {
            "files": n,
            "file_bytes": size,
            "populate_s": {"mount": round(write_mount, 2), "plain": round(write_plain, 2)},
            "evicted_files": evicted,
            "evict_s": round(evict_s, 3),
            "evict_files_per_s": round(evicted / evict_s),
            "plain_unlink_s": round(unlink_s, 3),
            "ratio_evict_vs_unlink": round(unlink_s / evict_s, 3),
            "physical_before": stats["physical_bytes"],
            "physical_after": after["physical_bytes"],
            "daemon_peak_rss_mib": round(vm_hwm_kib(pid) / 1024, 1),
            "gc_output": out.stdout.strip(),
        }
    if args.json:
        print(json.dumps(result))
    else:
        for k, v in result.items():
            print(f"{k:24s} {v}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
