"""The daemon's own time per request, real handlers and no kernel: a Triton first load, and tmp + rename creates.

``bench_warmstart.py`` and ``bench_fs.py --many`` print the daemon's time
per request as the mount serves it: the handler, the reply's write (which
wakes the client) and a handler's code and data fetched again into CPU
caches the client and the kernel used meanwhile.  This script takes the
first apart: it builds a mount's objects on a store (``daemon.wiring.build``)
and hands each request, laid out as /dev/fuse gives it, to
``kernel.Session._dispatch`` in a loop, replies going nowhere, so what it
times is the handlers' own CPU, hot:

- ``first-load``: a store of N Triton kernel directories of 8 files (20-70
  KB) reopened (nothing verified in this mount), then, per directory, its
  LOOKUP and per file LOOKUP, IOCTL and READ, the work after each reply
  (``AFTER_REPLY``: the read-ahead and hash of the file's blob, the
  directory's names) run between requests as an idle loop runs it;
- ``creates``: N files written to ``tmp.N`` and renamed, one directory,
  the requests the kernel sends for them (LOOKUP, CREATE, GETATTR, IOCTL,
  WRITE, FLUSH, RELEASE, LOOKUP, RENAME, GETATTR), each file of its own
  content; SQLite's time per statement is added, by statement.

As in the daemon, blob files are made ahead by a thread of their own
(``store.blank_files``): what the loop pays for a commit is its fill and
link, not the file's create.

Prints microseconds per request by opcode, medians of ``--reps`` runs.

    PYTHONPATH=TREE .venv/bin/python scripts/bench/bench_handlers.py [--files 12000] [--reps 3] [--only first-load|creates]
"""

from __future__ import annotations

import argparse
import collections
import os
import random
import re
import socket
import sqlite3
import stat
import statistics
import sys
import tempfile
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import trio

from mithrilfs.cache.lifetime import NoKernelCaches
from mithrilfs.cache.policy import EvictionPolicy
from mithrilfs.daemon.wiring import build
from mithrilfs.kernel import abi
from mithrilfs.kernel.request_times import OPCODE_LABELS
from mithrilfs.kernel.session import Session
from mithrilfs.store.blank_files import BlankFiles
from mithrilfs.store.namespace import ROOT_INODE
from mithrilfs.store.open import Store, open_store

NAMES = [b"__grp__kernel.json", *(f"kernel.{s}".encode() for s in ("source", "ttir", "ttgir", "llir", "ptx",
                                                                   "cubin", "json"))]


class _TimedConnection(sqlite3.Connection):
    """A connection that adds each statement's time to ``SQL_TIMES`` (by its first 60 characters)."""

    def execute(self, sql: str, *args: Any) -> sqlite3.Cursor:  # type: ignore[override]
        start = time.perf_counter_ns()
        try:
            return super().execute(sql, *args)
        finally:
            SQL_TIMES[re.sub(r"\s+", " ", sql)[:60]].append(time.perf_counter_ns() - start)


SQL_TIMES: dict[str, list[int]] = collections.defaultdict(list)
#: Requests and nanoseconds by opcode, as ``kernel.RequestTimes`` keeps them (``AFTER_REPLY``: the work after).
Times = dict[int, list[int]]


