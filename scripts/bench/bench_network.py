"""A new node across a real network: Triton kernels from the shared tier behind a delay proxy (issue 21).

``bench_newnode`` on loopback hides the price of a request; a fleet's bucket
is 10-50 ms per request away.  Here every request of the mount to the
shared tier goes through ``delay_proxy`` (a round trip of ``--rtt-ms``
added to each exchange, a new connection one more, bandwidth unlimited),
in front of a real SeaweedFS bucket (``--remote s3``) or of Redis and the
bucket (``--remote redis+s3``), and the proxy counts the requests.  For
each round trip in ``--rtt-ms``:

- node A, an empty store, writes N kernels in Triton's layout
  (``bench_warmstart``'s POPULATE: 8 files a kernel) and publishes them
  through the proxy: its time and its requests, per file;
- then, repeatedly and in rotating order, end to end (``mount`` + load):
  **A** (its own store, remounted), **B lazy** (an empty store, ``mount
  --no-prefetch``: fetching as Triton asks, with the look-ahead),
  **B default** (an empty store, a plain ``mount``: the startup set streams
  in the background while Triton loads), **B+prefetch** (an empty store,
  ``mount --prefetch``: the startup set before ``mount`` returns).

After each B+prefetch arm, node A's blobs are written as files to a plain
directory of the same disk, as a prefetch writes them: the disk's own rate,
the ceiling of the prefetch's, printed beside it (a virtual disk's
small-file writes vary several-fold from one minute to the next).

Every arm's load hashes every file it read (outside its timing): each must
match node A's, byte for byte, or the benchmark fails naming the files.
Prints per arm the mount, load and total seconds, the ratio to A's total,
and the requests by method (S3) or command (Redis) between the mount and
the end of the load (the unmount's own requests, the startup set sent,
apart), the CPU seconds of the daemon, of the load and of this process (the
proxies), and the daemon's fetch counters.  Each arm starts after a
``sync`` (the last arm's dirty pages are not written back during its
creates) and a probe of the disk (1,000 files of 32 KiB; their cost per
file is printed beside the arm: a virtual disk slows for a while after
heavy writes; ``settle`` probes again until a file costs at most
``--settle-us``, and the wait is printed).  ``--arms`` runs some of the
new node's arms (after A, in the order given).  Numbers are only
meaningful on an otherwise idle machine.

    .venv/bin/python scripts/bench/bench_network.py --kernels 1500 --rtt-ms 0,20,50 [--remote s3|redis+s3]
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import random
import re
import resource
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from urllib.parse import urlsplit

sys.path.insert(0, str(Path(__file__).resolve().parent))
from _benchlib import CLI, median, redis_server, seaweedfs_s3
from bench_warmstart import POPULATE, run_json

from mithrilfs.testing.delay_proxy import DelayProxy

#: bench_warmstart's LOAD, hashing every file it reads (the group file too) outside the time it reports,
#: and writing {path under the cache: sha256} to argv[2].
LOAD_HASHED = r"""
import hashlib, json, os, sys, time
from triton.runtime.cache import FileCacheManager
keys = json.load(open(sys.argv[1]))
root = os.environ["TRITON_CACHE_DIR"]
digests, hashing, total = {}, 0.0, 0
t = time.perf_counter()
for key in keys:
    mgr = FileCacheManager(key)
    group = mgr.get_group("kernel.json")
    if group is None:
        sys.exit(f"kernel {key} is not in the cache")
    paths = [os.path.join(mgr.cache_dir, "__grp__kernel.json"), *group.values()]
    for path in paths:
        with open(path, "rb") as f:
            data = f.read()
        h = time.perf_counter()
        digests[os.path.relpath(path, root)] = hashlib.sha256(data).hexdigest()
        total += len(data)
        hashing += time.perf_counter() - h
seconds = time.perf_counter() - t - hashing
with open(sys.argv[2], "w") as f:
    json.dump(digests, f)
