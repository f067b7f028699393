"""A fleet in one run: N new nodes mounting at once on one bucket behind a delay proxy that may say SlowDown.

Node A (an empty store) writes ``--kernels`` Triton kernels in Triton's
layout (``bench_warmstart``'s POPULATE, 8 files a kernel), publishes them
to a real SeaweedFS bucket (``--remote s3``; ``redis+s3``: Redis in front)
through ``delay_proxy`` (``--rtt-ms`` a round trip, default 20; with
``--slowdown-rate R`` the proxy answers ``503 SlowDown`` to the requests
past R a second under one key prefix, with ``Retry-After: --retry-after``
when given), remounts and loads them (``bench_network``'s LOAD_HASHED): its
files' sha256 are the reference.  Then ``--nodes`` N new nodes, each an
empty store, its own empty HOME and TMPDIR and its own port on the proxy
(``DelayProxy.add_client``: its requests counted apart), mount at the same
moment (``--mode prefetch``: ``mount --prefetch``, the default; ``lazy``:
``--no-prefetch``; ``plain``: a plain ``mount``, prefetching in the
background) and load every kernel, hashing every file.

Every node mounts on the same path, each in a mount namespace of its own
(``unshare -m``): Triton's group files hold absolute paths, so a kernel
cache loads only where it was written.

Then the nodes stay mounted; once each says it is idle (nobody used it for
``--idle-after`` seconds), for ``--idle`` seconds: the requests
their tier sends meanwhile (the daemon's counters, and the proxy's per
node) give the idle requests per node-hour.  Prints one JSON object: per
node its time to warm (mount + load), its requests to warm by method and
bytes, its daemon's errors, slowdowns, bad blobs and whether every byte
equals node A's; the bucket's peak requests a second during the burst and
its 503s; the idle requests per node-hour.  Exits non-zero if a node failed
or read a byte wrong.  Needs root (mount namespaces, FUSE).

    .venv/bin/python scripts/bench/bench_fleet.py --nodes 8 --kernels 200 --rtt-ms 20 --mode prefetch \\
        [--slowdown-rate 50] [--idle 60] [--remote s3|redis+s3]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import IO, Any
from urllib.parse import parse_qs, urlsplit

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _benchlib import median, redis_server, seaweedfs_s3
from bench_network import LOAD_HASHED, Node, check_files, drained
from bench_warmstart import POPULATE, run_json

from mithrilfs.testing.delay_proxy import DelayProxy, slowdown_arguments

MODES = {"prefetch": ("--prefetch",), "lazy": ("--no-prefetch",), "plain": ()}
#: The daemon's counters a node reports: what went wrong, and what the bucket asked.
ERROR_COUNTERS = ("remote_verify_failures", "remote_bad_blobs_reported", "remote_errors", "remote_rejected",
                  "remote_data_lost")
CAVEAT = ("CPU caveat: the N nodes, their loads, the bucket server (SeaweedFS) and the proxy share this machine's"
          " {cores} cores, so a node's time to warm here includes waiting for CPU the others hold (N nodes on"
          " N machines would each have their own); the requests per node, the bucket's request rate and 503s,"
          " and the byte checks do not depend on it.")


def area(method: str, target: str) -> str:
    """``label`` for the S3 proxy: the method and the first part of the key under the namespace (``packs``,
    ``names``, ``epoch``, ``changes``, ``usage`` ...), a listing's by its prefix."""
    parts = urlsplit(target)
    prefix = parse_qs(parts.query).get("prefix")
    key = prefix[0] if prefix else parts.path.lstrip("/").partition("/")[2]
    segments = key.split("/")  # REMOTE/NAMESPACE/AREA/...
    return f"{method} {segments[2] if len(segments) > 2 and segments[2] else '?'}"


# -- one node, in its own mount namespace ------------------------------------------------------------------

