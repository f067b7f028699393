#!/usr/bin/env python3
"""Real Triton kernels on a GPU, cold then warm, cache on a plain directory vs on the mount.

Each repetition runs scripts/triton_gpu_workload.py (autotuned matmul and
softmax at several shapes) in fresh processes: cold with an empty cache
dir, then warm, for both sides in ABBA order; prints medians and the
mount/plain ratio.  Without a GPU it says so and exits 0.

    python scripts/bench_triton_gpu.py --reps 3 [--json]
"""

from __future__ import annotations

import argparse
import json
import sys

from _benchlib import HERE, abba, compile_env, median, run_json, temp_mount

WORKLOAD = [sys.executable, str(HERE / "triton_gpu_workload.py")]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    try:
        import torch

        has_gpu = torch.cuda.is_available()
    except ImportError:
        has_gpu = False
    if not has_gpu:
        print("bench_triton_gpu: skipped, no CUDA GPU here")
        return 0
    times = {s: {"cold": [], "warm": []} for s in ("plain", "mount")}
    with temp_mount() as (mp, plain):
        for rep, order in enumerate(abba(args.reps)):
            for side in order:
                cache = (mp if side == "mount" else plain) / f"rep{rep}"
                cold = run_json(WORKLOAD, compile_env(cache))
                warm = run_json(WORKLOAD, compile_env(cache))
                if cold["checksum"] != warm["checksum"]:
                    sys.exit(f"{side}: warm results differ from cold")
                times[side]["cold"].append(cold["seconds"])
                times[side]["warm"].append(warm["seconds"])
                if not args.json:
                    print(f"rep {rep} {side:5s} cold {cold['seconds']:7.2f} s  warm {warm['seconds']:6.2f} s",
                          flush=True)
        stats = json.loads((mp / ".mithrilfs" / "stats.json").read_text())
    result = {"reps": args.reps, "gpu": torch.cuda.get_device_name()}
    for phase in ("cold", "warm"):
        p, m = median(times["plain"][phase]), median(times["mount"][phase])
        result[phase] = {"plain_s": round(p, 3), "mount_s": round(m, 3), "ratio": round(m / p, 3)}
    result["mount_stats"] = {k: stats[k] for k in ("files", "physical_bytes", "logical_bytes", "dedup_ratio",
                                                   "hits", "misses")}
    if args.json:
        print(json.dumps(result))
    else:
        print(f"\n{result['gpu']}\n{'phase':6s} {'plain (s)':>10s} {'mount (s)':>10s} {'mount/plain':>12s}")
        for phase in ("cold", "warm"):
            r = result[phase]
            print(f"{phase:6s} {r['plain_s']:10.2f} {r['mount_s']:10.2f} {r['ratio']:11.3f}x")
        print("mount:", result["mount_stats"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
