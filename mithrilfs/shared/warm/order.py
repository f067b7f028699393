"""A startup set put to use: its names materialized without manifests, its blobs wanted in its order,
and the look-ahead that keeps a lazy load a few directories ahead of its workload.

A set carries each name's entry (``stores.records``), so loading it is a
handful of requests (``RemoteStore.startup_records``) after which every
name it holds is created locally: a lookup of one of them finds it and asks
nothing, where a lazy node would pay two round trips per directory, one
after the other (its manifest, then its blobs).  Its directories, in the
order the workload first read from them, are what the look-ahead walks:
when a read reaches a directory of the order, the blobs of the next
directories are fetched in the background, ``LOOK_AHEAD_BATCH`` directories
a batch whenever fewer than ``LOOK_AHEAD_DIRS`` ahead are asked for, so the
kernel the workload loads next is usually here when it asks (figures: see
docs/benchmarks.md, "H, a new node across a 20 ms bucket" and "H6, the
look-ahead in batches of 32").

One per mount for the mount's own set (the tier's ``order``), loaded once,
by the prefetch at mount or by the first read that needs the tier; the
``prefetch`` command of another set loads its own (no look-ahead).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol

import trio

from mithrilfs.shared.stores.base import RemoteStore
from mithrilfs.shared.stores.entries import RemoteEntry, RemoteError
from mithrilfs.shared.stores.records import merged
from mithrilfs.store.namespace import DirPaths, Inode, Namespace

log = logging.getLogger(__name__)

#: A read reaching a directory of the order keeps at least this many of the next ones asked for ...
LOOK_AHEAD_DIRS = 32
#: ... asking for them this many at a time, in one batch (their manifests where their places are not
#: known, then their blobs: two waves of parallel requests for the lot, not two round trips per directory
#: through the tier's four threads; see docs/benchmarks.md, "H6, the look-ahead in batches of 32").
LOOK_AHEAD_BATCH = 32
#: Batches in flight at once.
LOOK_AHEAD_BATCHES = 3
#: Names created between two checkpoints of the event loop (requests are served in between), in one
#: transaction: at most this many, ...
MATERIALIZE_BATCH = 500
#: ... and for at most about this long: a background prefetch materializes a set while the workload's
#: first requests wait for the loop (see docs/benchmarks.md, "H9, where B default's last half second goes").
MATERIALIZE_SLICE_SECONDS = 0.002
#: Names created in one batch of statements (``Reconciler.merge_paths``): a kernel directory and its files
#: in a few statements for several directories, not a dozen for each.
MATERIALIZE_STEP = 64
#: Directories (ancestors included) a prefetch lists for the paths a set could not place (``unresolved``: a
#: torn set, names older than the purges read), a request each in a bucket; the paths past it are left to
#: their lookups.  A set naming deep paths that no directory holds would cost a request per level each.
UNRESOLVED_DIRS = 4096


class Purges(Protocol):
    """The deletions this mount knows of (``sync.changes.Changes``), as a set's loader checks them."""

    def learn_kept(self, records: list[bytes]) -> None: ...

    def deleted_since(self, path: str, entry: RemoteEntry) -> bool: ...


