"""Identical recompiles: a framework wrote, under a new cache entry, bytes the cache already held.

The frameworks only see a key that is not in the cache; the store sees
every file's hash.  When a committed file of at least ``MIN_BYTES`` turns
out to be a blob another file already names, under a different cache
entry, the compile that produced it was wasted: the key changed for a
reason that did not change the output (a path, a flag, a version hashed
into it).  That is counted per top-level directory (``identical_recompiles``,
``identical_recompile_bytes``) and logged as an ``identical_recompile``
event with both paths; ``mithrilfs why`` reads those events back.

A cache entry is the file's directory: Triton's ``triton/<key>/``,
Inductor's per-key directories under its top-level folders.  Frameworks
write a file in a temporary place and rename it into its entry, and the
commit comes at that rename (or at an fsync before it), before the file has
its final name: a commit is therefore judged once the file has a name
outside any ``tmp*`` directory that is not itself temporary (``k.bin.tmp``
beside ``k.bin``: ``is_temporary_name``), right after the rename
(``settle``) or at the next tick, so events name the final path.
Hard links and renames are one inode, so they never match themselves;
files that are identical by nature (under ``MIN_BYTES``, lock files,
anything under ``locks/`` or ``tmp*``) are not counted.

The estimate of the compile time lost is the time from the lookup that
found the new entry missing (the framework's cache miss) to the commit.
"""

from __future__ import annotations

import logging
import posixpath
import sqlite3
import time
from typing import Any

from mithrilfs.cache.staged import Staged
from mithrilfs.observe.events import EventLog
from mithrilfs.observe.stats import Stats
from mithrilfs.observe.tops import TopDirs
from mithrilfs.store.namespace import DirPaths, Namespace

log = logging.getLogger(__name__)

#: Smaller files are identical by nature (empty files, markers, tiny JSON).
MIN_BYTES = 1024
#: Commits waiting for their final name, and missed lookups remembered for the estimate.
_MAX_PENDING = 4096
_MAX_MISSES = 16384
#: A commit still under a temporary name after this long is not judged.
_PENDING_SECONDS = 30.0
#: Other files with the same bytes looked at per commit (a blob a thousand files share costs no more).
_MAX_OTHERS = 16


def is_temporary_name(name: str) -> bool:
    """A name a framework writes under before renaming the file into place beside it: Triton's
    ``k.bin.tmp`` (and ``k.bin.tmp.pid_<pid>_<n>``), Inductor's ``.<pid>.<tid>.tmp``."""
    return name.endswith(".tmp") or ".tmp." in name


def entry_of(path: str) -> str | None:
    """The cache entry a file belongs to (its directory), or None for a file that never counts, or does
    not count yet: under a temporary name, its commit is judged at the rename that gives it its final one."""
    parts = path.split("/")
    name = parts[-1]
    if name.endswith(".lock") or name == "lock" or any(p == "locks" or p.startswith("tmp") for p in parts[:-1]):
        return None
    return None if is_temporary_name(name) else posixpath.dirname(path)


