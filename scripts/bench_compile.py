#!/usr/bin/env python3
"""torch.compile cold and warm, cache dir on a plain directory vs on the mount, in one run.

Each repetition runs, in fresh processes, a cold compile (empty cache dir)
then a warm one (same dir) for both sides, in ABBA order: the first compile
of a session pays for files Inductor keeps outside the cache dir
(precompiled headers), so a fixed order would bias the result.  Prints the
medians and the mount/plain ratio (below 1.0 means the mount is faster).

    .venv/bin/python scripts/bench_compile.py --reps 4 [--json]
"""

from __future__ import annotations

import argparse
import json
import sys

from _benchlib import HERE, abba, compile_env, median, run_json, temp_mount

WORKLOAD = [sys.executable, str(HERE / "compile_workload.py")]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=4, help="repetitions of each side (default 4)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args()
    if args.reps < 1:
        ap.error("--reps must be at least 1")

    times: dict[str, dict[str, list[float]]] = {s: {"cold": [], "warm": []} for s in ("plain", "mount")}
    hits: dict[str, list[int]] = {"plain": [], "mount": []}
    with temp_mount() as (mp, plain):
        for rep, order in enumerate(abba(args.reps)):
            for side in order:
                cache = (mp if side == "mount" else plain) / f"rep{rep}"
                cold = run_json(WORKLOAD, compile_env(cache))
                warm = run_json(WORKLOAD, compile_env(cache))
                if warm["output_sha"] != cold["output_sha"]:
                    sys.exit(f"{side}: warm output differs from cold output")
                times[side]["cold"].append(cold["seconds"])
                times[side]["warm"].append(warm["seconds"])
                hits[side].append(warm["fxgraph_cache_hit"])
                if not args.json:
                    print(f"rep {rep} {side:5s} cold {cold['seconds']:7.2f} s  warm {warm['seconds']:6.2f} s"
                          f"  (warm fxgraph hits {warm['fxgraph_cache_hit']})", flush=True)

    result = {"reps": args.reps}
    for phase in ("cold", "warm"):
        p, m = median(times["plain"][phase]), median(times["mount"][phase])
        result[phase] = {"plain_s": round(p, 3), "mount_s": round(m, 3), "ratio": round(m / p, 3)}
    result["warm_fxgraph_hits"] = hits
    if args.json:
        print(json.dumps(result))
    else:
        print(f"\n{'phase':6s} {'plain (s)':>10s} {'mount (s)':>10s} {'mount/plain':>12s}")
        for phase in ("cold", "warm"):
            r = result[phase]
            print(f"{phase:6s} {r['plain_s']:10.2f} {r['mount_s']:10.2f} {r['ratio']:11.3f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
