"""The change feed's interface: append records, read them from a cursor; and the feed of a store with none.

The feed (``sync.changes``) tells every mounted node of deletions as they
are published, so a node stops serving a name without waiting for a listing
of its directory.  Each store carries it by its own means, in its own
package: a Redis stream (``redis.feed``), a journal of small objects in a
bucket (``s3.feed``), both for Redis in front of a bucket (``layered.feed``),
built by ``connect.open_feed``.  A stream or a journal rather than pub/sub
because they keep what was said: a node disconnected for a moment, or
unmounted for a day, reads what it missed from its cursor (kept in the
index); pub/sub forgets a message nobody was subscribed for.

A ``FeedWire`` knows bytes and cursors only; what a record means and whether
it is valid is ``sync.changes``'s.  Every method is blocking I/O run in a
worker thread and may raise ``RemoteError`` (the store's back-off applies).
"""

from __future__ import annotations

from abc import ABC, abstractmethod

#: Largest record read from a feed (an announcement of 256 paths of 255-byte names fits well below it).
MAX_RECORD_BYTES = 64 << 10
#: Records read per poll (a node behind reads on at the next poll).
READ_BATCH = 100
#: A feed that trims (a Redis stream, the memory feed) keeps about this many records.
FEED_MAXLEN = 10_000
#: Seconds between two reads by a follower, unless its feed says otherwise.
DEFAULT_PERIOD = 2.0


class FeedWire(ABC):
    """Append records to a feed and read them from a cursor (an opaque string kept by the reader)."""

    #: Seconds between two checks by a follower while its mount is in use (``sync.pulse``).
    period: float = DEFAULT_PERIOD
    #: Whether ``changed`` waits in the tier for news (a follower then needs no period of its own).
    blocks: bool = False

    def changed(self, cursor: str, wait: float) -> bool:
        """Whether records after *cursor* may be there: False only when the feed knows there are none.  A
        feed that ``blocks`` waits up to *wait* seconds for one; another answers at once, in at most one
        cheap request (no listing).  The default: always (the follower reads)."""
        return True

    @abstractmethod
    def head(self) -> str:
        """A cursor at the feed's end now: a reader starting here reads only what comes later."""

    @abstractmethod
    def read(self, cursor: str) -> tuple[list[bytes | None], str, bool]:
        """(records after *cursor*, at most ``READ_BATCH``; None for one refused unread (too large), the
        new cursor, True when records after *cursor* may have been dropped: the reader missed some)."""

    @abstractmethod
    def append(self, raw: bytes) -> None:
        """Add one record."""


class NullFeed(FeedWire):
    """A store with no feed: nothing is announced, nothing comes."""

    period = 3600.0

    def changed(self, cursor: str, wait: float) -> bool:
        return False

    def head(self) -> str:
        return ""

    def read(self, cursor: str) -> tuple[list[bytes | None], str, bool]:
        return [], cursor, False

    def append(self, raw: bytes) -> None:
        pass
