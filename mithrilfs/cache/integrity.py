"""No byte is served from a blob that does not hash to its name.

The first READ of a blob in a mount verifies it (the page cache of a new
mount is empty, so that first read always reaches the daemon); a small one
is hashed and served from the same single read of its file.  A mismatch
is never served: the blob goes to quarantine, every name pointing at it
goes (the next open is a miss and the framework recompiles), and the read
fails.  A blob the index names but the store lacks is asked of the shared
tier (``BlobSource``); if the tier cannot give it, that name is a miss (not
corruption); with no tier, a lost blob is corruption like a bad one.
"""

from __future__ import annotations

import errno
import logging
import os
from enum import Enum
from typing import Protocol

import trio

from mithrilfs.cache.budget import Budget
from mithrilfs.cache.lifetime import Lifetimes
from mithrilfs.cache.readahead import ReadAhead
from mithrilfs.cache.staging import OFFLOAD_MIN
from mithrilfs.kernel import FUSEError
from mithrilfs.observe.events import EventLog
from mithrilfs.observe.stats import ROOT_KEY, Stats
from mithrilfs.observe.tops import TopDirs
from mithrilfs.store.namespace import Inode
from mithrilfs.store.open import Store

log = logging.getLogger(__name__)


class Fetched(Enum):
    """What became of a blob the store lacked."""

    #: Brought in, verified: serve it.
    YES = "yes"
    #: The tier was asked and cannot give it (lost, down, a wrong size): a miss for this name, not corruption.
    NO = "no"
    #: There is no tier to ask: the store lost a blob it held (corruption).
    NO_TIER = "no tier"


class BlobSource(Protocol):
    """Where a blob the store lacks may come from (the shared tier)."""

    async def fetch(self, ino: Inode, max_bytes: int) -> Fetched: ...


class Integrity:
    def __init__(self, store: Store, lifetimes: Lifetimes, budget: Budget, source: BlobSource, stats: Stats,
                 events: EventLog, tops: TopDirs, limiter: trio.CapacityLimiter, read_ahead: ReadAhead) -> None:
        self.store = store
        self.ns = store.ns
        self.blobs = store.blobs
        self.cas = store.cas
        self.lifetimes = lifetimes
        self.budget = budget
        self.source = source
        self.stats = stats
        self.events = events
        self.tops = tops
        self._limiter = limiter
        self.read_ahead = read_ahead

    async def verify(self, ino: Inode) -> bool:
        """The blob *ino* names may be served (verified in this mount, or fetched now); False: it must not."""
        digest = ino.hash
        if digest is None:
            return True
        if digest in self.blobs.verified:  # verified meanwhile (a read-ahead brought it while this read came)
            return self._fits(ino)
        if ino.size >= OFFLOAD_MIN:
            ok = await trio.to_thread.run_sync(self.blobs.verify, digest, limiter=self._limiter)
        else:
            ok = self.blobs.verify(digest)
        if ok:
            return self._fits(ino)
        if ok is None:
            fetched = await self.source.fetch(ino, self.budget.policy.max_bytes)
            if fetched is Fetched.YES:
                await self.budget.enforce()
                return self._fits(ino)
            if fetched is Fetched.NO:
                # the shared tier lost it, is down, or this entry's size is wrong: a miss for this
                # name (others with the same hash may name the right size), not corruption
                self.lifetimes.forget_content(digest, [ino])
                return False
        self.quarantine(digest, "missing" if ok is None else "content does not match its hash")
        return False

    def _fits(self, ino: Inode) -> bool:
        """The content is *ino*'s size: else its name lies about it (an entry from the tier naming this
        content with another size, met before the content came: ``RemoteFetch.arrived`` removes those at
        its arrival, and a read already past its lookup came here; seen under load, a 100-byte name
        served the 18 bytes of its content) and goes, never served cut or padded."""
        assert ino.hash is not None
        try:
            size = self.cas.path(ino.hash).stat().st_size
        except FileNotFoundError:
            return True  # gone meanwhile (evicted): the read, going round again, finds it missing
        if size == ino.size:
            return True
        log.warning("a name claims %d bytes for blob %s of %d: removed", ino.size, ino.hash.hex(), size)
        self.lifetimes.forget_content(ino.hash, [ino])
        return False

    def read_small(self, ino: Inode, off: int, size: int) -> memoryview | None:
        """The first read of a small blob: hashed and served from one read of its file (``Blobs.read_verifying``).

        None for a large blob (hashed in a worker thread by ``verify``) and
        for one that is missing or wrong (``verify`` decides what that means).
        """
        if ino.hash is None or ino.size >= OFFLOAD_MIN:
            return None
        return self.blobs.read_verifying(ino.hash, off, size, ino.size)

    def quarantine(self, digest: bytes, why: str) -> None:
        """Move a bad blob aside and remove every name that pointed at it."""
        if digest in self.blobs.verified:
            return
        inodes = [i for i in map(self.ns.get, self.ns.inodes_with_hash(digest)) if i is not None]
        top = self.tops.of_file(inodes[0].id, remember=False) if inodes else ROOT_KEY
        self.stats.add(top, "corrupt_blobs")
        self.events.emit("corruption", blob=digest.hex(), why=why, names=sum(i.nlink for i in inodes))
        if self.store.read_only:
            log.error("blob %s is corrupt (%s); read-only store: refusing to serve it", digest.hex(), why)
            return
        log.error("blob %s is corrupt (%s): quarantined, its names removed", digest.hex(), why)
        self.blobs.quarantine(digest)
        self.lifetimes.forget_content(digest, inodes)

    def read(self, inode: int, digest: bytes, off: int, size: int) -> bytes | memoryview:
        """Bytes of a verified blob: read ahead after its lookup (``ReadAhead``), or from its file.

        Only the first read of a page reaches the daemon (the kernel keeps
        the pages), so an fd per read costs little, and no cached fd keeps
        an evicted blob's disk space.
        """
        ready = self.read_ahead.take(digest, off, size)
        if ready is not None:
            return ready
        try:
            fd = self.cas.open(digest)
        except FileNotFoundError:
            log.error("blob %s of inode %d is missing", digest.hex(), inode)
            raise FUSEError(errno.EIO) from None  # logged here: the answer, not another error event
        try:
            return os.pread(fd, size, off)
        finally:
            os.close(fd)
