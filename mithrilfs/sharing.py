"""Glue between the local namespace and the remote tier: read-through, write-behind.

Read-through: a name missing locally is asked for remotely (bounded by the
tier's timeouts, in a worker thread); if found it appears locally with its
size and mode and a *placeholder* blob row (size 0, no file), and the
content is fetched and verified by blake3 on first open.  ``readdir`` merges
the remote names of a directory in, at most every few seconds.

Write-behind: a local commit or rename queues the inode; a background task
waits a moment (so a tmp file renamed into place is published under its
final name), then uploads batches: blobs Redis lacks, and the name entries
with their parent directories.  Failed batches go back on the queue and are
retried with back-off until Redis answers again.
"""

from __future__ import annotations

import logging
import os
import stat
import time
from typing import Any, Callable

import trio

from .blobs import Blobs
from .cas import EMPTY_DIGEST, hash_bytes
from .namespace import DirPaths, Inode, Namespace
from .remote import RemoteEntry, RemoteError, RemoteTier
from .stats import EventLog

log = logging.getLogger(__name__)

UPLOAD_DELAY = 0.3
UPLOAD_BATCH = 256
DIR_SYNC_SECONDS = 5.0
#: How long the kernel may cache "no such name" when other nodes can create names.
NEGATIVE_TIMEOUT = 2.0