class Driver:
    """Requests handed to one mount's session in turn, timed by the session itself (``kernel.RequestTimes``)."""

    def __init__(self, store: Store) -> None:
        self.store = store
        # as the daemon serves it: blob files made ahead by a thread of their own (``store.blank_files``)
        store.cas.blanks = BlankFiles(store.cas.staging, burst=store.cas.make_shards)
        self.mounted = build(store, EvictionPolicy(max_bytes=1 << 40), NoKernelCaches())
        self._pair = socket.socketpair()  # the session's notifier writes to an fd of its own; nothing is sent
        self.session = Session(self._pair[0].fileno(), self.mounted.ops, after_reply=self.mounted.after_reply,
                               request_times=self.mounted.request_times)
        self.session._ready = True  # as after INIT
        self._buf = bytearray(1 << 22)
        self._view = memoryview(self._buf)
        self._unique = 10
        self._answer: bytes | None = None

    def _reply(self, unique: int, payload: bytes | memoryview | None) -> None:
        self._answer = bytes(payload) if payload is not None else b""

    def _reply_error(self, unique: int, code: int) -> None:
        self._answer = None

    async def send(self, opcode: int, nodeid: int, body: bytes) -> bytes | None:
        """Serve one request as the session's loop would; its answer (None: an error)."""
        request = abi.IN_HEADER.pack(abi.IN_HEADER.size + len(body), opcode, self._unique, nodeid, 0, 0, 1, 0,
                                     0) + body
        self._unique += 1
        n = len(request)
        self._buf[:n] = request
        suspended = self.session._dispatch(self._buf, self._view, n, self._reply, self._reply_error)
        if suspended is not None:
            await self.session._finish(*suspended)
        return self._answer

    def idle(self) -> None:
        """Run the work left for after the replies, one job at a time (as the loop does when nothing waits)."""
        while self.session._idle_work():
            pass

    def run(self, requests: Callable[[], Awaitable[None]]) -> Times:
        """Send what *requests* sends, then close the session and the store; the requests and the
        nanoseconds spent on them, by opcode."""
        try:
            trio.run(requests)
        finally:
            self.session.close()
            for end in self._pair:
                end.close()
            self.store.close()  # its blanks too
        return self.mounted.request_times.by_opcode


def populate(root: Path, dirs: int) -> list[bytes]:
    """*dirs* Triton kernel directories of ``NAMES`` under ``triton/``, written straight into the store."""
    store = open_store(root)
    rnd = random.Random(1)
    ns = store.ns
    with ns.txn():
        top = ns.create_inode(stat.S_IFDIR | 0o755, 0, 0, nlink=2)
        ns.link(ROOT_INODE, b"triton", top.id)
    keys = []
    for _ in range(dirs):
        key = format(rnd.getrandbits(256), "064x").encode()
        with ns.txn():
            d = ns.create_inode(stat.S_IFDIR | 0o755, 0, 0, nlink=2)
            ns.link(top.id, key, d.id)
        for name in NAMES:
            data = rnd.randbytes(rnd.randrange(20_000, 70_000))
            digest, _ = store.blobs.add_bytes(data)
            with ns.txn():
                ino = ns.create_inode(stat.S_IFREG | 0o644, 0, 0)
                ns.link(d.id, name, ino.id)
                ns.set_content(ino, digest, len(data), ino.mtime_ns)
        keys.append(key)
    store.close()
    return keys


def first_load(root: Path, keys: list[bytes]) -> Times:
    driver = Driver(open_store(root))

    def entry(answer: bytes | None) -> tuple[int, int]:
        assert answer is not None
        fields = abi.ENTRY_OUT.unpack_from(answer)
        return fields[0], fields[7]  # nodeid, size

    async def run() -> None:
        top, _ = entry(await driver.send(abi.LOOKUP, ROOT_INODE, b"triton\0"))
        driver.idle()
        for key in keys:
            d, _ = entry(await driver.send(abi.LOOKUP, top, key + b"\0"))
            driver.idle()
            for name in NAMES:
                ino, size = entry(await driver.send(abi.LOOKUP, d, name + b"\0"))
                driver.idle()
                await driver.send(abi.IOCTL, ino, bytes(32))
                data = await driver.send(abi.READ, ino, abi.READ_IN.pack(0, 0, 1 << 17, 0, 0, 0, 0))
                if data is None or len(data) != size:
                    sys.exit(f"READ of inode {ino} answered {None if data is None else len(data)} bytes, not {size}")

    return driver.run(run)


