#!/usr/bin/env python3
"""The main job, end to end: mount on the default store, torch.compile cold, remount, warm.

    .venv/bin/python scripts/demo.py [--mountpoint DIR] [--store DIR]

Mounts mithrilfs (store: the platform cache dir unless --store), empties the
demo's own cache directory inside it so the first compile is really cold,
compiles a small model in a fresh process, unmounts and mounts again (so the
warm run is served from the store, not from memory), compiles again, shows
the cache's statistics and unmounts.
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from bench._benchlib import CLI, WORKLOADS, compile_env, run_json


def sh(*args: str) -> None:
    print("$ mithrilfs " + " ".join(args), flush=True)
    subprocess.run([*CLI, *args], check=True)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--mountpoint", type=Path, help="where to mount (default: a new temporary directory)")
    ap.add_argument("--store", type=Path, help="store directory (default: mithrilfs's platform cache dir)")
    args = ap.parse_args()
    temporary = args.mountpoint is None
    mp = args.mountpoint or Path(tempfile.mkdtemp(prefix="mithrilfs-demo-"))
    mp.mkdir(parents=True, exist_ok=True)
    store_args = ["--store", str(args.store)] if args.store else []
    workload = [sys.executable, str(WORKLOADS / "compile_workload.py")]

    sh("mount", str(mp), *store_args)
    try:
        cache = mp / "demo" / "inductor"
        shutil.rmtree(cache, ignore_errors=True)
        cold = run_json(workload, compile_env(cache))
        print(f"cold compile: {cold['seconds']:.2f} s, FX graph cache misses {cold['fxgraph_cache_miss']}", flush=True)
        sh("umount", str(mp))
        sh("mount", str(mp), *store_args)
        warm = run_json(workload, compile_env(cache))
        print(f"warm compile: {warm['seconds']:.2f} s, FX graph cache hits {warm['fxgraph_cache_hit']}", flush=True)
        same = "identical" if warm["output_sha"] == cold["output_sha"] else "DIFFERENT"
        print(f"outputs of the two runs: {same}; speed-up {cold['seconds'] / warm['seconds']:.1f}x")
        print()
        sh("stats", str(mp))
    finally:
        sh("umount", str(mp))
        if temporary:
            mp.rmdir()  # the demo's own mount point, empty again once unmounted
    return 0 if warm["fxgraph_cache_hit"] > 0 and same == "identical" else 1


if __name__ == "__main__":
    sys.exit(main())