class StartupOrder:
    """Startup set *name* as this mount knows it; *look_ahead*: reads reaching it fetch ahead."""

    def __init__(self, name: str, *, ns: Namespace, paths: DirPaths, remote: RemoteStore, counters: dict[str, int],
                 thread: Callable[..., Awaitable[Any]], purges: Purges,
                 merge_paths: Callable[[list[tuple[str, RemoteEntry]], set[int]], list[str]],
                 bring: Callable[[list[Inode], str], Awaitable[None]], look_ahead: bool = False) -> None:
        self.ns = ns
        self.paths = paths
        self.remote = remote
        self.counters = counters
        #: The tier's worker threads, for the set's requests.
        self.thread = thread
        #: What the set's names are checked against.
        self.purges = purges
        #: Materializes a batch of the set's names (``Reconciler.merge_paths``).
        self.merge_paths = merge_paths
        #: Fetches small blobs ahead of their reads (``InFlight.bring``): the look-ahead's.
        self.bring = bring
        self.name = name
        self.look_ahead = look_ahead
        #: (path, entry) in the set's order; None until loaded.
        self.items: list[tuple[str, RemoteEntry]] | None = None
        #: Paths whose directory could not be made from the set (a hostile or torn set): the prefetch
        #: lists those directories instead.
        self.unresolved: list[str] = []
        self._loaded = trio.Event()
        #: The load in progress (its callers wait for it), None when none runs.
        self._attempt: trio.Event | None = None
        #: Directory paths in the order the workload first read from them, and each one's files.
        self.dirs: list[str] = []
        self._files: dict[str, list[bytes]] = {}
        self._index: dict[str, int] = {}
        self._ahead: set[int] = set()
        self._in_flight = trio.CapacityLimiter(LOOK_AHEAD_BATCHES)

    @property
    def loaded(self) -> bool:
        return self._loaded.is_set()

    async def load(self, materialized: Callable[[list[Inode]], None] | None = None) -> None:
        """Read the set (once; a concurrent caller waits for that attempt) and create its names here.

        *materialized*: told the files of each batch of names as soon as they are created, in the set's
        order (a prefetch fetches the first ones while the rest are named); only by the attempt that
        creates them (a caller that waited for another's gets ``files`` after).  RemoteError when the
        tier does not answer (a caller that waited too): the next caller tries again.
        """
        if self.loaded:
            return
        if self._attempt is not None:
            await self._attempt.wait()
            if not self.loaded:
                raise RemoteError(f"the startup set {self.name!r} could not be read")
            return
        self._attempt = trio.Event()
        try:
            records = await self.thread(self.remote.startup_records, self.name)
            kept, floor = await self.thread(self.remote.kept_purges)
            self.purges.learn_kept(kept)
            self.items = self._checked(merged(records), floor)
            await self._materialize(self.items, materialized)
            self.unresolved = self._to_list(self.unresolved)
            for path, entry in self.items:
                if entry.type == "f":
                    d, _, name = path.rpartition("/")
                    if d not in self._files:
                        self._index[d] = len(self.dirs)
                        self.dirs.append(d)
                        self._files[d] = []
                    self._files[d].append(name.encode(errors="surrogateescape"))
            self.counters["startup_set_paths"] = len(self.items)
            self._loaded.set()
            log.info("startup set %s: %d names, %d directories of files", self.name, len(self.items), len(self.dirs))
        finally:
            self._attempt.set()
            self._attempt = None

    def _checked(self, items: list[tuple[str, RemoteEntry]], floor: int) -> list[tuple[str, RemoteEntry]]:
        """The set's names that no deletion known here covers (``forget --fleet``: the tier keeps its
        records; an unlink this mount read on the feed); one older than every purge record read (*floor*)
        may be covered by one left unread: not taken from the set, its directory is listed instead."""
        out = []
        for path, entry in items:
            if self.purges.deleted_since(path, entry):
                continue
            if entry.version < floor:
                self.unresolved.append(path)
                continue
            out.append((path, entry))
        return out

    def _to_list(self, paths: list[str]) -> list[str]:
        """The first of *paths* whose directories, ancestors included, number at most ``UNRESOLVED_DIRS``."""
        dirs: set[str] = {""}
        for i, path in enumerate(paths):
            parts = path.split("/")[:-1]
            new = {"/".join(parts[:n]) for n in range(1, len(parts) + 1)} - dirs
            if len(dirs) + len(new) > UNRESOLVED_DIRS:
                log.warning("startup set %s: %d paths it cannot place are left to their lookups (their directories"
                            " are more than %d to list)", self.name, len(paths) - i, UNRESOLVED_DIRS)
                return paths[:i]
            dirs |= new
        return paths

    async def _materialize(self, items: list[tuple[str, RemoteEntry]],
                           materialized: Callable[[list[Inode]], None] | None) -> None:
        """Create the set's names this node lacks (``Reconciler.merge_paths``: never over a local name,
        never a pending tombstone), each directory before what it holds, ``MATERIALIZE_STEP`` names a
        batch of statements, in transactions of at most ``MATERIALIZE_BATCH`` names and about
        ``MATERIALIZE_SLICE_SECONDS`` each; what has no directory here goes to ``unresolved``."""
        start = 0
        while start < len(items):
            if start:
                await trio.lowlevel.checkpoint()
            end, until = start, time.perf_counter() + MATERIALIZE_SLICE_SECONDS
            made_here: set[int] = set()  # one transaction's: between two, the workload may name into them
            with self.ns.txn():  # one per slice: a commit per directory was most of the time
                while end < len(items) and end - start < MATERIALIZE_BATCH and (
                        end == start or time.perf_counter() < until):
                    step = items[end:min(end + MATERIALIZE_STEP, start + MATERIALIZE_BATCH)]
                    self.unresolved += self.merge_paths(step, made_here)
                    end += len(step)
            if materialized is not None:
                materialized(self._batch_files(items[start:end]))
            start = end

    def _batch_files(self, batch: list[tuple[str, RemoteEntry]]) -> list[Inode]:
        """The regular files of a batch just materialized, as this node holds them (the names are in
        memory: ``Namespace.create_names`` keeps them)."""
        out = []
        dirs: dict[str, int | None] = {}
        for path, entry in batch:
            if entry.type == "f":
                d, _, name = path.rpartition("/")
                ino = dirs[d] if d in dirs else dirs.setdefault(d, self.paths.dir_at(d))
                node = self._file(ino, name.encode(errors="surrogateescape")) if ino is not None else None
                if node is not None:
                    out.append(node)
        return out

    def _file(self, dir_ino: int, name: bytes) -> Inode | None:
        """The regular file with content named *name* in directory *dir_ino*, if this node has one."""
        node = self.ns.lookup_inode(dir_ino, name)
        return node if node is not None and node.is_reg and node.hash is not None else None

    def files(self) -> list[Inode]:
        """The set's files as this node holds them now, in the set's order."""
        out = []
        for d in self.dirs:
            out += self._files_of(d)
        return out

    def _files_of(self, d: str) -> list[Inode]:
        ino = self.paths.dir_at(d)
        if ino is None:
            return []
        return [node for name in self._files[d] if (node := self._file(ino, name)) is not None]

    # -- look-ahead -------------------------------------------------------------
    def reached(self, dir_ino: int, nursery: trio.Nursery | None) -> None:
        """A read (or a lookup about to be one) in directory *dir_ino*: fetch the next directories of the
        order.  The first one loads the set, in the background."""
        if not self.look_ahead or nursery is None:
            return
        if not self.loaded:
            if self._attempt is None:
                nursery.start_soon(self._load_quietly)
            return
        path = self.paths.of_dir(dir_ino)
        at = self._index.get(path) if path is not None else None
        if at is None:
            return
        if all(i in self._ahead for i in range(at + 1, min(at + 1 + LOOK_AHEAD_DIRS, len(self.dirs)))):
            return
        batch = [i for i in range(at + 1, min(at + 1 + LOOK_AHEAD_DIRS + LOOK_AHEAD_BATCH, len(self.dirs)))
                 if i not in self._ahead][:LOOK_AHEAD_BATCH]
        self._ahead.update(batch)
        nursery.start_soon(self._fetch_dirs, [self.dirs[i] for i in batch])

    async def _load_quietly(self) -> None:
        try:
            await self.load()
        except RemoteError as e:
            log.debug("startup set %s not loaded: %s", self.name, e)
        except Exception:  # an optimisation: it never takes the mount down
            log.exception("startup set %s not loaded", self.name)

    async def _fetch_dirs(self, dirs: list[str]) -> None:
        """The small blobs of *dirs* in one batch: ``Prefetcher.fetch_small`` reads the manifests of those
        whose places are not known in one wave of parallel GETs, then the blobs in another."""
        async with self._in_flight:
            if not self.remote.available():
                return
            small = self.remote.small_blob_bytes
            nodes = [n for d in dirs for n in self._files_of(d) if n.size <= small]
            await self.bring(nodes, "remote_look_ahead")
