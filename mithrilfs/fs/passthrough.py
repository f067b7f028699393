"""Which opens the kernel serves from the blob itself (FUSE passthrough), and the backing ids it holds.

With passthrough on (``mount --passthrough on``; off by default: answered,
every open of any file costs a round trip and every close a RELEASE),
OPEN is answered (it is ENOSYS otherwise: the kernel then opens files
itself).  A read-only open of a committed regular
file of at least ``min_size`` bytes, not staged, not being written, gets
its blob as backing file: the kernel reads and maps the blob directly and
no READ reaches the daemon.  Every other open is served through the page
cache as before (``keep_cache``).  The blob is verified
(``Integrity.verify``) before its fd is handed over; a bad blob is never
handed (EIO).

The kernel keeps one backing file per inode while any passthrough open of
it lives, and refuses (EIO to the opener) an inode open in both modes at
once.  So the choice is per inode and stable: one backing id per inode,
registered at its first passthrough open and dropped at its last RELEASE;
an inode held open through the page cache (a writer) is not handed over;
a write open, or a truncate, of an inode a passthrough open holds is
answered ETXTBSY, as for a running executable (the blob is
content-addressed and shared: nothing is ever written to it, and the
kernel would go on reading it under content that changed).

The backing ids and the opens live in the kernel's connection, which
outlives a daemon (a successor takes the live mount over): so each
inode's id, passthrough opens and page-cache opens are shared memory in
the store (``held_table``), which a successor maps again.  A successor
that did not know them would hand a second backing file for an inode
still open on the first, or a backing file for an inode a writer holds
through the page cache, both of which the kernel refuses (EIO).

Where the kernel does not allow it (no CAP_SYS_ADMIN, INIT without
``PASSTHROUGH``, an ioctl refused) every open is served as without it,
and ``why_off`` says why in one line.
"""

from __future__ import annotations

import errno
import logging
import os
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from mithrilfs.cache.integrity import Integrity
from mithrilfs.cache.lifetime import Lifetimes
from mithrilfs.cache.lookups import LookupCounts
from mithrilfs.cache.writepath import WritePath
from mithrilfs.kernel import BackingFiles, FileInfo, FUSEError
from mithrilfs.shared.tier import Tier
from mithrilfs.store.namespace import Inode
from mithrilfs.units import format_size

log = logging.getLogger(__name__)

#: The passthrough modes a mount can ask for (``mount --passthrough``).
MODES = ("off", "on")
#: Files smaller than this are served through the page cache (their first READ verifies them in one read).
MIN_SIZE = 1 << 20
#: File handles: which mode an open got (RELEASE carries it back).
CACHED_FH = 0
PASSTHROUGH_FH = 1
#: ``CapEff`` bit of CAP_SYS_ADMIN, which FUSE_DEV_IOC_BACKING_OPEN needs.
_CAP_SYS_ADMIN = 21


#: Where a mount keeps its tables (in the store: a successor maps them again): backing ids and
#: passthrough opens, and opens served through the page cache.
HELD_FILE = "passthrough-held"
CACHED_FILE = "passthrough-cached"


@dataclass
class HeldTables:
    """What the kernel holds of a connection's opens, in tables a successor maps again.

    ``handed``: each inode's backing id and passthrough opens (two 32-bit slots an inode: ``2*ino``,
    ``2*ino+1``); ``cached``: each inode's opens served through the page cache (one slot an inode).
    The kernel refuses an inode open both ways at once, whichever daemon answered which open.
    """

    handed: LookupCounts = field(default_factory=LookupCounts)
    cached: LookupCounts = field(default_factory=LookupCounts)


def held_table(root: Path, *, fresh: bool, read_only: bool = False) -> HeldTables:
    """The connection's shared tables (``HeldTables``), kept in files of the store *root*.

    *fresh*: a new connection (a mount, not a takeover): what an earlier one held means nothing and goes.
    A read-only store keeps them in memory (a successor then starts empty).
    """
    if read_only:
        return HeldTables()
    tables = []
    for name in (HELD_FILE, CACHED_FILE):
        fd = os.open(root / name, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        if fresh:
            os.ftruncate(fd, 0)
        tables.append(LookupCounts(fd))
    return HeldTables(*tables)


def has_sys_admin() -> bool:
    """Whether this process holds CAP_SYS_ADMIN (in its effective set)."""
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> _CAP_SYS_ADMIN & 1)
    except (OSError, ValueError):
        pass
    return False


