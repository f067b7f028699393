"""The ages that order ``fleet gc`` against writers, and the use records' time, as every store reads them.

``fleet gc`` deletes what has gone unused longest, so age means "unused
for", not "written before": nodes record when they use a directory
(``fleet.usage``), and the stores keep those records (Redis: a ``ZADD GT``
into one sorted set; a bucket: one small object per flush, at most every
``USE_FLUSH_SECONDS``).  The times here also order gc against writers
(docs/design.md, *Fleet gc*):

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

from mithrilfs.shared.stores.clock import FUTURE_SLACK_US


def env_seconds(name: str, default: float, *, positive: bool = False) -> float:
    """Seconds from the environment variable *name* (tests lower some periods), *default* when unset or not
    a number; with *positive*, also when not a finite number above 0."""
    try:
        seconds = float(os.environ.get(name, default))
    except ValueError:
        return default
    return default if positive and not (math.isfinite(seconds) and seconds > 0) else seconds


#: A node records the use of one directory at most this often.
USE_RECORD_SECONDS = env_seconds("MITHRILFS_USE_RECORD_SECONDS", 3600.0)
#: A bucket gets one object of use records at most this often per node.
USE_FLUSH_SECONDS = env_seconds("MITHRILFS_USE_FLUSH_SECONDS", 300.0)
#: A blob older than this in the tier is uploaded again by a writer that needs it (renewing its time).
BLOB_TRUST_SECONDS = env_seconds("MITHRILFS_BLOB_TRUST_SECONDS", 6 * 3600.0)
#: A batch's names are published at most this long after its blobs were checked (else checked again).
UPLOAD_LAG_SECONDS = env_seconds("MITHRILFS_UPLOAD_LAG_SECONDS", 3600.0)
#: A gc sweep's marker older than this is a dead gc's (writers ignore it; a live gc renews it).
GC_RUN_SECONDS = env_seconds("MITHRILFS_GC_RUN_SECONDS", 3600.0)


def younger(age: float, limit: float) -> bool:
    """Whether what the tier's clock dates *age* seconds ago is younger than *limit*; dated further past the
    tier's time than a clock's error (``clock.FUTURE_SLACK_US``: a writer's clock ahead) it is no age at
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