print(json.dumps({"seconds": seconds, "files": len(digests), "bytes": total}))
"""

ARMS = ("A", "B lazy", "B default", "B+prefetch")
#: How each arm mounts.
ARM_FLAGS = {"A": (), "B lazy": ("--no-prefetch",), "B default": (), "B+prefetch": ("--prefetch",)}
#: The areas of the bucket's layout (docs/design.md, "A bucket"): what an S3 request is about.
AREAS = ("blobs", "packs", "names", "startup", "epoch", "bad")


def s3_area(method: str, target: str) -> str:
    """``label`` for the S3 proxy: the method and the layout's area the key is in (else the query's first
    parameter: a listing's ``?list-type``, a bulk delete's ``?delete``)."""
    parts = urlsplit(target)
    area = next((s for s in parts.path.split("/") if s in AREAS), None)
    return f"{method} {area or '?' + parts.query.split('=')[0].split('&')[0]}"


class Node:
    """How a mount is made: the --remote arguments and the AWS variables, pointing at the proxies."""

    def __init__(self, remote: list[str], env: dict[str, str]) -> None:
        self.remote = remote
        self.env = env

    def mount(self, mp: Path, store: Path, *extra: str) -> str:
        res = subprocess.run([*CLI, "mount", str(mp), "--store", str(store), *self.remote, "--min-age", "0", *extra],
                             capture_output=True, text=True, env=dict(os.environ, **self.env), timeout=3600)
        if res.returncode != 0:
            sys.exit(f"mount failed: {res.stderr.strip()}")
        return res.stdout + res.stderr

    @staticmethod
    def umount(mp: Path) -> None:
        res = subprocess.run([*CLI, "umount", str(mp)], capture_output=True, text=True, timeout=600)
        if res.returncode != 0:
            sys.exit(f"umount failed: {res.stderr.strip()}")


def drained(mp: Path) -> None:
    """Wait until node A's uploads are all sent (its write-behind queue is empty)."""
    while json.loads((mp / ".mithrilfs" / "stats.json").read_text())["upload_queue"]:
        time.sleep(0.1)


class Proxies:
    """The S3 proxy and, with Redis in front, the Redis one: counted and reset together."""

    def __init__(self, s3: DelayProxy, redis: DelayProxy | None) -> None:
        self.s3, self.redis = s3, redis

    def reset(self) -> None:
        self.s3.reset()
        if self.redis is not None:
            self.redis.reset()

    def snapshot(self) -> dict[str, dict[str, int]]:
        out = {"s3": requests_only(self.s3.counts()), "s3_areas": self.s3.labels()}
        if self.redis is not None:
            out["redis"] = requests_only(self.redis.counts())
        return out


def requests_only(counts: dict[str, int]) -> dict[str, int]:
    """The proxy's counts without the byte counters (kept apart: they are not requests)."""
    return {k: v for k, v in sorted(counts.items(), key=lambda kv: -kv[1]) if not k.startswith("bytes_")} | {
        k: counts[k] for k in ("bytes_up", "bytes_down") if k in counts}


def check_files(arm: str, got: dict[str, str], expected: dict[str, str]) -> None:
    """Every file the arm read must be node A's, byte for byte (their sha256)."""
    bad = sorted(p for p in expected if got.get(p) != expected[p]) + sorted(set(got) - set(expected))
    if bad:
        sys.exit(f"{arm}: {len(bad)} of {len(expected)} files differ from node A's, e.g. {', '.join(bad[:5])}")


