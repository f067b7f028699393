"""Use records: which of the fleet's cache entries (directories) are still used, written cheaply.

``fleet gc`` deletes what has gone unused longest, so age must mean
"unused for", not "written before".  Every node notes the directory of each
file it reads (``RemoteTier.record_read``: every read at offset 0, local or
remote) and tells the tier about a directory at most once per
``ages.USE_RECORD_SECONDS`` (an hour): one dict lookup per read, and at
most one record per directory per node per hour (the store keeps them:
``RemoteStore.record_use``).

A name it publishes is different: its directory's record is written
before the name (one record write per upload batch), so gc, which lists
the names before the records, never sees a name older than its last use
(a name published meanwhile is never taken for an unused one).  The ages
that order gc against writers, and a record's time as read back, are the
stores' (``stores.ages``).
"""

from __future__ import annotations

import time
from collections.abc import Callable

from mithrilfs.shared.stores.ages import USE_RECORD_SECONDS


def dir_of(path: str) -> str:
    """The directory (cache entry) a file path is in: the unit gc keeps or deletes."""
    return path.rpartition("/")[0]


class UseRecorder:
    """Which directories this node used, and which of them the tier has not been told about this hour."""

    def __init__(self, every: float = USE_RECORD_SECONDS, now: Callable[[], float] = time.time) -> None:
        self.every = every
        #: What a use is dated by: the tier's clock (``clock.TierClock.now``), never this node's.
        self._now = now
        #: Directory -> when the tier was last told (monotonic); pruned as it ages.
        self._told: dict[str, float] = {}
        #: Directory -> when it was used (wall clock), waiting for the next flush.
        self._due: dict[str, float] = {}

    def used(self, dir_path: str) -> None:
        """One read (or publish) in *dir_path*: cheap; the tier hears of it at most once per ``every``."""
        told = self._told.get(dir_path)
        if told is not None and time.monotonic() - told < self.every:
            return
        self._told[dir_path] = time.monotonic()
        self._due[dir_path] = self._now()
        if len(self._told) > 100_000:  # forget what was told long ago: memory stays bounded
            cutoff = time.monotonic() - self.every
            self._told = {d: t for d, t in self._told.items() if t >= cutoff}

    def published(self, dir_path: str) -> None:
        """A name published in *dir_path*: due whatever was told this hour, and sent before the name
        (``FleetState.before_publish``), so no gc can list the name with an older last use than its
        publication (an hour-old record would let a ``--max-age`` under an hour delete it at once)."""
        self._told[dir_path] = time.monotonic()
        self._due[dir_path] = self._now()

    def pending(self) -> int:
        return len(self._due)

    def take(self) -> dict[str, float]:
        """The records to send now (the caller puts them back with ``failed`` if sending fails)."""
        due, self._due = self._due, {}
        return due

    def failed(self, records: dict[str, float]) -> None:
        for d, t in records.items():
            self._due[d] = max(t, self._due.get(d, 0.0))
