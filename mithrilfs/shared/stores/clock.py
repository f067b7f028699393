"""The shared tier's time as one node sees it: what orders and ages everything the fleet shares.

No node's clock decides for the fleet.  A node's versions (the microsecond
a name got its content, ``entries``), tombstones, use records, blob and pack
times are all dated on the *tier's* clock: this node's clock plus an offset
measured against the tier's own time (Redis ``TIME``; a bucket's
``Last-Modified`` of an object it just wrote), so a node whose clock runs a
day ahead or a month behind dates its writes as every other node does.

Measured when first needed and again at most every ``RESAMPLE_SECONDS``
while the tier is used (an idle node asks nothing); the offset moves only
when a measurement differs from it by more than ``STEP_US`` (well above
the measurement's own error: ``Last-Modified`` has whole seconds),
so a version computed from a local ctime (``version_of``) is the same every
time it is computed, and a name materialized with the tier's version
(``local_ns``) gives that version back exactly.

What another node (or an older release, or an attacker) dated past the
tier's time by more than ``FUTURE_SLACK_US`` is no version at all
(``horizon_us``): entries dated so are refused when read and never keep a
newer write out, so nothing pins a path until real time passes it.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

log = logging.getLogger(__name__)

#: A measurement's error: whole seconds of ``Last-Modified``, plus a round trip.
STEP_US = 2_000_000
#: Dated further ahead of the tier's time than this, an entry or record is refused (a skewed or hostile
#: writer); well above what two measurements of honest clocks disagree by.
FUTURE_SLACK_US = 60_000_000
#: The offset is measured again this often while the tier is used.
RESAMPLE_SECONDS = 600.0


class TierClock:
    """The tier's time here: the local clock plus an offset measured by *server_time* (unix seconds, the
    tier's; a blocking request, asked from worker threads only)."""

    def __init__(self, server_time: Callable[[], float]) -> None:
        self._server_time = server_time
        self._lock = threading.Lock()
        #: Tier time minus local time, in microseconds; 0 until measured or restored.
        self.offset_us = 0
        #: Whether the offset was measured (or restored from an earlier mount's measurement).
        self.known = False
        self._measured_at: float | None = None

    def restore(self, offset_us: int) -> None:
        """An offset an earlier mount measured (kept in the index): used until this mount measures."""
        self.offset_us, self.known = offset_us, True

    def due(self) -> bool:
        """Whether this mount has not measured yet, or measured longer than ``RESAMPLE_SECONDS`` ago."""
        return self._measured_at is None or time.monotonic() - self._measured_at >= RESAMPLE_SECONDS

    def measure(self) -> bool:
        """Ask the tier its time (blocking: in a thread) and move the offset if it is off by more than
        ``STEP_US``; whether it moved.  Raises the store's ``RemoteError`` when the tier does not answer."""
        with self._lock:
            before = time.time()
            server = self._server_time()
            after = time.time()
            self._measured_at = time.monotonic()
            offset = round((server - (before + after) / 2) * 1e6)
            if self.known and abs(offset - self.offset_us) <= STEP_US:
                return False
            if abs(offset) > STEP_US:
                log.warning("this node's clock is %+.1f s off the shared tier's: dating what it shares by the tier's",
                            -offset / 1e6)
            self.offset_us, self.known = offset, True
            return True

    def postpone(self) -> None:
        """A measurement failed: the next is due in ``RESAMPLE_SECONDS``, as after one that succeeded."""
        self._measured_at = time.monotonic()

    def measure_if_due(self) -> bool:
        return self.measure() if self.due() else False

    def now_us(self) -> int:
        """The tier's time now, in microseconds: a new version."""
        return time.time_ns() // 1000 + self.offset_us

    def now(self) -> float:
        """The tier's time now, in unix seconds: use records, blob and pack times, gc's ages."""
        return time.time() + self.offset_us / 1e6

    def horizon_us(self) -> int:
        """Versions past this are refused (see the module doc); no bound before the offset is known (a node
        whose clock runs behind would refuse every honest entry)."""
        return self.now_us() + FUTURE_SLACK_US if self.known else 1 << 63

    def horizon(self) -> float:
        """``horizon_us`` in unix seconds."""
        return self.horizon_us() / 1e6

    def version_of(self, ctime_ns: int) -> int:
        """The version of a local change made at *ctime_ns* (this node's clock)."""
        return ctime_ns // 1000 + self.offset_us

    def local_ns(self, version: int) -> int:
        """The local ctime of a name materialized at the tier's *version* (``version_of``'s inverse)."""
        return (version - self.offset_us) * 1000