def one_rtt(rtt: float, args: argparse.Namespace, base: Path, s3_env: dict[str, str], redis_url: str | None,
            say: Callable[[str], None]) -> dict:
    """Node A publishes, then the arms load, all through proxies adding *rtt* ms; returns the figures."""
    s3_target = urlsplit(s3_env["AWS_ENDPOINT_URL"])
    with contextlib.ExitStack() as stack:
        s3 = stack.enter_context(DelayProxy("127.0.0.1", s3_target.port or 80, rtt, "http",
                                            connect_rtts=args.connect_rtts, label=s3_area))
        rp = None
        remote = []
        namespace = f"rtt{rtt:g}".replace(".", "_")
        if redis_url is not None:
            import redis as redis_py

            redis_py.Redis.from_url(redis_url).flushall()  # straight, not through the proxy: each RTT starts empty
            target = urlsplit(redis_url)
            rp = stack.enter_context(DelayProxy("127.0.0.1", target.port or 6379, rtt, "redis",
                                                connect_rtts=args.connect_rtts))
            remote += ["--remote", f"redis://127.0.0.1:{rp.port}{target.path}"]
        remote += ["--remote", "s3://bench/network", "--remote-namespace", namespace]
        node = Node(remote, dict(s3_env, AWS_ENDPOINT_URL=f"http://127.0.0.1:{s3.port}"))
        proxies = Proxies(s3, rp)
        run_dir = base / namespace
        run_dir.mkdir()
        mp = base / "mnt"  # one path for every node and RTT: Triton's group files hold absolute paths
        keys_file = run_dir / "keys.json"
        files = args.kernels * 8

        node.mount(mp, run_dir / "store-a")
        proxies.reset()
        t = time.monotonic()
        try:
            keys = run_json(POPULATE, [str(args.kernels), str(random.randrange(1 << 30))], mp / "triton")
            keys_file.write_text(json.dumps(keys))
            written_s, written = time.monotonic() - t, proxies.snapshot()
            drained(mp)
            publish_s = time.monotonic() - t
            publish = proxies.snapshot()
        finally:
            node.umount(mp)
        publish_umount = proxies.snapshot()
        say(f"\nrtt {rtt:g} ms: node A wrote and published {args.kernels} kernels ({files} files)"
            f" in {publish_s:.1f} s (the writes {written_s:.1f} s, then the upload queue drained)")
        say(describe("  while writing", written, files))
        say(describe("  publish", publish, files))
        say(describe("  publish + unmount", publish_umount, files))

        expected: dict[str, str] | None = None
        chosen = ("A", *args.arms)  # A first: its files are the reference
        arms: dict[str, list[dict]] = {arm: [] for arm in chosen}
        for rep in range(args.reps):
            for arm in chosen if rep % 2 == 0 else ("A", *reversed(chosen[1:])):
                store = run_dir / ("store-a" if arm == "A" else f"store-{rep}-{arm.split()[-1].strip('+')}")
                digests = run_dir / f"digests-{rep}-{arm.replace(' ', '_')}.json"
                os.sync()  # the last arm's dirty pages written back now, not during this arm's creates
                disk = settle(run_dir / f"probe-{rep}-{arm.replace(' ', '_')}", args.settle_us, args.settle_s)
                disk_us = disk["us"]
                proxies.reset()
                t, own, busy = time.monotonic(), time.process_time(), machine_busy()
                out = node.mount(mp, store, *ARM_FLAGS[arm])
                mount_s = time.monotonic() - t
                try:
                    loader = cpu_of(resource.getrusage(resource.RUSAGE_CHILDREN))
                    load = run_json(LOAD_HASHED, [str(keys_file), str(digests)], mp / "triton")
                    loaded = proxies.snapshot()
                    stats = json.loads((mp / ".mithrilfs" / "stats.json").read_text())
                    cpu = {"daemon": daemon_cpu(stats["pid"]), "proxies": time.process_time() - own,
                           "machine": machine_busy() - busy, "cores": (os.cpu_count() or 1) * (time.monotonic() - t),
                           "load": cpu_of(resource.getrusage(resource.RUSAGE_CHILDREN)) - loader}
                finally:
                    node.umount(mp)
                got = json.loads(digests.read_text())
                if expected is None:  # the first arm is always A: its own store, the files it wrote
                    expected = got
                check_files(f"rtt {rtt:g} ms, rep {rep}, {arm}", got, expected)
                m = re.search(r"prefetched .*", out)
                ran = stats.get("prefetch", {})
                behind = (f"background prefetch {ran.get('state')}: {ran.get('files', 0)} files in"
                          f" {ran.get('seconds', 0):.1f} s, {ran.get('hurried', 0)} batches hurried by reads"
                          if ran.get("background") else None)
                fig = {"mount_s": mount_s, "load_s": load["seconds"], "total_s": mount_s + load["seconds"],
                       "files": load["files"], "bytes": load["bytes"], "requests": loaded,
                       "unmount_requests": diff(proxies.snapshot(), loaded),
                       "prefetch": m.group(0) if m else None, "background": behind, "cpu": cpu, "disk_us": disk_us,
                       "fetches": {k: v for k, v in sorted(stats.items()) if k.startswith("remote_")
                                   and isinstance(v, int) and v and not k.endswith("_bytes")}}
                if arm == "B+prefetch":  # what the same disk does alone, right after: a prefetch's ceiling
                    fig["disk_alone"] = disk_alone(run_dir / "store-a" / "objects", run_dir / f"plain-{rep}")
                arms[arm].append(fig)
                say(f"  rep {rep} {arm:10s} mount {mount_s:7.2f} s  load {load['seconds']:7.2f} s"
                    f"  total {fig['total_s']:7.2f} s  ({load['files']} files checked)"
                    + f"  cpu: daemon {cpu['daemon']:.2f} s, load {cpu['load']:.2f} s, proxies {cpu['proxies']:.2f} s,"
                    + f" the machine {cpu['machine']:.1f} of {cpu['cores']:.1f} core-seconds"
                    + f"  disk before: {disk_us:.0f} us a 32 KiB file"
                    + (f" (after {disk['waited_s']:.0f} s waiting for it to settle)" if disk["waited_s"] else "")
                    + (f"  [{fig['prefetch']}]" if fig["prefetch"] else "")
                    + (f"  [{behind}]" if behind else "")
                    + (f"\n  rep {rep} {'':10s} the same {fig['disk_alone']['files']} blobs written to a plain"
                       f" directory of that disk: {fig['disk_alone']['seconds']:.1f} s"
                       f" ({fig['disk_alone']['mib_s']:.1f} MiB/s)" if "disk_alone" in fig else ""))
        return {"rtt_ms": rtt, "publish_s": round(publish_s, 3), "publish_requests": publish,
                "written_s": round(written_s, 3), "written_requests": written,
                "publish_unmount_requests": diff(publish_umount, publish), "arms": arms}


