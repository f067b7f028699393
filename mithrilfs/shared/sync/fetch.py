"""The tier's fetch path: a file's remote content brought into the local CAS, verified, with its neighbours.

The tier's ``fetcher``: the first read of a file whose content is remote
waits for it (or for the read-ahead already bringing it), streams it
size-checked into a staging file and adds it to the store only if its
blake3 matches; the small files of the same directory come along in the
background (read-ahead), and the read tells the startup set's look-ahead
which directory it reached (*reached*); a blob's arrival removes names that
claim another size for it (*arrived*: ``Reconciler.arrived``).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable

import trio

from mithrilfs.cache.integrity import Fetched
from mithrilfs.observe.events import EventLog
from mithrilfs.shared.stores.base import RemoteStore
from mithrilfs.shared.stores.entries import RemoteError
from mithrilfs.shared.sync.bounded import request, within_bound
from mithrilfs.shared.sync.in_flight import InFlight
from mithrilfs.shared.sync.local_disk import LocalWriteError, StoreFile
from mithrilfs.shared.sync.tasks import Background
from mithrilfs.store.blobs import Blobs
from mithrilfs.store.namespace import DirPaths, Inode, Namespace

log = logging.getLogger("mithrilfs.shared.remote_tier")  # the name operators know from the logs

#: A first read from a directory fetches up to this many of its other files, each at most this large.
READ_AHEAD_FILES = 64
READ_AHEAD_BYTES = 1 << 20


class RemoteFetch:
    """The tier's fetches of remote content (see the module doc)."""

    def __init__(self, *, ns: Namespace, paths: DirPaths, blobs: Blobs, remote: RemoteStore, counters: dict[str, int],
                 events: EventLog, limiter: trio.CapacityLimiter, in_flight: InFlight, background: Background,
                 reached: Callable[[int, trio.Nursery | None], None],
                 arrived: Callable[[list[tuple[bytes, int]]], None]) -> None:
        self.ns = ns
        self.paths = paths
        self.blobs = blobs
        self.remote = remote
        self.counters = counters
        self.events = events
        #: The tier's worker threads, for a read's requests (``bounded.request``).
        self.limiter = limiter
        self.in_flight = in_flight
        #: Where a read-ahead runs once the read that began it is answered.
        self.background = background
        #: Told the directory a read reached (``StartupOrder.reached``: the look-ahead).
        self.reached = reached
        #: Told the contents (digest, size) now in the store.
        self.arrived = arrived
        #: Directories read ahead in this mount.
        self.read_ahead_dirs: set[int] = set()

    async def fetch(self, ino: Inode, max_bytes: int) -> Fetched:
        """The first read of a file whose content is remote: its small siblings come along (read-ahead)."""
        digest = ino.hash
        assert digest is not None
        if digest not in self.in_flight.fetching:  # the prefetch will bring it: its batch now, not one blob
            self.in_flight.hurry([ino])
        coming = self.in_flight.fetching.get(digest)
        if coming is not None and coming[1] == ino.size:  # on its way (a batch, a read-ahead): wait, not ask twice
            self.counters["remote_fetch_joined"] = self.counters.get("remote_fetch_joined", 0) + 1
            try:
                await within_bound(self.remote, coming[0].wait)
            except RemoteError:
                return Fetched.NO  # the tier stalled: the read fails within the one bound (counted)
            if self.blobs.cas.exists(digest):
                return Fetched.YES
        # a read-ahead (waited for, or done before this read came) found no good copy of this size: asking again
        # now is the same; the next read asks (unless the place it tried was stale: below)
        if (digest, ino.size) in self.in_flight.missed:
            self.in_flight.missed.discard((digest, ino.size))
            if self.remote.placement.knows_where(digest.hex()):
                return Fetched.NO
        self.counters["remote_read_fetches"] = self.counters.get("remote_read_fetches", 0) + 1  # its own request
        if not self.remote.placement.knows_where(digest.hex()):  # named in an earlier mount: its entry says where
            await self._relearn(ino)
        self.read_ahead(ino)
        for parent, _name in self.ns.names_of(ino.id)[:1]:
            self.reached(parent, self.background.nursery)
        if await self.fetch_blob(ino, max_bytes):
            return Fetched.YES
        if not self.remote.placement.knows_where(digest.hex()):  # its pack is gone (gc collected it after the blob
            await self._relearn(ino)                        # was packed again): its directory says where now
            if self.remote.placement.knows_where(digest.hex()) and await self.fetch_blob(ino, max_bytes):
                return Fetched.YES
        return Fetched.NO

    async def _relearn(self, ino: Inode) -> None:
        """Read the directory of a file again so the store learns where its blob (and its neighbours')
        are: a bucket's packs are found from the names (``stores.s3.packs``), and this mount never read them."""
        names = self.ns.names_of(ino.id)
        dir_path = self.paths.of_dir(names[0][0]) if names else None
        if dir_path is not None:
            await request(self.remote, self.limiter, self.remote.list_dir, dir_path)

    def read_ahead(self, ino: Inode, *, itself: bool = False) -> None:
        """Fetch, in the background, the small files of the directory a file is found or first read in.

        A framework loads a cache entry's files together (Triton: a kernel's
        binary, its metadata, its group file...), one after another: asked
        one by one, each costs the tier's round trip in turn; read ahead,
        they come in one batch (pipelined GETs from Redis, concurrent GETs
        from a bucket), started when the first of them is looked up (with
        it: *itself*) or read.  Once per directory per mount (again after an
        eviction emptied it), within the budget's low watermark and the room
        left on the store's disk after the read's own file, files up to
        ``READ_AHEAD_BYTES``.
        """
        names = self.ns.names_of(ino.id)
        nursery = self.background.nursery
        if not names or nursery is None or names[0][0] in self.read_ahead_dirs:
            return
        parent = names[0][0]
        self.read_ahead_dirs.add(parent)
        todo: list[Inode] = []
        seen = set() if itself else {ino.hash}
        for _name, child in self.ns.children(parent):
            node = self.ns.get(child)
            if (node is None or not node.is_reg or node.hash is None or node.hash in seen
                    or node.size > min(READ_AHEAD_BYTES, self.remote.small_blob_bytes) or node.hash in self.in_flight.fetching
                    or self.blobs.cas.exists(node.hash)):
                continue
            seen.add(node.hash)
            todo.append(node)
            if len(todo) >= READ_AHEAD_FILES:
                break
        todo = self.in_flight.hurry(todo)  # what the prefetch has queued comes with its batches, now
        own = 0 if any(n.hash == ino.hash for n in todo) else ino.size  # the file looked up or read: next
        if todo and self.in_flight.room_for(todo, own):
            todo, events, _ = self.in_flight.claim(todo)  # now: a read right after this lookup waits for it
            nursery.start_soon(self.in_flight.bring_claimed, todo, events, "remote_read_ahead")

    async def fetch_blob(self, ino: Inode, max_bytes: int) -> bool:
        """Bring a remote blob into the local CAS, size-checked and verified; False when it cannot be had.

        A blob larger than *max_bytes* (the budget) could never stay: a miss.
        While it comes, it is on its way (``in_flight``): a read or a prefetch of
        the same content waits for it instead of asking again.
        """
        digest = ino.hash
        assert digest is not None
        if ino.size > max_bytes:
            return False
        mine = self.in_flight.register(digest, ino.size)
        try:
            return await self._fetch_blob(ino, digest)
        finally:
            self.in_flight.release(mine)

    async def _fetch_blob(self, ino: Inode, digest: bytes) -> bool:
        fd, staging = self.blobs.cas.new_staging()
        owner = threading.Lock()
        taken: list[str] = []  # who closes fd: the thread that writes it, or (it never ran) this task

        def fetch_into() -> bytes | None:
            """In the thread, which owns the file: abandoned past the bound, it writes on to an unlinked file."""
            with owner:
                if taken:
                    return None
                taken.append("thread")
            with StoreFile(fd) as out:  # the store's disk filling up is no failure of the tier
                return self.remote.fetch_blob(digest.hex(), ino.size, out)

        try:
            got = await request(self.remote, self.limiter, fetch_into)
            if got is None:
                return False
            if got != digest:
                self.counters["remote_verify_failures"] += 1
                log.error("remote blob %s does not match its hash or size: rejected", digest.hex())
                self.events.emit("corruption", blob=digest.hex(), why="remote blob does not match its hash or size")
                return False
            try:
                self.blobs.add(staging, digest, ino.size, trusted=True)
            except OSError:
                self.blobs.never_came([digest])
                raise
            self.arrived([(digest, ino.size)])
            return True
        except LocalWriteError as e:
            raise e.error from None  # an OSError again: the request's full-disk handling takes it
        finally:
            with owner:
                if not taken:
                    taken.append("task")
                    os.close(fd)
            os.unlink(staging)
