#!/usr/bin/env python3
"""Real Triton kernels on a GPU, cold then warm, cache on a plain directory vs on the mount.

Each repetition runs scripts/workloads/triton_gpu_workload.py (autotuned matmul and
softmax at several shapes) in fresh processes: cold with an empty cache
dir, then warm, for both sides in ABBA order; prints medians and the
mount/plain ratio.  Without a GPU it says so and exits 0.

    python scripts/bench/bench_triton_gpu.py --reps 3 [--json]
"""

from __future__ import annotations

import argparse
import json
import sys

from _benchlib import WORKLOADS, cold_warm_abba, print_ratios, ratios, temp_mount

WORKLOAD = [sys.executable, str(WORKLOADS / "triton_gpu_workload.py")]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--warm-reps", type=int, default=0,
                    help="more warm runs per side after the cold/warm pairs (default 0)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    if args.reps < 1 or args.warm_reps < 0:
        ap.error("--reps must be at least 1 and --warm-reps at least 0")
    try:
        import torch

        has_gpu = torch.cuda.is_available()
    except ImportError:
        has_gpu = False
    if not has_gpu:
        print("bench_triton_gpu: skipped, no CUDA GPU here")
        return 0
    with temp_mount() as (mp, plain):
        times, _ = cold_warm_abba(WORKLOAD, mp, plain, args.reps, "checksum", quiet=args.json,
                                  warm_reps=args.warm_reps)
        stats = json.loads((mp / ".mithrilfs" / "stats.json").read_text())
    result = {"reps": args.reps, "warm_reps": args.warm_reps, "gpu": torch.cuda.get_device_name(),
              **ratios(times)}
    result["mount_stats"] = {k: stats[k] for k in ("files", "physical_bytes", "logical_bytes", "dedup_ratio",
                                                   "hits", "misses")}
    if args.json:
        print(json.dumps(result))
    else:
        print(f"\n{result['gpu']}")
        print_ratios(result)
        print("mount:", result["mount_stats"])
    return 0


if __name__ == "__main__":
    sys.exit(main())
