"""``forget --fleet`` and the change feed, measured against a real redis-server and a real SeaweedFS.

Two figures per tier (issue 34):

* **Purge reach**: node A holds ``--purges`` cache entries (a directory of
  three files each) that nodes B and C have read.  For each entry, a
  process on B and one on C open one of its files by path in a loop
  (never listing the directory, as Triton and Inductor do); A runs
  ``mithrilfs forget --fleet A ENTRY``; the time from the command's start
  until *both* loops get ENOENT is the purge's time to reach every node.
  Median and max over the purges, and the command's own time.
* **Idle cost**: one node mounted behind a delay proxy (``--rtt-ms``),
  used once, then left alone: once it says it is idle (``remote_idle``,
  after ``--idle-after`` seconds, ``MITHRILFS_IDLE_AFTER``), for ``--idle``
  seconds: the requests the proxy saw, per hour, by kind (a bucket's
  LISTs apart), and the node's own ``remote_idle_requests_per_hour``.

    .venv/bin/python scripts/bench/bench_purge.py --purges 20 --idle 600
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
from urllib.parse import urlsplit

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _benchlib import CLI, median, redis_server, seaweedfs_s3

from mithrilfs.testing.delay_proxy import DelayProxy

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


def request_kind(method: str, target: str) -> str:
    """A bucket request's kind: LIST, or the method and the layout's top-level name (``GET feed``)."""
    if method == "LIST" or "list-type" in target:
        return "LIST"
    parts = [p for p in target.partition("?")[0].split("/") if p]
    return f"{method} {parts[3] if len(parts) > 3 else '/'.join(parts)}"  # /bench/purge/default/NAME...


def idle_cost(root: Path, kind: str, args: list[str], env: dict[str, str], seconds: float, idle_after: float,
              rtt_ms: float) -> dict:
    """One node, used once and then left alone: the requests it sends per hour of idleness."""
    mp, store = root / "idle-mnt", root / "idle-store"
    mp.mkdir()
    target = urlsplit(args[1] if kind == "redis" else env["AWS_ENDPOINT_URL"])
    with DelayProxy(target.hostname or "127.0.0.1", target.port or 80, rtt_ms=rtt_ms,
                    protocol="redis" if kind == "redis" else "http", label=request_kind) as proxy:
        if kind == "redis":
            args = ["--remote", f"redis://127.0.0.1:{proxy.port}/0"]
        else:
            env = env | {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{proxy.port}"}
        mount(mp, store, args, env | {"MITHRILFS_IDLE_AFTER": str(idle_after)})
        try:
            (mp / "used").write_bytes(b"once")  # a use, and a name published
            wait(lambda: stats(mp)["remote_idle"] == 1, idle_after + 120, "the node to be idle")
            before = stats(mp)
            proxy.reset()
            time.sleep(seconds)
            after = stats(mp)
            asked = proxy.labels() if kind != "redis" else {k: v for k, v in proxy.counts().items() if k.isupper()}
        finally:
            umount(mp)
    per_hour = 3600 / seconds
    total = sum(asked.values())
    return {"idle_seconds": seconds, "idle_after_s": idle_after, "rtt_ms": rtt_ms,
            "requests_per_hour": round(total * per_hour, 1),
            "lists_per_hour": round(asked.get("LIST", 0) * per_hour, 1),
            "by_kind_per_hour": {k: round(v * per_hour, 1) for k, v in sorted(asked.items())},
            "feed_checks_per_hour": round((after["remote_feed_checks"] - before["remote_feed_checks"]) * per_hour, 1),
            "node_idle_requests_per_hour": after["remote_idle_requests_per_hour"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--purges", type=int, default=20)
    parser.add_argument("--idle", type=float, default=600.0, help="seconds measured idle")
    parser.add_argument("--idle-after", type=float, default=30.0,
                        help="seconds without a use before the node is idle (the default mount's: 300)")
    parser.add_argument("--rtt-ms", type=float, default=0.0, help="round trip added by the proxy")
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
            results[kind] = {}
            if opts.purges:
                results[kind] |= purge_reach(root, args, env, opts.purges)
            if opts.idle:
                results[kind] |= idle_cost(root, kind, args, env, opts.idle, opts.idle_after, opts.rtt_ms)
        print(json.dumps({kind: results[kind]}), flush=True)
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
