"""``forget --fleet`` and the change feed, measured against a real redis-server and a real SeaweedFS.

Two figures per tier (issue 34):

* **Purge reach**: node A holds ``--purges`` cache entries (a directory of
  three files each) that nodes B and C have read.  For each entry, a
  process on B and one on C open one of its files by path in a loop
  (never listing the directory, as Triton and Inductor do); A runs
  ``mithrilfs forget --fleet A ENTRY``; the time from the command's start
  until *both* loops get ENOENT is the purge's time to reach every node.
  Median and max over the purges, and the command's own time.
* **Idle cost**: one node mounted, nothing happening, for ``--idle``
  seconds: the feed's requests (``remote_feed_reads``) and every request
  the tier made (epoch checks included), per hour.

    .venv/bin/python scripts/bench/bench_purge.py --purges 20 --idle 60
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from contextlib import ExitStack
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _benchlib import CLI, median, redis_server, seaweedfs_s3

OPEN_LOOP = """
import sys, time
path, said = sys.argv[1], False
while True:
    try:
        with open(path, "rb") as f:
            f.read()
    except FileNotFoundError:
        break
    if not said:
        print("open", flush=True)
        said = True
    time.sleep(0.01)
"""


def mount(mp: Path, store: Path, args: list[str], env: dict[str, str]) -> None:
    subprocess.run([*CLI, "mount", str(mp), "--store", str(store), *args, "--min-age", "0"], check=True,
                   env=dict(os.environ, **env))


def umount(mp: Path) -> None:
    if subprocess.run([*CLI, "umount", str(mp)], capture_output=True).returncode != 0:
        subprocess.run(["fusermount3", "-u", "-z", str(mp)])


def stats(mp: Path) -> dict:
    return json.loads((mp / ".mithrilfs" / "stats.json").read_text())


def wait(cond, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise RuntimeError(f"timed out waiting for {what}")
        time.sleep(0.05)


def purge_reach(root: Path, args: list[str], env: dict[str, str], purges: int) -> dict:
    nodes = {n: (root / f"{n}-mnt", root / f"{n}-store") for n in "abc"}
    with ExitStack() as stack:
        for mp, store in nodes.values():
            mp.mkdir()
            mount(mp, store, args, env)
            stack.callback(umount, mp)
        a = nodes["a"][0]
        for i in range(purges):
            d = a / f"entry{i}"
            d.mkdir()
            for name in ("k.so", "k.json", "k.cubin"):
                with open(d / name, "wb") as f:
                    f.write(os.urandom(2048))
                    os.fsync(f.fileno())
        wait(lambda: stats(a)["upload_queue"] == 0 and stats(a)["remote_uploaded_entries"] >= 3 * purges, 120,
             "A's uploads")
        reach, command = [], []
        for i in range(purges):
            loops = []
            for n in "bc":
                p = subprocess.Popen([sys.executable, "-c", OPEN_LOOP, str(nodes[n][0] / f"entry{i}" / "k.so")],
                                     stdout=subprocess.PIPE, text=True)
                assert p.stdout is not None
                if p.stdout.readline().strip() != "open":
                    raise RuntimeError(f"node {n} could not open entry{i}/k.so")
                loops.append(p)
            start = time.monotonic()
            subprocess.run([*CLI, "forget", "--fleet", str(a), f"entry{i}"], check=True, capture_output=True)
            command.append(time.monotonic() - start)
            for p in loops:
                p.wait(timeout=120)
            reach.append(time.monotonic() - start)
        return {"purges": purges, "reach_median_s": round(median(reach), 2), "reach_max_s": round(max(reach), 2),
                "command_median_s": round(median(command), 2), "command_max_s": round(max(command), 2)}


def idle_cost(root: Path, args: list[str], env: dict[str, str], seconds: float) -> dict:
    mp, store = root / "idle-mnt", root / "idle-store"
    mp.mkdir()
    mount(mp, store, args, env)
    try:
        time.sleep(5)  # past the first checks
        before = stats(mp)
        time.sleep(seconds)
        after = stats(mp)
    finally:
        umount(mp)
    per_hour = 3600 / seconds
    feed = after["remote_feed_reads"] - before["remote_feed_reads"]
    total = sum(lv["requests"] for lv in after["remote_levels"]) - sum(lv["requests"] for lv in before["remote_levels"])
    return {"idle_seconds": seconds, "feed_requests_per_hour": round(feed * per_hour),
            "all_tier_requests_per_hour": round(total * per_hour)}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--purges", type=int, default=20)
    parser.add_argument("--idle", type=float, default=60.0)
    parser.add_argument("--tiers", default="redis,s3")
    opts = parser.parse_args()
    results = {}
    for kind in opts.tiers.split(","):
        with ExitStack() as stack:
            if kind == "redis":
                url = stack.enter_context(redis_server())
                args, env = ["--remote", url], {}
            else:
                env = stack.enter_context(seaweedfs_s3())
                args = ["--remote", "s3://bench/purge"]
            root = Path(tempfile.mkdtemp(prefix="mithrilfs-bench-purge-"))
            stack.callback(subprocess.run, ["rm", "-rf", str(root)])
            results[kind] = purge_reach(root, args, env, opts.purges) | idle_cost(root, args, env, opts.idle)
        print(json.dumps({kind: results[kind]}), flush=True)
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
