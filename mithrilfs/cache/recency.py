"""Last-use times: the daemon's own clock for eviction's LRU order.

Set on ``lookup`` and ``getattr`` (the kernel's revalidations, at most one a
minute per file in use) in memory and written to ``inodes.atime_ns`` in
batches, never the backing filesystem's atime.
"""

from __future__ import annotations

import time

from mithrilfs.store.namespace import Namespace


class Recency:
    """Last-use times kept in memory and flushed to the namespace in batches."""

    def __init__(self, ns: Namespace) -> None:
        self.ns = ns
        self.pending: dict[int, int] = {}

    def touch(self, ino: int, now_ns: int | None = None) -> None:
        self.pending[ino] = now_ns if now_ns is not None else time.time_ns()

    def get(self, ino: int, stored_ns: int) -> int:
        return self.pending.get(ino, stored_ns)

    def forget(self, ino: int) -> None:
        self.pending.pop(ino, None)

    def flush(self) -> int:
        if not self.pending:
            return 0
        items = [(t, ino) for ino, t in self.pending.items()]
        with self.ns.txn():
            self.ns.set_atimes(items)
        self.pending.clear()
        return len(items)
