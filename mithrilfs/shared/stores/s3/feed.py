"""The change feed in a bucket: a small journal of objects under ``changes/``.

One object per announcement,
``changes/{time_ns // 10**12:08d}/{time_ns:020d}-{rand}``, written once
(``If-None-Match: *``), then the feed's head object, ``feed``, rewritten
(a few bytes naming the new key): its ETag changes with every announcement.
A follower asks for the head with ``If-None-Match`` its last ETag, one
small GET answered ``304 Not Modified`` while nothing was announced, and
lists only when it changed: one LIST of the keys of the current time
bucket (a "directory" of about 17 minutes; two LISTs when the window spans
a bucket's start), from the last key seen less a window for writers'
clocks and slow puts.  The head is written after the journal object, so a
follower that sees a new head lists the new key.  Announcers delete
journal objects older than ``S3_KEEP_SECONDS`` (one LIST, at most hourly).
The interface and what a record is: ``stores.feed``.
"""

from __future__ import annotations

import re
import secrets
import time
from typing import Any

from mithrilfs.shared.stores.feed import MAX_RECORD_BYTES, READ_BATCH, FeedWire
from mithrilfs.shared.stores.s3.conn import S3Connection, obstore_api

#: Seconds between two checks of the head (one conditional GET) while the mount is in use.
S3_PERIOD = 3.0
#: The feed's head object (a namespace's top-level name, ``s3.layout``): its ETag changes with each record.
HEAD_KEY = "feed"
#: Largest head object read (it names a journal key; anything larger is planted, and still a change).
HEAD_BYTES = 256
#: A journal object is kept this long; a node unmounted longer reconciles everything it holds at its mount.
S3_KEEP_SECONDS = 7 * 24 * 3600
#: An announcer deletes old journal objects at most this often.
S3_PRUNE_SECONDS = 3600.0
#: A bucket reader looks this far behind its cursor (writers' clocks, puts still in flight).
S3_WINDOW_NS = 30 * 10**9
#: Journal keys are listed by time bucket (their first 20 - S3_BUCKET_DIGITS digits): 10^12 ns, ~17 minutes.
S3_BUCKET_DIGITS = 12
S3_BUCKET_NS = 10**S3_BUCKET_DIGITS
#: A reader more buckets behind than this lists the whole journal (at its mount after a long absence).
S3_BUCKETS_LISTED = 4
#: Pages of 1,000 keys read per prefix per poll.
S3_PAGES = 20
#: A journal key dated further than this in the future is refused (it would hold the cursor ahead).
S3_FUTURE_NS = 3600 * 10**9
#: A journal key under ``changes/``: its time bucket (a "directory": object stores list by path segment,
#: so a prefix is a whole segment), then the writer's time_ns and a random tail.
_JOURNAL_KEY = re.compile(r"(\d{8})/(\d{20})-[A-Za-z0-9._-]{1,80}")


def _stamp(key: str) -> int | None:
    """The time_ns a journal key (under ``changes/``) is dated, None unless it is one (in its own bucket)."""
    m = _JOURNAL_KEY.fullmatch(key)
    if m is None or int(m.group(1)) != int(m.group(2)) // S3_BUCKET_NS:
        return None
    return int(m.group(2))