def tier_state(mp: Path) -> dict[str, Any]:
    """The daemon's error counters and its levels' requests and slowdowns (``stats.json``)."""
    stats = json.loads((mp / ".mithrilfs" / "stats.json").read_text())
    return {"counters": {k: stats.get(k, 0) for k in ERROR_COUNTERS},
            "levels": [{k: lv[k] for k in ("kind", "requests", "errors", "slowdowns", "bytes_in", "bytes_out")}
                       for lv in stats["remote_levels"]]}


def warnings(store: Path, most: int = 20) -> list[str]:
    """The daemon's last *most* warnings and errors (its log in the store): why a node failed, if it did."""
    try:
        lines = (store / "mithrilfs.log").read_text(errors="replace").splitlines()
    except OSError:
        return []
    return [line[:400] for line in lines if " WARNING " in line or " ERROR " in line][-most:]


def emit(out: IO[str], message: dict[str, Any]) -> None:
    out.write(json.dumps(message) + "\n")
    out.flush()


def node_main(spec: dict[str, Any]) -> int:
    """A node of the fleet (run under ``unshare -m``): the protocol on stdin/stdout is one line each way.

    Node A (``spec["publish"]``): mount, write the kernels, wait for the upload queue, unmount; mount,
    load (hashing), unmount; one line: the keys are in ``spec["keys"]``, the digests in ``spec["digests"]``.
    A new node: "ready"; at "go", mount and load, then "warm" (its seconds, or the error) with its tier's
    state; at "idle", the state; at "end", the state, then unmount and "done"."""
    out = sys.stdout
    sys.stdout = sys.stderr  # what a step prints does not mix with the protocol's lines
    node, mp, store = Node(spec["remote"], spec["env"]), Path(spec["mp"]), Path(spec["store"])
    os.environ.update(spec["env"])
    keys, digests = Path(spec["keys"]), Path(spec["digests"])
    if spec.get("publish"):
        node.mount(mp, store)
        try:
            keys.write_text(json.dumps(run_json(POPULATE, [str(spec["kernels"]), str(random.randrange(1 << 30))],
                                                mp / "triton")))
            drained(mp)
        finally:
            node.umount(mp)
        node.mount(mp, store)
        try:
            load = run_json(LOAD_HASHED, [str(keys), str(digests)], mp / "triton")
        finally:
            node.umount(mp)
        emit(out, {"published": load})
        return 0
    emit(out, {"ready": True})
    sys.stdin.readline()
    t = time.monotonic()
    mounted = False
    try:
        node.mount(mp, store, *spec["flags"])
        mounted = True
        mount_s = time.monotonic() - t
        load = run_json(LOAD_HASHED, [str(keys), str(digests)], mp / "triton")
        warm: dict[str, Any] = {"mount_s": mount_s, "load_s": load["seconds"], "warm_s": time.monotonic() - t,
                                "files": load["files"], "bytes": load["bytes"]}
    except SystemExit as e:  # a step failed (the mount, or the load: EIO, a file missing): the node's error
        warm = {"error": str(e.code)[-1500:], "warm_s": time.monotonic() - t}
    try:
        emit(out, {"warm": dict(warm, log=warnings(store)), "tier": tier_state(mp) if mounted else None})
        for step in ("idle", "end"):
            sys.stdin.readline()
            if step == "idle" and mounted:  # idle once nobody used it for MITHRILFS_IDLE_AFTER
                deadline = time.monotonic() + float(spec["env"]["MITHRILFS_IDLE_AFTER"]) + 120
                while (json.loads((mp / ".mithrilfs" / "stats.json").read_text())["remote_idle"] != 1
                       and time.monotonic() < deadline):
                    time.sleep(0.5)
            emit(out, {step: tier_state(mp) if mounted else None})
    finally:
        if mounted:
            node.umount(mp)
    emit(out, {"done": True})
    return 0


# -- the fleet ---------------------------------------------------------------------------------------------