class Passthrough:
    """The passthrough choice of one mount (see the module doc)."""

    def __init__(self, mode: str, backing: BackingFiles | None, integrity: Integrity, writes: WritePath,
                 lifetimes: Lifetimes, tier: Tier, held: HeldTables | None = None, *,
                 min_size: int = MIN_SIZE) -> None:
        self.mode = mode
        self.min_size = min_size
        self.backing = backing
        self.integrity = integrity
        self.writes = writes
        self.lifetimes = lifetimes
        self.tier = tier
        self.capable = mode != "off" and backing is not None and has_sys_admin()
        #: Whether INIT agreed ``PASSTHROUGH`` (the session's answer; the daemon sets it once it has one).
        self.agreed: Callable[[], bool] = lambda: False
        tables = held if held is not None else HeldTables()
        #: inode -> backing id (slot 2*ino) and passthrough opens (slot 2*ino+1); an id is held while opens > 0
        self._held = tables.handed
        #: inode -> opens served through the page cache
        self._cached = tables.cached
        #: Opens handed to the kernel's passthrough so far.
        self.handed = 0

    @property
    def asks(self) -> bool:
        """Whether INIT is to ask for ``PASSTHROUGH``."""
        return self.capable

    def why_off(self) -> str | None:
        """None when passthrough serves; else why not, in a few words."""
        if self.mode == "off":
            return "off (the default; --passthrough on serves large files from the disk, a round trip an open)"
        if not self.capable:
            return "off: the daemon lacks CAP_SYS_ADMIN (a user's mount)"
        if not self.agreed():
            return "off: the kernel did not agree to FUSE passthrough at INIT"
        if self.backing is not None and self.backing.refused is not None:
            return f"off: {self.backing.refused}"
        return None

    def describe(self) -> str:
        """One line for ``status``."""
        off = self.why_off()
        if off is not None:
            return f"passthrough {off}"
        return f"passthrough on: read-only opens of committed files of {format_size(self.min_size)} or more"

    def answers_open(self) -> bool:
        """Whether OPEN is answered (else ENOSYS: the kernel opens every file itself); fixed from INIT on."""
        return self.capable and self.agreed()

    def opened_cached(self, ino: int) -> FileInfo:
        """An open served through the page cache, as without passthrough."""
        self._cached.set(ino, self._cached.get(ino) + 1)
        return FileInfo(fh=CACHED_FH, keep_cache=True)

    async def open(self, inode: Inode, flags: int) -> FileInfo:
        """The answer to an OPEN of *inode* (see the module doc); ENOSYS when OPEN is not answered."""
        if not self.answers_open():
            raise FUSEError(errno.ENOSYS)
        ino = inode.id
        if flags & os.O_ACCMODE != os.O_RDONLY or flags & os.O_TRUNC:
            if self.holds(ino):
                raise FUSEError(errno.ETXTBSY)  # never a write into the shared blob the kernel reads
            return self.opened_cached(ino)
        if self.holds(ino):
            return self._one_more(ino)
        if not self._eligible(inode):
            return self.opened_cached(ino)
        digest = inode.hash
        assert digest is not None
        if digest not in self.integrity.blobs.verified and not await self.integrity.verify(inode):
            raise FUSEError(errno.EIO)  # never handed: quarantined, or a miss from now on
        # the verify may have let other requests in: the inode may be held, written or changed meanwhile
        if self.holds(ino):
            return self._one_more(ino)
        now = self.integrity.ns.get(ino)
        if now is None or now.hash != digest or not self._eligible(now):
            return self.opened_cached(ino)
        backing_id = self._register(digest)
        if backing_id is None:
            return self.opened_cached(ino)
        self._held.set(2 * ino, backing_id)
        self._held.set(2 * ino + 1, 1)
        self.handed += 1
        self.tier.record_read(ino)  # no READ will come: the startup set learns of it here
        return FileInfo(fh=PASSTHROUGH_FH, backing_id=backing_id)

    def holds(self, ino: int) -> bool:
        """Whether a passthrough open of *ino* lives (its content must not change under it)."""
        return bool(self._held.get(2 * ino))

    def _one_more(self, ino: int) -> FileInfo:
        """One more passthrough open of *ino*, on the backing id it holds (the kernel allows one an inode)."""
        self._held.set(2 * ino + 1, self._held.get(2 * ino + 1) + 1)
        return FileInfo(fh=PASSTHROUGH_FH, backing_id=self._held.get(2 * ino))

    def _eligible(self, inode: Inode) -> bool:
        ino = inode.id
        return (inode.is_reg and inode.hash is not None and inode.size >= self.min_size
                and ino not in self.writes.staged and ino not in self.lifetimes.unreadable
                and not self._cached.get(ino) and self.backing is not None and self.backing.refused is None)

    def _register(self, digest: bytes) -> int | None:
        """A backing id for the blob *digest*; None when it is gone (evicted) or the kernel refuses."""
        assert self.backing is not None
        try:
            fd = self.integrity.cas.open(digest)
        except FileNotFoundError:
            return None
        try:
            return self.backing.open(fd)
        finally:
            os.close(fd)

    def release(self, ino: int, fh: int) -> None:
        """A RELEASE: the last passthrough open of an inode drops its backing id."""
        if fh == PASSTHROUGH_FH:
            backing_id = self._held.get(2 * ino)
            if not backing_id:
                return
            opens = self._held.get(2 * ino + 1) - 1
            self._held.set(2 * ino + 1, max(0, opens))
            if opens <= 0:
                self._held.set(2 * ino, 0)
                if self.backing is not None:
                    self.backing.close(backing_id)
            return
        self._cached.set(ino, max(0, self._cached.get(ino) - 1))
