"""Use records: which of the fleet's cache entries (directories) are still used, written cheaply.

``fleet gc`` deletes what has gone unused longest, so age must mean
"unused for", not "written before".  Every node notes the directory of each
file it reads (``RemoteTier.record_read``: every read at offset 0, local or
remote) and tells the tier about a directory at most once per
``USE_RECORD_SECONDS`` (an hour): one dict lookup per read,
and at most one record per directory per node per hour (Redis: a ``ZADD
GT`` into one sorted set, pipelined with the uploader's batch; a bucket:
one small object per flush, at most every ``USE_FLUSH_SECONDS``).

A name it publishes is different: its directory's record is written
before the name (one record write per upload batch), so gc, which lists
the names before the records, never sees a name older than its last use
(a name published meanwhile is never taken for an unused one).

The times here also order gc against writers (docs/design.md, *Fleet gc*):

- a blob the tier holds is trusted by a writer (not uploaded again) only
  when it was written less than ``BLOB_TRUST_SECONDS`` ago; an older one is
  written again, which renews its time;
- a writer publishes the names of a batch at most ``UPLOAD_LAG_SECONDS``
  after it checked which blobs the tier holds (else it checks again);
- gc deletes only blobs unreferenced in its listing of the names and last
  written before that listing less its grace, which must be at least the
  sum of both (``min_grace``): a blob a writer relied on is never deleted
  before the name that references it is published and seen by the next gc;
- a bucket's gc marks its sweep (a marker per run, ``gc-sweeps/T-R``,
  renewed every half of ``GC_RUN_SECONDS``, ignored by writers once older),
  so a writer that uploaded again a blob gc listed as old publishes its
  names only after.

Each can be lowered through the environment for tests (``MITHRILFS_*``).
"""

from __future__ import annotations

import math
import os
import time
from collections.abc import Callable

from mithrilfs.shared.stores.clock import FUTURE_SLACK_US


def _env_seconds(name: str, default: float) -> float:
    try:
        return float(os.environ.get(name, default))
    except ValueError:
        return default


#: A node records the use of one directory at most this often.
USE_RECORD_SECONDS = _env_seconds("MITHRILFS_USE_RECORD_SECONDS", 3600.0)
#: A bucket gets one object of use records at most this often per node.
USE_FLUSH_SECONDS = _env_seconds("MITHRILFS_USE_FLUSH_SECONDS", 300.0)
#: A blob older than this in the tier is uploaded again by a writer that needs it (renewing its time).
BLOB_TRUST_SECONDS = _env_seconds("MITHRILFS_BLOB_TRUST_SECONDS", 6 * 3600.0)
#: A batch's names are published at most this long after its blobs were checked (else checked again).
UPLOAD_LAG_SECONDS = _env_seconds("MITHRILFS_UPLOAD_LAG_SECONDS", 3600.0)
#: A gc sweep's marker older than this is a dead gc's (writers ignore it; a live gc renews it).
GC_RUN_SECONDS = _env_seconds("MITHRILFS_GC_RUN_SECONDS", 3600.0)


def younger(age: float, limit: float) -> bool:
    """Whether what the tier's clock dates *age* seconds ago is younger than *limit*; dated further past the
    tier's time than a clock's error (``tier_clock.FUTURE_SLACK_US``: a writer's clock ahead) it is no age at
    all, never trusted: gc judges by the tier's time, and would delete it while a writer trusted it."""
    return -FUTURE_SLACK_US / 1e6 <= age < limit


def min_grace() -> float:
    """The shortest grace that keeps every upload safe (see the module doc)."""
    return BLOB_TRUST_SECONDS + UPLOAD_LAG_SECONDS


def use_time(value: object) -> float | None:
    """A use record's time as read from the tier, or None when it is none: a number (no bool), finite (JSON
    readers take ``NaN`` and ``Infinity``, which merged by ``max`` would keep a directory from ever aging)
    and not negative."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        t = float(value)
    except OverflowError:  # an integer past any float
        return None
    return t if math.isfinite(t) and t >= 0 else None


def dir_of(path: str) -> str:
    """The directory (cache entry) a file path is in: the unit gc keeps or deletes."""
    return path.rpartition("/")[0]


class UseRecorder:
    """Which directories this node used, and which of them the tier has not been told about this hour."""

    def __init__(self, every: float = USE_RECORD_SECONDS, now: Callable[[], float] = time.time) -> None:
        self.every = every
        #: What a use is dated by: the tier's clock (``tier_clock.TierClock.now``), never this node's.
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