class Fleet:
    """The nodes' processes, each under ``unshare -m`` on the same mount path; their messages by node."""

    def __init__(self, specs: dict[str, dict[str, Any]]) -> None:
        self.procs = {name: subprocess.Popen(["unshare", "-m", "--propagation", "private", "--", sys.executable,
                                              __file__, "--node", json.dumps(spec)],
                                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
                      for name, spec in specs.items()}

    def read(self, name: str) -> dict[str, Any]:
        stdout = self.procs[name].stdout
        assert stdout is not None
        line = stdout.readline()
        if not line:
            raise RuntimeError(f"node {name} ended early (exit status {self.procs[name].wait()})")
        return dict(json.loads(line))

    def tell(self, word: str) -> None:
        for proc in self.procs.values():
            assert proc.stdin is not None
            proc.stdin.write(word + "\n")
            proc.stdin.flush()

    def each(self, fn: Any) -> dict[str, Any]:
        """*fn(name)* for every node at once (threads), by node."""
        got: dict[str, Any] = {}
        threads = [threading.Thread(target=lambda n=name: got.__setitem__(n, fn(n))) for name in self.procs]
        for th in threads:
            th.start()
        for th in threads:
            th.join()
        missing = set(self.procs) - set(got)
        if missing:
            raise RuntimeError(f"nodes {sorted(missing)} sent nothing")
        return got

    def close(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                with contextlib.suppress(BrokenPipeError, OSError):
                    assert proc.stdin is not None
                    proc.stdin.close()  # a node reading its next word reads EOF, unmounts and ends
        for proc in self.procs.values():
            try:
                proc.wait(timeout=120)
            except subprocess.TimeoutExpired:
                proc.kill()
                proc.wait()


def by_method(counts: dict[str, int]) -> dict[str, int]:
    """A proxy's counters of one node: requests by method (or command), slowdowns, bytes."""
    return {k: v for k, v in sorted(counts.items()) if k.isupper() or k in ("requests", "slowdowns", "bytes_down",
                                                                                "bytes_up", "connections")}


def minus(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: n - before.get(k, 0) for k, n in after.items() if n - before.get(k, 0)}


def level_requests(state: dict[str, Any] | None) -> list[int]:
    return [lv["requests"] for lv in state["levels"]] if state else []


def run(args: argparse.Namespace, say: Any) -> dict[str, Any]:
    """Node A publishes, the fleet mounts at once and loads, then idles; the figures."""
    with contextlib.ExitStack() as stack:
        base = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="mithrilfs-bench-fleet-", dir=args.base)))
        s3_env = stack.enter_context(seaweedfs_s3())
        s3 = stack.enter_context(DelayProxy("127.0.0.1", urlsplit(s3_env["AWS_ENDPOINT_URL"]).port or 80,
                                            args.rtt_ms, "http", label=area, slowdown_rate=args.slowdown_rate,
                                            slowdown_depth=args.slowdown_depth, retry_after=args.retry_after))
        rp = None
        if args.remote == "redis+s3":
            target = urlsplit(stack.enter_context(redis_server()))
            rp = stack.enter_context(DelayProxy("127.0.0.1", target.port or 6379, args.rtt_ms, "redis"))
        (base / "mnt").mkdir()
        names = ["A", *(f"n{i}" for i in range(1, args.nodes + 1))]
        specs = {}
        for name in names:
            home = base / name
            for d in ("home", "tmp"):
                (home / d).mkdir(parents=True)
            remote = ["--remote", f"redis://127.0.0.1:{rp.add_client(name)}/0"] if rp else []
            env = dict(s3_env, AWS_ENDPOINT_URL=f"http://127.0.0.1:{s3.add_client(name)}", HOME=str(home / "home"),
                       TMPDIR=str(home / "tmp"), MITHRILFS_IDLE_AFTER=str(args.idle_after))
            specs[name] = {"remote": [*remote, "--remote", "s3://bench/fleet"], "env": env, "mp": str(base / "mnt"),
                           "store": str(home / "store"), "flags": MODES[args.mode], "kernels": args.kernels,
                           "keys": str(base / "keys.json"), "digests": str(home / "digests.json"),
                           "publish": name == "A"}
        t = time.monotonic()
        published = Fleet({"A": specs.pop("A")})
        try:
            a_load = published.read("A")["published"]
        finally:
            published.close()
        say(f"node A wrote, published and loaded {args.kernels} kernels ({a_load['files']} files,"
            f" {a_load['bytes'] / 2**20:.1f} MiB) in {time.monotonic() - t:.1f} s; its load {a_load['seconds']:.2f} s")
        expected = json.loads((base / "A" / "digests.json").read_text())
        fleet = Fleet(specs)
        try:
            fleet.each(lambda n: fleet.read(n)["ready"])
            s3.reset()
            if rp:
                rp.reset()
            t = time.monotonic()
            fleet.tell("go")

            def warmed(name: str) -> dict[str, Any]:
                msg = fleet.read(name)
                msg["s3"] = by_method(s3.clients()[name])
                msg["redis"] = by_method(rp.clients()[name]) if rp else None
                say(f"  {name}: " + (f"warm in {msg['warm']['warm_s']:.2f} s" if "error" not in msg["warm"]
                                     else f"FAILED after {msg['warm']['warm_s']:.1f} s: {msg['warm']['error'][-300:]}"))
                return msg

            warm = fleet.each(warmed)
            burst_s = time.monotonic() - t
            per_second, slowdowns, areas = s3.per_second(), s3.per_second("slowdowns"), s3.labels()
            bucket = by_method(s3.counts())
            fleet.tell("idle")
            idle_from = fleet.each(lambda n: fleet.read(n)["idle"])
            proxy_from = {"s3": s3.clients(), "redis": rp.clients() if rp else {}}
            t_idle = time.monotonic()
            say(f"all warm in {burst_s:.1f} s; idle for {args.idle:g} s")
            time.sleep(args.idle)
            fleet.tell("end")
            idle_to = fleet.each(lambda n: fleet.read(n)["end"])
            idle_s = time.monotonic() - t_idle
            proxy_to = {"s3": s3.clients(), "redis": rp.clients() if rp else {}}
            fleet.each(lambda n: fleet.read(n)["done"])
        finally:
            fleet.close()
        nodes = {}
        for name, msg in warm.items():
            w = msg["warm"]
            try:
                check_files(name, json.loads(Path(specs[name]["digests"]).read_text()), expected)
                bytes_right = "error" not in w
            except (SystemExit, OSError) as e:
                bytes_right, w = False, dict(w, error=w.get("error") or str(e))
            idle = {side: minus(proxy_to[side].get(name, {}), proxy_from[side].get(name, {})) for side in proxy_to}
            nodes[name] = dict(w, bytes_right=bytes_right, s3=msg["s3"], redis=msg["redis"], tier=msg["tier"],
                               idle_requests_per_hour={
                                   "daemon_levels": [round((b - a) * 3600 / idle_s) for a, b in
                                                     zip(level_requests(idle_from[name]), level_requests(idle_to[name]))],
                                   **{side: round(c.get("requests", 0) * 3600 / idle_s) for side, c in idle.items()
                                      if side == "s3" or rp},
                                   "s3_by_method": {k: v for k, v in idle["s3"].items() if k.isupper()}})
    return summarize(args, nodes, a_load, burst_s, per_second, slowdowns, bucket, areas, idle_s)


