#!/usr/bin/env python3
"""torch.compile cold and warm, cache dir on a plain directory vs on the mount, in one run.

Each repetition runs, in fresh processes, a cold compile (empty cache dir)
then a warm one (same dir) for both sides, in ABBA order: the first compile
of a session pays for files Inductor keeps outside the cache dir
(precompiled headers), so a fixed order would bias the result.  Prints the
medians and the mount/plain ratio (below 1.0 means the mount is faster).

    .venv/bin/python scripts/bench/bench_compile.py --reps 4 [--json]
    .venv/bin/python scripts/bench/bench_compile.py --remote --reps 3

With --remote: node A (its own store) compiles cold then warm; node B (an
empty store, the same Redis) then warm-starts from what A uploaded, fetching
lazily; node C (another empty store) runs ``mithrilfs prefetch --all`` first,
then warm-starts.  Prints B's and C's warm times over A's local warm time,
the bytes B fetched and C's prefetch time.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time

from _benchlib import (
    CLI,
    WORKLOADS,
    cold_warm_abba,
    compile_env,
    median,
    print_ratios,
    ratios,
    redis_server,
    run_json,
    temp_mount,
)

WORKLOAD = [sys.executable, str(WORKLOADS / "compile_workload.py")]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--reps", type=int, default=4, help="repetitions of each side (default 4)")
    ap.add_argument("--warm-reps", type=int, default=0,
                    help="more warm runs per side after the cold/warm pairs (default 0)")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    ap.add_argument("--remote", action="store_true", help="node B warm-starting from node A through Redis")
    args = ap.parse_args()
    if args.reps < 1 or args.warm_reps < 0:
        ap.error("--reps must be at least 1 and --warm-reps at least 0")
    if args.remote:
        return bench_remote(args)

    with temp_mount() as (mp, plain):
        times, warm_runs = cold_warm_abba(WORKLOAD, mp, plain, args.reps, "output_sha", quiet=args.json,
                                          warm_reps=args.warm_reps)
    result = {"reps": args.reps, "warm_reps": args.warm_reps, **ratios(times),
              "warm_fxgraph_hits": {s: [w["fxgraph_cache_hit"] for w in warm_runs if w["side"] == s]
                                    for s in ("plain", "mount")}}
    if args.json:
        print(json.dumps(result))
    else:
        print_ratios(result)
    return 0


def _stats(mp) -> dict:
    return json.loads((mp / ".mithrilfs" / "stats.json").read_text())


def bench_remote(args: argparse.Namespace) -> int:
    a_warm, b_warm, c_warm, c_prefetch, fetched = [], [], [], [], []
    with redis_server() as url:
        for rep in range(args.reps):
            remote = ("--remote", url, "--remote-namespace", f"rep{rep}")
            with temp_mount(*remote) as (mp_a, _), temp_mount(*remote) as (mp_b, _), \
                    temp_mount(*remote) as (mp_c, _):
                cold = run_json(WORKLOAD, compile_env(mp_a / "inductor"))
                warm_a = run_json(WORKLOAD, compile_env(mp_a / "inductor"))
                while _stats(mp_a)["upload_queue"]:
                    time.sleep(0.1)
                warm_b = run_json(WORKLOAD, compile_env(mp_b / "inductor"))
                if warm_b["output_sha"] != cold["output_sha"] or not warm_b["fxgraph_cache_hit"]:
                    sys.exit("node B did not warm-start correctly from node A")
                got = _stats(mp_b)["remote_fetched_bytes"]
                t = time.monotonic()
                subprocess.run([*CLI, "prefetch", str(mp_c), "--all"], check=True, capture_output=True)
                c_prefetch.append(time.monotonic() - t)
                warm_c = run_json(WORKLOAD, compile_env(mp_c / "inductor"))
                if warm_c["output_sha"] != cold["output_sha"] or not warm_c["fxgraph_cache_hit"]:
                    sys.exit("node C did not warm-start correctly after its prefetch")
                a_warm.append(warm_a["seconds"])
                b_warm.append(warm_b["seconds"])
                c_warm.append(warm_c["seconds"])
                fetched.append(got)
                if not args.json:
                    print(f"rep {rep}: A cold {cold['seconds']:.2f} s, A warm {warm_a['seconds']:.2f} s, "
                          f"B warm from Redis {warm_b['seconds']:.2f} s ({got} bytes fetched), "
                          f"C prefetch {c_prefetch[-1]:.2f} s then warm {warm_c['seconds']:.2f} s", flush=True)
    result = {"reps": args.reps, "a_warm_s": median(a_warm), "b_warm_from_redis_s": median(b_warm),
              "ratio": round(median(b_warm) / median(a_warm), 3), "bytes_fetched": int(median(fetched)),
              "c_warm_after_prefetch_s": median(c_warm), "prefetch_ratio": round(median(c_warm) / median(a_warm), 3),
              "c_prefetch_s": round(median(c_prefetch), 2)}
    print(json.dumps(result) if args.json else
          f"\nB warm from Redis (lazy) / A warm local: {result['ratio']:.3f}x "
          f"({result['b_warm_from_redis_s']:.2f} s vs {result['a_warm_s']:.2f} s), {result['bytes_fetched']} bytes fetched"
          f"\nC warm after prefetch / A warm local: {result['prefetch_ratio']:.3f}x "
          f"({result['c_warm_after_prefetch_s']:.2f} s; the prefetch took {result['c_prefetch_s']:.2f} s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
