"""The bare FUSE round trip over /dev/fuse read/write and over io_uring, interleaved.

A toy filesystem (a root and one file, attributes never cached) is served
by a minimal loop in this process, with nothing of mithrilfs but its mount
and its protocol constants, so that what is measured is the transport:

- ``dev``: read(2) a request from /dev/fuse, write(2) the reply;
- ``uring``: one ring, one thread, an entry for every queue (CPU);
- ``uring-percpu``: a thread per CPU, pinned to it, with its own ring and
  its queue's entry (a request made on CPU q completes on CPU q's thread).

A client process makes N calls of each kind (the ``TCGETS`` ioctl Python's
``open()`` sends, answered ENOSYS; ``os.stat``, a GETATTR each) and prints
the microseconds per call; the plain side (the same calls on a local file)
is subtracted.  Needs root and ``enable_uring`` = Y for the io_uring modes
(``--enable`` sets it for the run and puts the old value back).

    .venv/bin/python scripts/bench/bench_uring.py [--calls 20000] [--reps 3] [--enable]
"""

from __future__ import annotations

import argparse
import errno
import os
import stat
import statistics
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from mithrilfs.kernel import abi, uring
from mithrilfs.kernel.mount import mount

CLIENT = r"""
import fcntl, os, sys, termios, time
path, n = sys.argv[1], int(sys.argv[2])
fd = os.open(path, os.O_RDONLY)
out = []
for kind in ("ioctl", "stat"):
    t = time.perf_counter()
    for _ in range(n):
        if kind == "ioctl":
            try:
                fcntl.ioctl(fd, termios.TCGETS, bytes(60))
            except OSError:
                pass
        else:
            os.stat(path)
    out.append((time.perf_counter() - t) / n * 1e6)
print(*out)
"""

ROOT, FILE = 1, 2
#: Requests served by each path (a check that the ring, not /dev/fuse, served the io_uring modes).
SERVED = {"dev": 0, "ring": 0}
MAX_WRITE = 128 * 1024


def _attr(ino: int) -> bytes:
    mode = stat.S_IFDIR | 0o755 if ino == ROOT else stat.S_IFREG | 0o644
    return abi.ATTR_OUT.pack(0, 0, 0, ino, 4096, 8, 0, 0, 0, 0, 0, 0, mode, 1, 0, 0, 0, 4096, 0)


def answer(buf: bytearray, n: int) -> tuple[int, int, bytes | None]:
    """(unique, error, payload) for the request in *buf*: the toy filesystem."""
    _, opcode, unique, nodeid, *_ = abi.IN_HEADER.unpack_from(buf)
    if opcode == abi.GETATTR:
        return unique, 0, _attr(nodeid)
    if opcode == abi.LOOKUP and nodeid == ROOT and bytes(buf[40:n]).rstrip(b"\0") == b"f":
        return unique, 0, abi.ENTRY_OUT.pack(FILE, 0, 3600, 0, 0, 0, *abi.ATTR_OUT.unpack(_attr(FILE))[3:])
    if opcode == abi.LOOKUP:
        return unique, -errno.ENOENT, None
    if opcode in (abi.FORGET, abi.BATCH_FORGET, abi.INTERRUPT):
        return unique, 1, None  # no reply
    return unique, -errno.ENOSYS, None


def init_reply(buf: bytearray, use_uring: bool) -> bytes:
    _, _, unique, *_ = abi.IN_HEADER.unpack_from(buf)
    major, minor, ra, flags, flags2 = abi.INIT_IN.unpack_from(buf, 40)
    offered = flags | flags2 << 32
    if use_uring and not offered & abi.OVER_IO_URING:
        raise SystemExit("the kernel does not offer FUSE_OVER_IO_URING (enable_uring is N?)")
    caps = (abi.INIT_EXT | abi.MAX_PAGES | abi.PARALLEL_DIROPS | (abi.OVER_IO_URING if use_uring else 0)) & offered
    body = abi.INIT_OUT.pack(7, min(minor, 45), ra, caps & 0xFFFFFFFF, 64, 48, MAX_WRITE, 1, MAX_WRITE // 4096, 0,
                             caps >> 32, 0, 0)
    return abi.OUT_HEADER.pack(16 + len(body), 0, unique) + body