def summarize(args: argparse.Namespace, nodes: dict[str, dict[str, Any]], a_load: dict[str, Any], burst_s: float,
              per_second: list[int], slowdowns: list[int], bucket: dict[str, int], areas: dict[str, int],
              idle_s: float) -> dict[str, Any]:
    ok = [n for n in nodes.values() if "error" not in n]
    errors = {k: sum((n["tier"] or {"counters": {}})["counters"].get(k, 0) for n in nodes.values())
              for k in ERROR_COUNTERS}
    return {
        "nodes": args.nodes, "kernels": args.kernels, "files": a_load["files"], "mode": args.mode,
        "rtt_ms": args.rtt_ms, "slowdown_rate": args.slowdown_rate, "slowdown_depth": args.slowdown_depth,
        "retry_after": args.retry_after,
        "remote": args.remote, "node_a_load_s": round(a_load["seconds"], 3),
        "warm_s": {"median": round(median([n["warm_s"] for n in ok]), 3) if ok else None,
                   "max": round(max((n["warm_s"] for n in ok), default=0), 3), "burst_s": round(burst_s, 3)},
        "requests_per_node": {"median": median([n["s3"].get("requests", 0) for n in nodes.values()]),
                              "max": max(n["s3"].get("requests", 0) for n in nodes.values())},
        "bucket": {"requests": bucket.get("requests", 0), "peak_requests_per_s": max(per_second, default=0),
                   "per_second": per_second, "slowdowns_503": bucket.get("slowdowns", 0),
                   "slowdowns_per_second": slowdowns, "by_method": bucket, "by_area": areas},
        "errors": {"nodes_failed": len(nodes) - len(ok), "nodes_with_wrong_bytes": sum(not n["bytes_right"]
                                                                                        for n in nodes.values()),
                   "eio_in_load": sum("Errno 5" in n.get("error", "") for n in nodes.values()), **errors},
        "idle": {"seconds": round(idle_s, 1),
                 "s3_requests_per_node_hour": median([n["idle_requests_per_hour"]["s3"] for n in nodes.values()]),
                 "daemon_requests_per_node_hour": median([sum(n["idle_requests_per_hour"]["daemon_levels"])
                                                          for n in nodes.values()])},
        "per_node": nodes,
        "caveat": CAVEAT.format(cores=os.cpu_count()),
    }


