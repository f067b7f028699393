"""A small file's blob, read and verified right after its LOOKUP is answered, kept for the READ that follows.

The first load after a mount sends, for every file, a LOOKUP, then (from
Python's ``open()``) an IOCTL, then a READ; a READ of a blob not yet
verified in this mount would open, read and hash the blob while the client
waits.  The LOOKUP says that READ is coming: once the LOOKUP's reply is
written (``kernel.AfterReply``), the daemon has the time the client spends
waking up and asking its IOCTL, and spends it reading and hashing the blob.
The READ then only slices bytes already verified (docs/benchmarks.md, "G,
warm start at the protocol floor": the daemon's time per READ halves).

Safe by construction: what is kept hashed to its name when it was read
(``Blobs.read_verifying``), is keyed by that name (content-addressed:
it cannot go stale), and is served only where the READ would have served
that blob anyway (``fs.Operations.read`` checks uncommitted writes and
unreadable inodes first, and the inode's current blob).  A blob missing or
wrong is not kept: its READ finds that and quarantines it as before.
Only files the kernel does not hold yet are read ahead (one it holds has
its pages, or will say so with its own READ), only what the page cache
holds (a blob on disk is asked for in the background and left to its READ:
a head start never holds the event loop on the disk), and at most
``MAX_BYTES`` wait at once, the oldest dropped first.  A blob already
verified in this mount (a prefetch verifies each as it arrives) is read
ahead too, without hashing, as its READ would read it: its open, read and
close (each a system call that drops the interpreter's lock) otherwise wait
on the READ's path, where a background prefetch's threads want that lock
too (docs/benchmarks.md, "H9").
"""

from __future__ import annotations

import logging

from mithrilfs.cache.staging import OFFLOAD_MIN
from mithrilfs.observe.stats import Stats
from mithrilfs.store.blobs import Blobs
from mithrilfs.store.namespace import Inode

log = logging.getLogger(__name__)

#: Bytes read ahead and not yet served, at most: a few hundred Triton kernel files.
MAX_BYTES = 8 << 20
#: Blobs read ahead and not (wholly) served, at most; past it the lookups are not followed by reads
#: (``stat``, ``exists``, a listing by name): what waits is dropped and the next ``PAUSE`` lookups are
#: not read ahead.  A client reading what it looks up keeps one or two waiting (one per thread).
UNREAD_MAX = 32
PAUSE = 256


class ReadAhead:
    def __init__(self, blobs: Blobs, stats: Stats, max_bytes: int = MAX_BYTES) -> None:
        self.blobs = blobs
        self.stats = stats
        self.max_bytes = max_bytes
        #: Verified content by blob, oldest first, with the top-level directory to count its use in.
        self._ready: dict[bytes, tuple[memoryview, str]] = {}
        self._bytes = 0
        #: Lookups left not to read ahead (after too many blobs read ahead went unread).
        self._paused = 0

    def after_lookup(self, ino: Inode, top: str) -> None:
        """Read and verify the blob of *ino*, just looked up, unless there is no use in it (a job for after the reply)."""
        digest = ino.hash
        if self._paused:
            self._paused -= 1
            return
        if digest is None or not 0 < ino.size < OFFLOAD_MIN or digest in self._ready or ino.nlink == 0:
            # large blobs are read at their READ (hashed in a worker thread), and a file unlinked meanwhile
            # (``rm`` looks a name up and then removes it) will not be read
            return
        try:
            data = self.blobs.read_ahead(digest, ino.size)
        except OSError as e:  # the READ will meet it, and say so
            log.debug("no read-ahead of blob %s: %s", digest.hex(), e)
            return
        if data is None:
            return  # not in memory (now on its way), missing or wrong: the READ reads, or quarantines
        self._ready[digest] = (data, top)
        self._bytes += len(data)
        self.stats.add(top, "read_ahead")
        while self._bytes > self.max_bytes:
            self._drop(next(iter(self._ready)))
        if len(self._ready) > UNREAD_MAX:  # nobody reads what it looks up: stop paying for it for a while
            self._ready.clear()
            self._bytes = 0
            self._paused = PAUSE

    def take(self, digest: bytes, off: int, size: int) -> memoryview | None:
        """Bytes *off*..*off+size* of a blob read ahead, or None; a blob whose end is read is let go."""
        kept = self._ready.get(digest)
        if kept is None:
            return None
        data, top = kept
        self.stats.add(top, "read_ahead_served")
        if off + size >= len(data):
            self._drop(digest)
        return data[off:off + size]

    def _drop(self, digest: bytes) -> None:
        data, _ = self._ready.pop(digest)
        self._bytes -= len(data)