def machine_busy() -> float:
    """Core-seconds the whole machine has been busy (``/proc/stat``: every process, the bucket server and
    the store's writing process too, and the kernel): what the node's arm competes with on 2 cores."""
    fields = Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]
    user, nice, system, _idle, _iowait, irq, softirq = (int(x) for x in fields[:7])
    return (user + nice + system + irq + softirq) / os.sysconf("SC_CLK_TCK")


def cpu_of(usage: resource.struct_rusage) -> float:
    return usage.ru_utime + usage.ru_stime


def daemon_cpu(pid: int) -> float:
    """CPU seconds the mount's daemon has used (it started with the mount: all of it is this arm's)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def disk_alone(objects: Path, plain: Path) -> dict:
    """Node A's blobs (their sizes) written as files to a plain directory of the same disk, as a prefetch
    writes them: what the disk itself allows a prefetch, printed beside the prefetch's own rate."""
    return write_files([e.stat().st_size for shard in os.scandir(objects) if shard.is_dir()
                        for e in os.scandir(shard.path)], plain)


def disk_probe(plain: Path) -> float:
    """Microseconds a 32 KiB file costs the disk now (1,000 written as a prefetch writes them, then
    synced): printed before each arm, so a slow moment of the disk shows beside the arm it slowed."""
    written = write_files([32 << 10] * 1000, plain)
    os.sync()
    return written["seconds"] / written["files"] * 1e6


def settle(plain: Path, quiet_us: float, most_s: float) -> dict:
    """The disk's cost of a 32 KiB file before an arm (``disk_probe``), probed again every 15 s until it is
    at most *quiet_us* (at most *most_s*), and how long that took (0 when the first probe was quiet).

    On a journal-less ext4 (``write_files``) creates cost 85-1,125 us each
    for minutes after a mass deletion (the clean-up of a run that ended a
    few minutes before, or any other job's), and an arm that met it paid
    1-2 s more than the same arm in the next repetition.  A new node's disk
    has not just deleted tens of thousands of files.  Each probe is a new
    directory beside the arm's store, as the store's own directories will
    be: an earlier probe elsewhere on the disk was quiet while the arm's
    directory was not."""
    start, probes = time.monotonic(), 0
    while True:
        us = disk_probe(plain / str(probes))
        probes += 1
        if us <= quiet_us or time.monotonic() - start >= most_s:
            return {"us": us, "waited_s": time.monotonic() - start if probes > 1 else 0.0}
        time.sleep(min(15.0, max(0.0, most_s - (time.monotonic() - start))))


