#!/usr/bin/env python3
"""What surviving the daemon costs, and how long programs wait while a daemon is replaced.

    .venv/bin/python scripts/bench/bench_takeover.py [--files 3000] [--reps 4] [--pauses 10] [--json]

1. The price of keeping staging where it outlives the daemon (a memfd
   mirror and a message to the supervisor per file written): N small files
   written (write + close, then tmp + rename, as the frameworks do) on a
   plain directory, on a default mount, and on a mount with
   ``--on-crash detach`` (no mirror), in rotating order over --reps
   repetitions; medians and the ratios to plain and between the two mounts.
2. The pause a program sees: a client loop reading and writing a file on
   the mount while the daemon is killed (kill -9) or handed over
   (``mithrilfs restart``), --pauses times each; the longest gap between
   two completed operations around each event (median, max), against the
   loop's ordinary gap.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

from _benchlib import CLI, median, quartiles


@contextmanager
def mounted(root: Path, name: str, *extra: str) -> Iterator[Path]:
    mp, store = root / f"{name}-mnt", root / f"{name}-store"
    mp.mkdir()
    subprocess.run([*CLI, "mount", str(mp), "--store", str(store), *extra], check=True)
    try:
        yield mp
    finally:
        if subprocess.run([*CLI, "umount", str(mp)]).returncode != 0:
            subprocess.run(["fusermount3", "-u", "-z", str(mp)])


def write_files(d: Path, n: int, rename: bool) -> float:
    """Seconds to write *n* 8 KiB files into a new directory under *d* (tmp + rename when *rename*)."""
    target = d / f"run-{time.monotonic_ns()}"
    target.mkdir()
    body = os.urandom(8192)
    t = time.perf_counter()
    for i in range(n):
        if rename:
            tmp = target / f"f{i}.tmp"
            with open(tmp, "wb") as f:
                f.write(body)
            os.replace(tmp, target / f"f{i}")
        else:
            with open(target / f"f{i}", "wb") as f:
                f.write(body)
    return time.perf_counter() - t


def daemon_pid(mp: Path) -> int:
    return int((mp / ".mithrilfs" / "pid").read_text())


def pauses(mp: Path, count: int, how: str) -> dict:
    """Longest gap between completed client operations around each replacement of the daemon."""
    stop = threading.Event()
    done: list[float] = []
    errors: list[str] = []

    def client() -> None:
        body = os.urandom(4096)
        i = 0
        while not stop.is_set():
            try:
                p = mp / f"c{i % 20}"
                with open(p.with_suffix(".tmp"), "wb") as f:
                    f.write(body)
                os.replace(p.with_suffix(".tmp"), p)
                if p.read_bytes() != body:
                    errors.append(f"{p}: wrong content")
            except OSError as e:
                errors.append(str(e))
            done.append(time.monotonic())
            i += 1

    thread = threading.Thread(target=client)
    thread.start()
    gaps, quiet = [], []
    try:
        for _ in range(count):
            time.sleep(1.0)
            start = len(done)
            time.sleep(0.3)
            quiet.append(max((b - a for a, b in zip(done[start:-1], done[start + 1:])), default=0.0))
            event_at = len(done)
            if how == "kill":
                os.kill(daemon_pid(mp), signal.SIGKILL)
            else:
                subprocess.run([*CLI, "restart", str(mp)], check=True, capture_output=True)
            time.sleep(1.5)
            around = done[max(event_at - 1, 0):]
            gaps.append(max((b - a for a, b in zip(around, around[1:])), default=0.0))
    finally:
        stop.set()
        thread.join()
    return {"events": count, "pause_median_s": median(gaps), "pause_max_s": max(gaps),
            "ordinary_gap_median_s": median(quiet), "client_ops": len(done), "client_errors": errors[:5],
            "client_error_count": len(errors)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--files", type=int, default=3000)
    ap.add_argument("--reps", type=int, default=4)
    ap.add_argument("--pauses", type=int, default=10)
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    root = Path(tempfile.mkdtemp(prefix="mithrilfs-bench-takeover-"))
    result: dict = {"files": args.files, "reps": args.reps}
    try:
        with ExitStack() as stack:
            sides = {"plain": root / "plain", "takeover": stack.enter_context(mounted(root, "takeover")),
                     "detach": stack.enter_context(mounted(root, "detach", "--on-crash", "detach"))}
            sides["plain"].mkdir()
            order = list(sides)
            for kind in ("write+close", "tmp+rename"):
                times: dict[str, list[float]] = {s: [] for s in sides}
                for rep in range(args.reps):
                    for side in order[rep % 3:] + order[: rep % 3]:  # each side goes first in turn
                        times[side].append(write_files(sides[side], args.files, kind == "tmp+rename"))
                result[kind] = {s: {"median_s": median(t), "quartiles_s": quartiles(t)} for s, t in times.items()}
                result[kind]["takeover/plain"] = median(times["takeover"]) / median(times["plain"])
                result[kind]["detach/plain"] = median(times["detach"]) / median(times["plain"])
                result[kind]["takeover/detach"] = median(times["takeover"]) / median(times["detach"])
            result["kill -9"] = pauses(sides["takeover"], args.pauses, "kill")
            result["restart"] = pauses(sides["takeover"], args.pauses, "restart")
    finally:
        subprocess.run(["rm", "-rf", str(root)])
    if args.json:
        print(json.dumps(result, indent=1))
        return 0
    for kind in ("write+close", "tmp+rename"):
        r = result[kind]
        print(f"{kind:12} {args.files} files: plain {r['plain']['median_s']:.2f} s, mount {r['takeover']['median_s']:.2f} s"
              f" (x{r['takeover/plain']:.1f}), mount --on-crash detach {r['detach']['median_s']:.2f} s"
              f" (x{r['detach/plain']:.1f}); keeping staging for a successor costs x{r['takeover/detach']:.3f}")
        print(f"{'':12} quartiles: " + ", ".join(f"{s} {[round(q, 2) for q in r[s]['quartiles_s']]}"
                                                 for s in ("plain", "takeover", "detach")))
    for how in ("kill -9", "restart"):
        r = result[how]
        print(f"{how:12} {r['events']} times: the client paused {r['pause_median_s'] * 1000:.0f} ms median,"
              f" {r['pause_max_s'] * 1000:.0f} ms at most (ordinary gap {r['ordinary_gap_median_s'] * 1000:.1f} ms);"
              f" {r['client_error_count']} client errors in {r['client_ops']} operations")
    return 0


if __name__ == "__main__":
    sys.exit(main())