def serve_dev(fd: int, stop: threading.Event) -> None:
    buf = bytearray(MAX_WRITE + 4096)
    while not stop.is_set():
        try:
            n = os.readv(fd, [buf])
        except OSError as e:
            if e.errno in (errno.ENOENT, errno.EINTR):
                continue
            return
        unique, err, payload = answer(buf, n)
        SERVED["dev"] += 1
        if err == 1:
            continue
        try:
            os.write(fd, abi.OUT_HEADER.pack(16 + len(payload or b""), err, unique) + (payload or b""))
        except OSError:
            pass


def serve_ring(fd: int, qids: list[int], pin: int | None, ready: threading.Barrier) -> None:
    if pin is not None:
        os.sched_setaffinity(0, {pin})
    ring = uring.Ring(8)
    entries = [uring.Entry(q, MAX_WRITE) for q in qids]
    for i, e in enumerate(entries):
        e.register(ring, fd, i)
    ring.submit_and_wait(0)
    ready.wait()
    buf = bytearray(MAX_WRITE + 4096)
    while True:
        ring.submit_and_wait(1)
        for i, res in list(ring.completions()):
            if res < 0:
                return  # ENOTCONN: unmounted
            e = entries[i]
            n = e.request(buf)
            unique, err, payload = answer(buf, n)
            SERVED["ring"] += 1
            e.commit(ring, fd, i, unique, err if err != 1 else 0, payload)


def client(path: str, calls: int, cpu: int | None) -> tuple[float, float]:
    cmd = [sys.executable, "-c", CLIENT, path, str(calls)]
    if cpu is not None:
        cmd = ["taskset", "-c", str(cpu)] + cmd
    out = subprocess.run(cmd, capture_output=True, text=True, check=True).stdout.split()
    return float(out[0]), float(out[1])


def run_mode(mode: str, calls: int, cpu: int | None) -> tuple[float, float]:
    with tempfile.TemporaryDirectory() as tmp:
        m = mount(tmp)
        fd = m.fd
        buf = bytearray(MAX_WRITE + 4096)
        os.readv(fd, [buf])
        os.write(fd, init_reply(buf, mode != "dev"))
        stop = threading.Event()
        threads = []
        if mode == "dev":
            threads.append(threading.Thread(target=serve_dev, args=(fd, stop), daemon=True))
        else:
            # requests made before every queue has an entry still come through /dev/fuse
            threads.append(threading.Thread(target=serve_dev, args=(fd, stop), daemon=True))
            ncpu = uring.possible_cpus()
            groups = [([q], q) for q in range(ncpu)] if mode == "uring-percpu" else [(list(range(ncpu)), None)]
            ready = threading.Barrier(len(groups) + 1)
            threads += [threading.Thread(target=serve_ring, args=(fd, qids, pin, ready), daemon=True)
                        for qids, pin in groups]
        for t in threads:
            t.start()
        if mode != "dev":
            ready.wait()
        SERVED.update(dev=0, ring=0)
        try:
            return client(os.path.join(tmp, "f"), calls, cpu)
        finally:
            print(f"  {mode}: served {SERVED}", file=sys.stderr)
            stop.set()
            m.unmount()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--calls", type=int, default=20000)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--enable", action="store_true", help="set enable_uring to Y for the run")
    ap.add_argument("--modes", default="dev,uring,uring-percpu")
    ap.add_argument("--cpu", type=int, default=None, help="pin the client to this CPU")
    args = ap.parse_args()
    before = Path(uring.ENABLE_PARAMETER).read_text().strip()
    if args.enable:
        Path(uring.ENABLE_PARAMETER).write_text("Y")
    try:
        with tempfile.NamedTemporaryFile() as f:
            plain = [client(f.name, args.calls, args.cpu) for _ in range(2)]
        base_ioctl = min(p[0] for p in plain)
        base_stat = min(p[1] for p in plain)
        results: dict[str, list[tuple[float, float]]] = {m: [] for m in args.modes.split(",")}
        for _ in range(args.reps):
            for mode in results:
                results[mode].append(run_mode(mode, args.calls, args.cpu))
    finally:
        if args.enable:
            Path(uring.ENABLE_PARAMETER).write_text(before)
    print(f"plain: ioctl {base_ioctl:.1f} us, stat {base_stat:.1f} us (enable_uring was {before})")
    for mode, runs in results.items():
        io = [r[0] - base_ioctl for r in runs]
        st = [r[1] - base_stat for r in runs]
        print(f"{mode:13s} round trip: ioctl {statistics.median(io):6.1f} us ({', '.join(f'{x:.1f}' for x in io)}), "
              f"stat {statistics.median(st):6.1f} us ({', '.join(f'{x:.1f}' for x in st)})")


if __name__ == "__main__":
    main()