def main() -> int:
    if len(sys.argv) == 3 and sys.argv[1] == "--node":
        return node_main(json.loads(sys.argv[2]))
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--nodes", type=int, default=8, help="new nodes mounting at once (default 8)")
    ap.add_argument("--kernels", type=int, default=200, help="Triton kernels node A publishes (default 200)")
    ap.add_argument("--rtt-ms", type=float, default=20.0, help="round trip the proxy adds (default 20)")
    ap.add_argument("--mode", choices=tuple(MODES), default="prefetch",
                    help="how the new nodes mount: --prefetch (default), lazily (--no-prefetch), or plain")
    slowdown_arguments(ap)  # the proxy's --slowdown-rate, --slowdown-depth, --retry-after
    ap.add_argument("--idle", type=float, default=60.0, help="seconds the warm nodes are measured idle (default 60)")
    ap.add_argument("--idle-after", type=float, default=20.0,
                    help="seconds without a use before a node is idle (MITHRILFS_IDLE_AFTER; a mount's default: 300)")
    ap.add_argument("--remote", choices=("s3", "redis+s3"), default="s3",
                    help="the shared tier: a SeaweedFS bucket, or Redis in front of it (both behind proxies)")
    ap.add_argument("--base", default=None, metavar="DIR", help="where the stores and the mount point go")
    args = ap.parse_args()
    if args.nodes < 1 or args.kernels < 1 or min(args.rtt_ms, args.idle, args.slowdown_rate, args.slowdown_depth) < 0:
        ap.error("--nodes and --kernels need at least 1; --rtt-ms, --idle and --slowdown-* cannot be negative")
    if os.geteuid() != 0:
        sys.exit("bench_fleet: needs root (a mount namespace per node)")

    def say(line: str) -> None:
        print(line, file=sys.stderr, flush=True)

    result = run(args, say)
    say(result["caveat"])
    print(json.dumps(result))
    e = result["errors"]
    return 1 if e["nodes_failed"] or e["nodes_with_wrong_bytes"] else 0


if __name__ == "__main__":
    sys.exit(main())
