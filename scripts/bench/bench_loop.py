"""The request loop's own CPU time per request, without a kernel: IOCTL (ENOSYS), GETATTR, LOOKUP, READ.

``kernel.Session`` serves a toy filesystem (answers from memory, nothing
awaited) on one end of a SEQPACKET socket pair, which delivers one message
per read like /dev/fuse; a thread on the other end sends requests in
batches of 32 and reads the replies.  Printed: the CPU time of the
session's thread per request (``time.thread_time``), the median over
``--reps`` runs of ``--requests`` each, per opcode.  CPU time, not wall
time, so that a loaded machine moves it little; run it with the code to
compare first on ``PYTHONPATH``:

    PYTHONPATH=/path/to/tree .venv/bin/python scripts/bench/bench_loop.py [--requests 20000] [--reps 5]
"""

from __future__ import annotations

import argparse
import socket
import stat
import statistics
import threading
import time

import trio

from mithrilfs.kernel import abi
from mithrilfs.kernel.api import EntryAttributes, Operations
from mithrilfs.kernel.session import Session

BATCH = 32
DATA = bytes(4096)


class _Toy(Operations):
    """Answers from memory; a READLINK notes the thread's CPU time (the marks around a measurement)."""

    def __init__(self, cpu: list[float] | None = None) -> None:
        self.cpu = cpu if cpu is not None else []

    async def readlink(self, inode, ctx):
        self.cpu.append(time.thread_time())
        return b"x"

    def _attr(self, ino: int) -> EntryAttributes:
        a = EntryAttributes()
        a.st_ino, a.st_mode, a.st_nlink, a.st_size = ino, stat.S_IFREG | 0o644, 1, 4096
        a.attr_timeout = a.entry_timeout = 1.0
        return a

    async def getattr(self, inode, ctx):
        return self._attr(inode)

    async def lookup(self, parent_inode, name, ctx):
        return self._attr(2)

    async def read(self, inode, fh, off, size):
        return DATA[:size]


def _request(opcode: int, unique: int, body: bytes) -> bytes:
    return abi.IN_HEADER.pack(abi.IN_HEADER.size + len(body), opcode, unique, 2, 0, 0, 1, 0, 0) + body


BODIES = {
    "IOCTL": (abi.IOCTL, bytes(32)),
    "GETATTR": (abi.GETATTR, abi.GETATTR_IN.pack(0, 0, 0)),
    "LOOKUP": (abi.LOOKUP, b"kernel.json\0"),
    "READ": (abi.READ, abi.READ_IN.pack(0, 0, 4096, 0, 0, 0, 0)),
}


def measure(kind: str, requests: int) -> float:
    """Microseconds of the session thread's CPU per request of *kind*."""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    for sock in (ours, theirs):  # a batch of replies fits: /dev/fuse never refuses a reply
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, 4 << 20)
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, 4 << 20)
    cpu: list[float] = []
    session = Session(ours.fileno(), _Toy(cpu))
    opcode, body = BODIES[kind]

    def client() -> None:
        theirs.send(_request(abi.INIT, 1, abi.INIT_IN.pack(7, 45, 1 << 20, abi.INIT_EXT | abi.MAX_PAGES, 0) + bytes(44)))
        theirs.recv(1 << 16)
        theirs.send(_request(abi.READLINK, 2, b""))  # the mark: measuring starts
        theirs.recv(1 << 16)
        unique = 10
        for _ in range(requests // BATCH):
            for _ in range(BATCH):
                theirs.send(_request(opcode, unique, body))
                unique += 1
            for _ in range(BATCH):
                theirs.recv(1 << 16)
        theirs.send(_request(abi.READLINK, 3, b""))  # the mark: measuring ends
        theirs.recv(1 << 16)
        theirs.close()

    thread = threading.Thread(target=client)
    thread.start()
    trio.run(session.serve)
    thread.join()
    session.close()
    ours.close()
    return (cpu[1] - cpu[0]) / (requests // BATCH * BATCH) * 1e6


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--requests", type=int, default=20000)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    for kind in BODIES:
        runs = [measure(kind, args.requests) for _ in range(args.reps)]
        print(f"{kind:8s} {statistics.median(runs):6.2f} us CPU each (runs {', '.join(f'{r:.2f}' for r in runs)})")


if __name__ == "__main__":
    main()