class Recompiles:
    """Finds identical recompiles at commit (a ``CommitListener``; see the module doc)."""

    def __init__(self, ns: Namespace, paths: DirPaths, stats: Stats, events: EventLog, tops: TopDirs) -> None:
        self.ns = ns
        self.paths = paths
        self.stats = stats
        self.events = events
        self.tops = tops
        #: inode -> (blob, size, commit time) of dedup-hit commits not judged yet.
        self._pending: dict[int, tuple[bytes, int, float]] = {}
        #: path -> time of the first lookup that found it missing (a framework's cache miss).
        self._missed: dict[str, float] = {}

    # -- what fs and the write path tell ------------------------------------
    def missed(self, parent: int, name: bytes) -> None:
        """A lookup found *name* missing: if a cache entry appears there, its compile started about now."""
        if len(self._missed) >= _MAX_MISSES:
            self._missed.clear()
        self._missed.setdefault(self.paths.of_name(parent, name), time.time())

    async def committed(self, of: Staged) -> None:
        ino = of.inode
        if not of.deduped or ino.hash is None or ino.size < MIN_BYTES:
            return
        if len(self._pending) >= _MAX_PENDING:
            self._pending.clear()
        self._pending[ino.id] = (ino.hash, ino.size, time.time())
        self.settle(ino.id)

    def settle(self, ino: int) -> None:
        """Judge a pending commit of *ino* if it has its final name (after a rename, or a commit in place).

        Only counting: an index error here is logged, never the answer of the commit or rename that asked.
        """
        if ino not in self._pending:
            return
        try:
            self._settle(ino)
        except sqlite3.Error as e:
            self._pending.pop(ino, None)
            log.warning("identical recompile check of inode %d failed: %s", ino, e)

    def _settle(self, ino: int) -> None:
        pending = self._pending.get(ino)
        if pending is None:
            return
        path = self._path_of(ino)
        if path is None:
            return  # still under a temporary name: the rename that follows settles it
        del self._pending[ino]
        digest, size, committed = pending
        node = self.ns.get(ino)
        if node is None or node.hash != digest:
            return
        entry = entry_of(path)
        if entry is None:
            return
        elsewhere = None
        for other in self.ns.inodes_with_hash(digest, limit=_MAX_OTHERS):
            if other == ino:
                continue
            paths = self._paths_of(other)
            if any(posixpath.dirname(p) == entry for p in paths):
                return  # the same bytes already in this entry: a copy, not a new key
            if paths and elsewhere is None:
                elsewhere = paths[0]
        if elsewhere is not None:
            self._record(ino, path, entry, elsewhere, posixpath.dirname(elsewhere), size, digest, committed)

    def tick(self) -> None:
        """Judge commits whose rename did not come through ``settle`` (an fsync in place); forget stale ones."""
        now = time.time()
        if len(self._missed) > _MAX_MISSES // 2:
            self._missed = {p: t for p, t in self._missed.items() if now - t < _PENDING_SECONDS * 20}
        for ino, (_, _, committed) in list(self._pending.items()):
            if now - committed > _PENDING_SECONDS:
                del self._pending[ino]
            else:
                self.settle(ino)

    def fleet(self, path: str, digest: bytes, size: int, other_path: str | None) -> None:
        """This node uploads *path*, new to the shared tier, whose blob the tier already held: another node
        compiled these bytes (at *other_path*, when the tier knows it) under another name."""
        entry = entry_of(path)
        if size < MIN_BYTES or entry is None:
            return  # tiny or temporary
        here = self.ns.inodes_with_hash(digest, limit=2)
        if len(here) != 1 or len(self.ns.names_of(here[0])) > 1:
            return  # another file here has it (counted here), or a second name of a file already uploaded
        other_entry = entry_of(other_path) if other_path else None
        if other_entry == entry:
            return  # the same entry compiled on two nodes at once: a race, not a changed key
        self.stats.add(self.tops.of_file(here[0]), "fleet_identical_recompiles")
        fields: dict[str, Any] = {"path": path, "entry": entry, "bytes": size, "blob": digest.hex()}
        if other_entry is not None:
            fields.update(other_path=other_path, other_entry=other_entry)
        self.events.emit("fleet_identical_recompile", **fields)

    # -- helpers -------------------------------------------------------------
    def _paths_of(self, ino: int) -> list[str]:
        """The names of *ino* that belong to a cache entry (outside temporary directories, not locks)."""
        out = []
        for parent, name in self.ns.names_of(ino):
            path = self.paths.of_name(parent, name)
            if not path.startswith("?") and entry_of(path) is not None:
                out.append(path)
        return out

    def _path_of(self, ino: int) -> str | None:
        paths = self._paths_of(ino)
        return paths[0] if paths else None

    def _record(self, ino: int, path: str, entry: str, other_path: str, other_entry: str, size: int,
                digest: bytes, committed: float) -> None:
        top = self.tops.of_file(ino)
        self.stats.add(top, "identical_recompiles")
        self.stats.add(top, "identical_recompile_bytes", size)
        fields: dict[str, Any] = {"path": path, "entry": entry, "other_path": other_path,
                                  "other_entry": other_entry, "bytes": size, "blob": digest.hex()}
        missed = self._missed.pop(entry, None)
        if missed is not None and missed <= committed:
            fields["lost_seconds"] = round(committed - missed, 3)
        self.events.emit("identical_recompile", **fields)
