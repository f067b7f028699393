"""This mount's record of its startup set: its workload's first reads, in order, written rarely.

The first reads are buffered, and the mount writes its own record
(``stores.records``: one object or key per mount, written over) at most once
every ``WRITE_SECONDS`` while it records, and once at its unmount: a handful
of writes per mount, whatever its workload reads, and nothing for a reader
to merge or compact (a write per uploader batch would be thousands of
objects for one load, each merged by every reader: see docs/benchmarks.md,
"H, a new node across a 20 ms bucket").

Each path goes with its entry as the tier holds it (the origin node and
version the name was materialized with, or this node's for its own
files) and its directories before it, so a reader creates the names
without asking for a manifest.  Only names already published go in: a
reader must never be handed a name whose content is not in the tier yet.
"""

from __future__ import annotations

import logging
import stat
import time
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from mithrilfs.shared.stores.base import RemoteStore
from mithrilfs.shared.stores.entries import RemoteEntry, RemoteError
from mithrilfs.shared.stores.records import MAX_RECORD_PATHS, new_record_id
from mithrilfs.store.namespace import ROOT_INODE, DirPaths, Namespace, join_path

log = logging.getLogger(__name__)

#: A workload's first reads in this long after the mount make its record.
STARTUP_SECONDS = 300.0
#: A mount writes its record at most this often while it records (and once more at its unmount).
WRITE_SECONDS = 60.0
#: How long an unmount waits to write the record (a dead tier must not hold it).
UNMOUNT_WAIT = 5.0


class StartupRecorder:
    """Records first reads into set *name* (see the module doc); ``due``/``write`` are the uploader's."""

    def __init__(self, name: str, *, ns: Namespace, paths: DirPaths, remote: RemoteStore, counters: dict[str, int],
                 node: str, origin: dict[int, str], thread: Callable[..., Awaitable[Any]]) -> None:
        self.ns = ns
        self.paths = paths
        self.remote = remote
        #: The tier's time here: what the record and its entries are dated by.
        self.clock = remote.clock
        self.counters = counters
        self.node = node
        #: Writer of content materialized this mount, by inode (``Reconciler.origin``).
        self.origin = origin
        #: The tier's worker threads, for the record's write.
        self.thread = thread
        self.name = name
        #: This mount's record: sorts newest first among the set's (``stores.records.new_record_id``), dated by
        #: the tier's clock when first written (measured by then: the uploader's first look at the epoch),
        #: back to the mount's start.
        self.record_id = ""
        self._started = time.monotonic()
        #: Inodes in first-read order.
        self._order: list[int] = []
        self._seen: set[int] = set()
        self._dirty = False
        #: The first write comes a full interval after the mount: a short load writes once, at its unmount.
        self._written_at = time.monotonic()

    def read(self, ino: int) -> None:
        """The first read of a file in this mount: in the first ``STARTUP_SECONDS``, it joins the record."""
        if (ino in self._seen or len(self._order) >= MAX_RECORD_PATHS
                or time.monotonic() - self._started > STARTUP_SECONDS):
            return
        self._seen.add(ino)
        self._order.append(ino)
        self._dirty = True

    def due(self) -> bool:
        return self._dirty and time.monotonic() - self._written_at >= WRITE_SECONDS

    async def write(self, *, last: bool = False) -> None:
        """Write the record over (RemoteError when the tier refuses: it stays due)."""
        if not self._dirty:
            return
        items = self.items()
        if not self.record_id:
            started_us = self.clock.now_us() - round((time.monotonic() - self._started) * 1e6)
            self.record_id = new_record_id(started_us * 1000)
        self._dirty = False
        self._written_at = time.monotonic()
        try:
            await self.thread(lambda: self.remote.write_startup_record(
                self.name, self.record_id, items, last=last))
        except BaseException:
            self._dirty = True
            raise
        counters = self.counters
        counters["startup_set_writes"] = counters.get("startup_set_writes", 0) + 1

    async def unmounting(self) -> None:
        """The last write (bounded: an unmount must not wait on a dead tier)."""
        with trio.move_on_after(UNMOUNT_WAIT):
            try:
                await self.write(last=True)
            except RemoteError as e:
                log.warning("startup set not sent: %s", e)

    def items(self) -> list[tuple[str, RemoteEntry]]:
        """(path, entry) of the files read, in order, each published directory once, before what it holds."""
        ns = self.ns
        out: list[tuple[str, RemoteEntry]] = []
        dirs_done: set[int] = {ROOT_INODE}
        for ino in self._order:
            node = ns.get(ino)
            names = ns.names_of(ino) if node is not None else []
            if node is None or not node.is_reg or node.hash is None or not names:
                continue
            parent, name = names[0]
            if not ns.is_published(parent, name):  # not in the tier yet (or never): no reader may get it
                continue
            dir_path = self._add_dirs(parent, out, dirs_done)
            if dir_path is None:
                continue
            out.append((join_path(dir_path, name), RemoteEntry(
                "f", self.clock.version_of(node.ctime_ns), self.origin.get(ino, self.node), node.hash.hex(), node.size,
                stat.S_IMODE(node.mode), node.mtime_ns)))
        return out

    def _add_dirs(self, d: int, out: list[tuple[str, RemoteEntry]], done: set[int]) -> str | None:
        """Entries of *d* and its ancestors not in *out* yet (parents first); *d*'s path, None when gone."""
        chain: list[tuple[int, int, bytes]] = []
        at = d
        while at not in done:
            up = self.ns.names_of(at)
            if not up:
                return None
            chain.append((at, up[0][0], up[0][1]))
            at = up[0][0]
        for child, parent, name in reversed(chain):
            node = self.ns.get(child)
            parent_path = self.paths.of_dir(parent)
            if node is None or parent_path is None:
                return None
            done.add(child)
            out.append((join_path(parent_path, name), RemoteEntry(
                "d", self.clock.version_of(node.ctime_ns), self.origin.get(child, self.node), mode=stat.S_IMODE(node.mode),
                mtime_ns=node.mtime_ns)))
        return self.paths.of_dir(d)