class S3Feed(FeedWire):
    """A journal of objects under the bucket's prefix (see the module doc)."""

    period = S3_PERIOD

    def __init__(self, store: S3Connection) -> None:
        self.store = store  # its clients, back-off and counted requests
        self.prefix = "changes/"
        #: Keys read within the window behind the cursor: not read twice.
        self._seen: set[str] = set()
        #: When this process last deleted old journal objects (at most once per ``S3_PRUNE_SECONDS``).
        self._pruned_at = 0.0
        #: The head's ETag at the last check ("" absent); None before the first check, which reads.
        self._head: str | None = None

    def _now_ns(self) -> int:
        """The bucket's time (its clock, ``stores.clock``): what the journal's keys are dated and read by."""
        return int(self.store.clock.now_us() * 1000)

    def head(self) -> str:
        return f"{self._now_ns():020d}"

    def changed(self, cursor: str, wait: float) -> bool:
        """Whether the head's ETag changed since the last check (the first check: always)."""
        import obstore.exceptions

        options = {"if_none_match": self._head} if self._head not in (None, "", "?") else {}

        def get() -> Any:
            try:
                return obstore_api().get(self.store.quick, self.store.base + HEAD_KEY, options=options)
            except obstore.exceptions.NotModifiedError:
                return "not modified"

        got = self.store.call(lambda: self.store.unless_absent(get))
        if got == "not modified":
            return False
        etag = "" if got is None else (got.meta.get("e_tag") or "?")
        if got is not None and got.meta["size"] <= HEAD_BYTES:
            got.bytes()  # read to its end: the connection is kept for the next request
        previous, self._head = self._head, etag
        return previous is None or etag == "?" or etag != previous

    def _prefixes(self, start: int, now: int) -> list[str]:
        """The listing prefixes that cover journal keys dated from *start* to *now*: one per time bucket
        (usually one), or the whole journal for a reader far behind.

        Prefixes, not a LIST's start-after: listing by start-after, followers make a node that mounts while
        a SeaweedFS volume server is down find the root manifest absent."""
        base = self.store.base + self.prefix
        first, last = start // S3_BUCKET_NS, now // S3_BUCKET_NS
        if last - first > S3_BUCKETS_LISTED:
            return [base]
        return [f"{base}{b:08d}/" for b in range(first, last + 1)]

    def read(self, cursor: str) -> tuple[list[bytes | None], str, bool]:
        now = self._now_ns()
        since = int(cursor) if cursor.isdigit() and len(cursor) <= 20 else now
        gap = since < now - S3_KEEP_SECONDS * 10**9
        start = max(0, since - S3_WINDOW_NS)

        def read() -> tuple[list[bytes | None], int]:
            base = self.store.base + self.prefix
            new: list[tuple[int, str]] = []
            out: list[bytes | None] = []
            for prefix in self._prefixes(start, now):
                for pages, batch in enumerate(obstore_api().list(self.store.names, prefix=prefix, chunk_size=1000)):
                    self.store.level.moved()
                    for meta in batch:
                        key = meta["path"][len(base):]
                        stamp = _stamp(key)
                        if key in self._seen or (stamp is not None and stamp < start):
                            continue  # read already, or older than the window: read before
                        if stamp is None or stamp > now + S3_FUTURE_NS or meta.get("size", 0) > MAX_RECORD_BYTES:
                            self._seen.add(key)
                            out.append(None)  # refused unread (counted by the reader)
                        else:
                            new.append((stamp, key))
                    if pages >= S3_PAGES:
                        break
            new.sort()
            latest = since
            for stamp, key in new[:READ_BATCH]:  # the rest at the next read
                got = self.store.get_object(self.store.names, self.prefix + key, MAX_RECORD_BYTES)
                out.append(got[0] if got is not None else None)
                self._seen.add(key)
                latest = max(latest, min(stamp, now))  # a key dated ahead (a clock, or planted) must not
                # move the cursor past records still to come
            return out, latest

        records, latest = self.store.call(read)
        self._seen = {k for k in self._seen if (_stamp(k) or latest) >= latest - 2 * S3_WINDOW_NS}
        return records, f"{latest:020d}", gap

    def append(self, raw: bytes) -> None:
        now = self._now_ns()
        key = f"{self.prefix}{now // S3_BUCKET_NS:08d}/{now:020d}-{secrets.token_hex(8)}"
        self.store.call(lambda: self.store.put_object(self.store.names, key, raw, "create", len(raw)))
        # after the record: a follower that sees the new head finds the record listed
        self.store.call(lambda: self.store.put_object(self.store.quick, HEAD_KEY, key.encode(), "overwrite", len(key)))
        if time.monotonic() - self._pruned_at > S3_PRUNE_SECONDS or not self._pruned_at:
            self._pruned_at = time.monotonic()
            self.store.call(self._prune)

    def _prune(self) -> None:
        """Delete journal objects older than ``S3_KEEP_SECONDS`` (at most one page per announcement): only
        keys that are journal keys (``_stamp``), never what else lies below ``changes/``."""
        base = self.store.base + self.prefix
        old = self._now_ns() - S3_KEEP_SECONDS * 10**9
        batch: Any = next(iter(obstore_api().list(self.store.names, prefix=base, chunk_size=1000)), [])
        self.store.level.moved()
        stale = [meta["path"] for meta in batch if (stamp := _stamp(meta["path"][len(base):])) is not None
                 and stamp < old]
        for path in stale:
            obstore_api().delete(self.store.names, path)
        self.store.level.moved(requests=len(stale))