def creates(root: Path, files: int, rep: int) -> Times:
    driver = Driver(open_store(root))

    async def run() -> None:
        made = await driver.send(abi.MKDIR, ROOT_INODE, abi.MKDIR_IN.pack(0o755, 0o022) + f"d{rep}".encode() + b"\0")
        assert made is not None
        d = abi.ENTRY_OUT.unpack_from(made)[0]
        for i in range(files):
            tmp, final = f"tmp.{i}".encode() + b"\0", f"f{i:06d}".encode() + b"\0"
            data = (rep * files + i).to_bytes(8, "little") * 512  # content of its own: no file is a dedup hit
            await driver.send(abi.LOOKUP, d, tmp)
            answer = await driver.send(abi.CREATE, d, abi.CREATE_IN.pack(os.O_WRONLY | os.O_CREAT | os.O_TRUNC,
                                                                         0o100644, 0o022, 0) + tmp)
            assert answer is not None
            ino, fh = abi.ENTRY_OUT.unpack_from(answer)[0], abi.OPEN_OUT.unpack_from(answer, abi.ENTRY_OUT.size)[0]
            await driver.send(abi.GETATTR, ino, abi.GETATTR_IN.pack(0, 0, 0))
            await driver.send(abi.IOCTL, ino, bytes(32))
            await driver.send(abi.WRITE, ino, abi.WRITE_IN.pack(fh, 0, len(data), 0, 0, 0, 0) + data)
            await driver.send(abi.FLUSH, ino, abi.FLUSH_IN.pack(fh, 0, 0, 0))
            await driver.send(abi.RELEASE, ino, abi.RELEASE_IN.pack(fh, 0, 0, 0))
            await driver.send(abi.LOOKUP, d, final)
            await driver.send(abi.RENAME, d, abi.RENAME_IN.pack(d) + tmp + final)
            await driver.send(abi.GETATTR, ino, abi.GETATTR_IN.pack(0, 0, 0))
            driver.idle()

    return driver.run(run)


def report(title: str, runs: list[Times], per: int, *, sql: bool = False) -> None:
    """Microseconds per request by opcode, and per file (*per* files a run), medians over *runs*."""
    print(title)
    for op in sorted(runs[0], key=lambda op: -runs[0][op][1]):
        each = [r[op][1] / r[op][0] / 1000 for r in runs]
        count = runs[0][op][0] / per
        print(f"  {OPCODE_LABELS[op]:12s} {statistics.median(each):7.1f} us each, {count:5.2f} a file"
              f"  (runs {', '.join(f'{x:.1f}' for x in each)})")
    total = [sum(ns for _, ns in r.values()) / per / 1000 for r in runs]
    print(f"  {'all':12s} {statistics.median(total):7.1f} us a file (runs {', '.join(f'{x:.1f}' for x in total)})")
    if sql:
        print(f"  SQLite, all runs, us a file: {sum(sum(v) for v in SQL_TIMES.values()) / per / len(runs) / 1000:.1f}")
        for stmt, ts in sorted(SQL_TIMES.items(), key=lambda kv: -sum(kv[1]))[:8]:
            print(f"    {sum(ts) / per / len(runs) / 1000:6.1f} us a file  {len(ts) / per / len(runs):4.2f} x"
                  f" {statistics.mean(ts) / 1000:6.1f} us  {stmt}")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--files", type=int, default=12000, help="files a run (first load: 8 a directory)")
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--only", choices=("first-load", "creates"))
    ap.add_argument("--dir", default=None, help="where the stores go (default: the temporary directory)")
    args = ap.parse_args()
    connect: Callable[..., sqlite3.Connection] = sqlite3.connect
    with tempfile.TemporaryDirectory(dir=args.dir) as tmp:
        if args.only in (None, "first-load"):
            keys = populate(Path(tmp) / "triton-store", max(1, args.files // len(NAMES)))
            report(f"first load of {len(keys)} kernel directories ({len(keys) * len(NAMES)} files),"
                   " after a remount", [first_load(Path(tmp) / "triton-store", keys) for _ in range(args.reps)],
                   len(keys) * len(NAMES))
        if args.only in (None, "creates"):
            SQL_TIMES.clear()
            sqlite3.connect = lambda *a, **k: connect(*a, **{"factory": _TimedConnection, **k})  # type: ignore[assignment]
            try:
                runs = [creates(Path(tmp) / "creates-store", args.files, rep) for rep in range(args.reps)]
            finally:
                sqlite3.connect = connect  # type: ignore[assignment]
            report(f"{args.files} files written to tmp.N and renamed, one directory", runs, args.files, sql=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