def write_files(sizes: list[int], plain: Path) -> dict:
    """Files of *sizes* written as a prefetch writes blobs (256 subdirectories, each file created in a
    staging directory, written, renamed into place), timed, and kept until the run ends.

    Kept because a journal-less ext4 (this machine's
    root) makes a new file skip, one buffer lookup each, every free inode
    of its block group deleted in the last minutes (``recently_deleted``):
    12,000 files removed here made the next arm's creates cost 460-650 us
    each instead of 9 (``perf``: 70% of their samples), so the new node's
    arms paid for the benchmark's own clean-up.  A new node's disk has just
    deleted nothing.  A run started within about five minutes of another's
    end meets that one's clean-up: the probe before each arm shows it
    (issue 33's H8)."""
    data = os.urandom(max(sizes, default=0))
    staging = plain / "staging"
    staging.mkdir(parents=True)
    t = time.monotonic()
    for i, size in enumerate(sizes):
        shard = plain / f"{i % 256:02x}"
        if i < 256:
            shard.mkdir()
        tmp = staging / str(i)
        with open(tmp, "wb") as f:
            f.write(data[:size])
        os.rename(tmp, shard / str(i))
    seconds = time.monotonic() - t
    return {"files": len(sizes), "bytes": sum(sizes), "seconds": round(seconds, 3),
            "mib_s": sum(sizes) / max(seconds, 1e-6) / (1 << 20)}


def diff(after: dict[str, dict[str, int]], before: dict[str, dict[str, int]]) -> dict[str, dict[str, int]]:
    """Counts in *after* not yet in *before*, per proxy (zeros left out)."""
    return {side: {k: n - before.get(side, {}).get(k, 0) for k, n in counts.items()
                   if n - before.get(side, {}).get(k, 0)} for side, counts in after.items()}


def describe(label: str, snap: dict[str, dict[str, int]], files: int) -> str:
    """One line per proxy: the requests by method or command, and per file."""
    lines = []
    for side in ("s3", "redis"):
        counts = snap.get(side)
        if counts is None:
            continue
        total = counts.get("requests", 0)
        kinds = {k: n for k, n in counts.items() if k.isupper() and k != "LIST"} | (
            {"LIST": counts["LIST"]} if "LIST" in counts else {})
        by = ", ".join(f"{k} {n}" for k, n in sorted(kinds.items(), key=lambda kv: -kv[1]))
        areas = ""
        if side == "s3" and snap.get("s3_areas"):
            areas = "; " + ", ".join(f"{k} {n}" for k, n in sorted(snap["s3_areas"].items(), key=lambda kv: -kv[1]))
        lines.append(f"{label} {side}: {total} requests ({total / files:.2f} a file) in"
                     f" {counts.get('connections', 0)} connections, {counts.get('round_trips', 0)} round trips:"
                     f" {by or '-'}{areas}"
                     + (f"; {counts['unparsed']} connections NOT PARSED (uncounted)" if counts.get("unparsed") else ""))
    return "\n".join(lines)


