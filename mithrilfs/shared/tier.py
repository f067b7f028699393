"""The shared tier as the local mount sees it: one small interface, and a null tier.

``fs``, the cache and the control commands talk to "the shared tier" only
through ``Tier``; which tier it is (``remote_tier.RemoteTier`` on Redis,
a bucket, or Redis in front of a bucket) is decided once, in
``daemon.wiring``.  A mount
without ``--remote`` gets ``NullTier``, which finds nothing and queues
nothing, so no caller asks whether there is a tier (CernVM-FS's no-op quota
manager, sccache's one ``Storage`` trait).

What a tier is asked, and when:

- ``in_use`` at every lookup (hit or miss): the mount is used; a lookup
  that ends an idle spell awaits ``fresh`` before it answers;
- ``lookup`` a name the index lacks; ``list_dir`` at OPENDIR (merge the
  directory's remote names); ``forget_listed`` after an eviction (names left
  these directories locally only);
- ``fetch`` a blob the index names but the store lacks (first read);
- ``publish`` a name that now points at new content (a commit, a rename:
  ``committed`` is the write path's hook), ``tombstone`` a name a user
  removes (evictions never do); ``forget_fleet`` names on every node;
- ``record_read`` the first read of a file (startup sets);
- ``push``, ``start_prefetch`` (the control commands), ``snapshot`` (stats),
  ``run`` (background work) and ``unmounting``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any

from mithrilfs.cache.integrity import Fetched
from mithrilfs.cache.writepath import Staged
from mithrilfs.store.namespace import Inode

#: How long the kernel may cache a negative lookup without a tier (a name nobody else can publish).
LOCAL_NEGATIVE_TIMEOUT = 300.0

#: What the commands that need a tier answer without one (``no_tier`` is set too).
WITHOUT_REMOTE = "mounted without --remote"

__all__ = ["Fetched", "NullTier", "Tier"]


class Tier(ABC):
    """The shared tier behind one mount (see the module doc)."""

    #: Seconds the kernel may cache a negative lookup (short with a tier: another node may publish the name).
    negative_timeout: float = LOCAL_NEGATIVE_TIMEOUT
    #: Whether requests may wait on it (lookups, directory reads): the session makes them interruptible.
    slow: bool = False
    #: Whether there is a tier to push to and prefetch from: the control directory offers those commands.
    shared: bool = True

    @property
    def streaming(self) -> bool:
        """Whether a prefetch streams into this process now: the session sleeps for its next request at
        once instead of polling (``kernel.polling``), leaving the cores to the prefetch."""
        return False

    def in_use(self) -> bool:
        """The mount is used now (a lookup); True when this use ends an idle spell: the caller awaits
        ``fresh`` before it answers from what the node knows.  Default: never idle."""
        return False

    async def fresh(self) -> None:
        """Return once the node has asked the tier for news since the idle spell ended (bounded).  Default:
        at once."""
        return None

    @abstractmethod
    async def lookup(self, parent: int, name: bytes) -> int | None:
        """A name missing locally: its inode once the tier's names are merged, or None."""

    @abstractmethod
    async def list_dir(self, d: int) -> None:
        """A directory is opened: merge its remote names into the index (rate-limited)."""

    @abstractmethod
    def forget_listed(self, dirs: set[int]) -> None:
        """Names left these directories locally only: their next lookup asks the tier again."""

    @abstractmethod
    async def fetch(self, ino: Inode, max_bytes: int) -> Fetched:
        """Bring the blob *ino* names into the store, size-checked and verified."""

    @abstractmethod
    def publish(self, ino: Inode) -> None:
        """A name now points at *ino*: queue it (a directory: everything under it)."""

    async def committed(self, of: Staged) -> None:
        """The write path's hook: a file's new content is committed."""
        self.publish(of.inode)

    @abstractmethod
    def tombstone(self, parent: int, name: bytes) -> None:
        """A user removes *name*: if it was published, queue its deletion for every node."""

    @abstractmethod
    async def forget_fleet(self, paths: list[str]) -> dict[str, Any]:
        """``forget --fleet``: remove *paths* (and what is under them) from every node (``shared.purge``)."""

    @abstractmethod
    def record_read(self, ino: int) -> None:
        """The first read of a file in this mount (what the workload needs first)."""

    @abstractmethod
    async def push(self) -> dict[str, Any]:
        """Queue everything for upload (``push``): ``{"queued": N}`` or ``{"error": ...}``."""

    @abstractmethod
    async def start_prefetch(self, set_name: str | None) -> dict[str, Any]:
        """Start fetching a startup set (None: everything) in the background, or join the same one running:
        ``{"started": bool, ...}`` (``busy``: another one runs)."""

    @abstractmethod
    def snapshot(self) -> dict[str, Any]:
        """The tier's counters and state, merged into ``stats``."""

    @abstractmethod
    async def run(self) -> None:
        """Background work for the life of the mount (uploads, prefetch at start)."""

    @abstractmethod
    async def unmounting(self) -> None:
        """The mount is going: send what must not wait for the next one (bounded)."""


class NullTier(Tier):
    """No shared tier: nothing is found, fetched or queued."""

    shared = False

    async def lookup(self, parent: int, name: bytes) -> int | None:
        return None

    async def list_dir(self, d: int) -> None:
        pass

    def forget_listed(self, dirs: set[int]) -> None:
        pass

    async def fetch(self, ino: Inode, max_bytes: int) -> Fetched:
        return Fetched.NO_TIER

    def publish(self, ino: Inode) -> None:
        pass

    def tombstone(self, parent: int, name: bytes) -> None:
        pass

    async def forget_fleet(self, paths: list[str]) -> dict[str, Any]:
        return {"error": WITHOUT_REMOTE, "no_tier": True}

    def record_read(self, ino: int) -> None:
        pass

    async def push(self) -> dict[str, Any]:
        return {"error": WITHOUT_REMOTE, "no_tier": True}

    async def start_prefetch(self, set_name: str | None) -> dict[str, Any]:
        return {"started": False, "error": WITHOUT_REMOTE, "no_tier": True}

    def snapshot(self) -> dict[str, Any]:
        return {}

    async def run(self) -> None:
        pass

    async def unmounting(self) -> None:
        pass