class SharedTier:
    """The local store's view of the remote tier; knows the namespace and blobs, never the filesystem."""

    def __init__(self, ns: Namespace, blobs: Blobs, paths: DirPaths, events: EventLog, remote: RemoteTier) -> None:
        self.ns = ns
        self.blobs = blobs
        self.paths = paths
        self.events = events
        self.remote = remote
        self.limiter = trio.CapacityLimiter(4)
        self.queue: dict[int, None] = {}
        self._wake = trio.Event()
        self._dir_synced: dict[int, float] = {}

    async def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        if not self.remote.available():
            return None
        try:
            return await trio.to_thread.run_sync(fn, *args, limiter=self.limiter)
        except RemoteError:
            return None

    # -- read-through ------------------------------------------------------
    async def lookup(self, parent: int, name: bytes) -> int | None:
        """Materialize *name* from the remote tier if it exists there; its inode or None."""
        dir_path = self.paths.of_dir(parent)
        if dir_path is None:
            return None
        entry = await self._call(self.remote.get_entry, dir_path, name.decode(errors="surrogateescape"))
        if entry is None:
            return None
        existing = self.ns.lookup(parent, name)  # created meanwhile by another request?
        if existing is not None:
            return existing
        return self._materialize(parent, name, entry)

    async def sync_dir(self, d: int) -> None:
        """Merge a directory's remote names into the local namespace (rate-limited)."""
        now = time.monotonic()
        if now - self._dir_synced.get(d, -1e9) < DIR_SYNC_SECONDS:
            return
        self._dir_synced[d] = now
        dir_path = self.paths.of_dir(d)
        if dir_path is None:
            return
        entries = await self._call(self.remote.list_dir, dir_path)
        for name, entry in (entries or {}).items():
            name_b = name.encode(errors="surrogateescape")
            if self.ns.lookup(d, name_b) is None and self.ns.get(d) is not None:
                self._materialize(d, name_b, entry)

    def _materialize(self, parent: int, name: bytes, e: RemoteEntry) -> int | None:
        parent_ino = self.ns.get(parent)
        if parent_ino is None or not parent_ino.is_dir or b"/" in name or name in (b"", b".", b".."):
            return None
        uid, gid = os.getuid(), os.getgid()
        mode = stat.S_IMODE(e.mode)
        with self.ns.txn():
            if e.type == "d":
                node = self.ns.create_inode(stat.S_IFDIR | mode, uid, gid, nlink=2)
                self.ns.add_link(parent_ino, +1)
            elif e.type == "l":
                node = self.ns.create_inode(stat.S_IFLNK | 0o777, uid, gid,
                                            target=(e.target or "").encode(errors="surrogateescape"))
            else:
                node = self.ns.create_inode(stat.S_IFREG | mode, uid, gid)
                digest = bytes.fromhex(e.hash)  # type: ignore[arg-type]
                self.ns.add_placeholder(digest)  # fetched on first open
                self.ns.set_content(node, digest, e.size, e.mtime_ns or time.time_ns())
            self.ns.link(parent, name, node.id)
        return node.id

    async def fetch(self, ino: Inode) -> bool:
        """Bring a remote blob into the local CAS, verified; False when it cannot be had."""
        digest = ino.hash
        assert digest is not None
        data = await self._call(self.remote.fetch_blob, digest.hex(), ino.size)
        if data is None:
            return False
        if hash_bytes(data) != digest:
            self.remote.counters["remote_verify_failures"] += 1
            log.error("remote blob %s does not match its hash: rejected", digest.hex())
            self.events.emit("corruption", blob=digest.hex(), why="remote blob does not match its hash")
            return False
        self.blobs.add_bytes(data, digest)
        return True

    # -- write-behind ------------------------------------------------------
    def queue_upload(self, ino: int) -> None:
        self.queue[ino] = None
        self._wake.set()

    def queue_all(self) -> int:
        """Queue every named file and symlink (``mithrilfs push``)."""
        rows = self.ns.db.execute(
            "SELECT id FROM inodes WHERE nlink > 0 AND ((mode & 61440) = 32768 OR (mode & 61440) = 40960)"
        ).fetchall()
        for (ino,) in rows:
            self.queue[ino] = None
        self._wake.set()
        return len(rows)

    def _items(self, ino: int, dirs_done: set[str]) -> list[tuple[str, RemoteEntry, str | None]]:
        node = self.ns.get(ino)
        if node is None or node.nlink == 0 or node.is_dir:
            return []
        items: list[tuple[str, RemoteEntry, str | None]] = []
        for parent, name in self.ns.names_of(ino):
            dir_path = self.paths.of_dir(parent)
            if dir_path is None:
                continue
            parts = dir_path.split("/") if dir_path else []
            for i in range(len(parts)):
                p = "/".join(parts[: i + 1])
                if p not in dirs_done:
                    dirs_done.add(p)
                    items.append((p, RemoteEntry("d", mode=0o755), None))
            path = f"{dir_path}/{name.decode(errors='surrogateescape')}" if dir_path else name.decode(
                errors="surrogateescape")
            if stat.S_ISLNK(node.mode):
                items.append((path, RemoteEntry("l", mode=0o777, mtime_ns=node.mtime_ns,
                                                target=(node.target or b"").decode(errors="surrogateescape")), None))
            elif node.is_reg:
                digest = node.hash or EMPTY_DIGEST
                blob = str(self.blobs.cas.path(digest)) if node.hash else ""
                items.append((path, RemoteEntry("f", digest.hex(), node.size, stat.S_IMODE(node.mode),
                                                node.mtime_ns), blob))
        return items

    async def uploader(self) -> None:
        backoff = 0.5
        while True:
            if not self.queue:
                await self._wake.wait()
                self._wake = trio.Event()
            await trio.sleep(UPLOAD_DELAY)
            while self.queue:
                batch = list(self.queue)[:UPLOAD_BATCH]
                for ino in batch:
                    del self.queue[ino]
                dirs_done: set[str] = set()
                items = [item for ino in batch for item in self._items(ino, dirs_done)]
                if not items:
                    continue
                try:
                    await trio.to_thread.run_sync(self.remote.upload, items, limiter=self.limiter)
                    backoff = 0.5
                except (RemoteError, OSError) as e:
                    for ino in batch:
                        self.queue[ino] = None
                    log.debug("upload deferred: %s", e)
                    await trio.sleep(backoff)
                    backoff = min(30.0, backoff * 2)