def summary(results: list[dict], files: int, say: Callable[[str], None]) -> None:
    say("\nend to end (mount + load), median of the reps; requests from the mount to the end of the load;"
        " 'x A' the medians' ratio, 'each rep' the ratio to node A in the same repetition (node A's own time"
        " varies from one minute to the next on a shared machine)")
    say(f"{'rtt':>6s} {'arm':11s} {'mount (s)':>10s} {'load (s)':>9s} {'total (s)':>10s} {'x A':>6s}"
        f" {'s3 req':>7s} {'/file':>6s} {'redis':>6s}  each rep")
    for r in results:
        a_figs = r["arms"]["A"]
        a_total = median([f["total_s"] for f in a_figs])
        for arm, figs in r["arms"].items():
            total = median([f["total_s"] for f in figs])
            s3 = median([f["requests"]["s3"].get("requests", 0) for f in figs])
            rd = median([f["requests"].get("redis", {}).get("requests", 0) for f in figs])
            each = [f["total_s"] / a["total_s"] for f, a in zip(figs, a_figs)]
            say(f"{r['rtt_ms']:6g} {arm:11s} {median([f['mount_s'] for f in figs]):10.2f}"
                f" {median([f['load_s'] for f in figs]):9.2f} {total:10.2f} {total / a_total:6.2f}"
                f" {s3:7.0f} {s3 / files:6.2f} {rd:6.0f}  {', '.join(f'{x:.2f}' for x in each)}"
                f" (median {median(each):.2f})")
    for r in results:
        figs = [f for f in r["arms"].get("B+prefetch", []) if f.get("prefetch") and "disk_alone" in f]
        rates = [float(m.group(1)) for f in figs if (m := re.search(r"\(([\d.]+) MiB/s\)", f["prefetch"]))]
        if rates:
            say(f"{r['rtt_ms']:6g} ms: prefetch {median(rates):.1f} MiB/s (reps {', '.join(f'{x:.1f}' for x in rates)});"
                f" the same blobs written to a plain directory of the disk"
                f" {median([f['disk_alone']['mib_s'] for f in figs]):.1f} MiB/s"
                f" (reps {', '.join(format(f['disk_alone']['mib_s'], '.1f') for f in figs)})")
    say("\nrequests per arm (the last rep), by method / command and by area of the bucket")
    for r in results:
        for arm, figs in r["arms"].items():
            say(describe(f"{r['rtt_ms']:6g} ms {arm:11s}", figs[-1]["requests"], files))
            if any(figs[-1]["unmount_requests"].get(s, {}).get("requests") for s in ("s3", "redis")):
                say(describe(f"{'':6s}    {arm:11s} unmount", figs[-1]["unmount_requests"], files))
            if figs[-1].get("fetches"):
                say(f"{'':6s}    {arm:11s} the daemon's counters: "
                    + ", ".join(f"{k} {v}" for k, v in figs[-1]["fetches"].items()))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kernels", type=int, default=1500)
    ap.add_argument("--rtt-ms", default="0,20,50", help="round trips to add, a comma-separated list (default 0,20,50)")
    ap.add_argument("--reps", type=int, default=1)
    ap.add_argument("--remote", choices=("s3", "redis+s3"), default="s3",
                    help="the shared tier: a SeaweedFS bucket, or Redis in front of it (both behind proxies)")
    ap.add_argument("--connect-rtts", type=int, default=1,
                    help="round trips a new connection costs (1: TCP; a TLS endpoint would be 2 or 3)")
    ap.add_argument("--base", default=None, metavar="DIR", help="where the stores and the mount point go")
    ap.add_argument("--arms", default=",".join(ARMS[1:]),
                    help=f"the new node's arms to run after A, in this order, comma-separated (default: {', '.join(ARMS[1:])})")
    ap.add_argument("--settle-us", type=float, default=100.0,
                    help="before each arm, wait until a 32 KiB file costs the disk at most this (default 100 us)")
    ap.add_argument("--settle-s", type=float, default=420.0, help="... for at most this long (default 420 s)")
    ap.add_argument("--json", action="store_true")
    args = ap.parse_args()
    args.arms = [a.strip() for a in args.arms.split(",") if a.strip()]
    if unknown := [a for a in args.arms if a not in ARMS[1:]]:
        ap.error(f"--arms: no arm {unknown[0]!r} (the arms: {', '.join(ARMS[1:])})")
    try:
        rtts = [float(x) for x in args.rtt_ms.split(",") if x.strip()]
    except ValueError:
        ap.error(f"--rtt-ms must be numbers separated by commas, not {args.rtt_ms!r}")
    if not rtts or min(rtts) < 0 or args.kernels < 1 or args.reps < 1:
        ap.error("--rtt-ms needs non-negative numbers, --kernels and --reps at least 1")

    def say(line: str) -> None:
        print(line, file=sys.stderr if args.json else sys.stdout, flush=True)

    results = []
    with contextlib.ExitStack() as servers, tempfile.TemporaryDirectory(prefix="mithrilfs-bench-network-",
                                                                           dir=args.base) as tmp:
        s3_env = servers.enter_context(seaweedfs_s3())
        redis_url = servers.enter_context(redis_server()) if args.remote == "redis+s3" else None
        base = Path(tmp)
        (base / "mnt").mkdir()
        for rtt in rtts:
            results.append(one_rtt(rtt, args, base, s3_env, redis_url, say))
    if args.json:
        print(json.dumps({"kernels": args.kernels, "files": args.kernels * 8, "remote": args.remote,
                          "connect_rtts": args.connect_rtts, "results": results}))
    else:
        summary(results, args.kernels * 8, say)
    return 0


if __name__ == "__main__":
    sys.exit(main())
