"""The change feed in Redis: one stream, ``mfs:{namespace}:changes``.

Appended with ``XADD MAXLEN ~ FEED_MAXLEN``.  A follower waits for news in
the server: one ``XREAD BLOCK`` of at most ``WAIT_MAX`` seconds from the
last id seen, answered the moment a record is appended, then reads on
(the interface and what a record is: ``stores.feed``).  The wait runs on a
client of its own (``RedisConnection.waiting_client``).  A reader away long
enough for the stream to be trimmed past its cursor is told it missed
records (``read``'s third value), once, at its first read.
"""

from __future__ import annotations

import re
from typing import Any

from mithrilfs.shared.stores.feed import FEED_MAXLEN, MAX_RECORD_BYTES, READ_BATCH, FeedWire
from mithrilfs.shared.stores.redis.conn import RedisConnection

#: Seconds between two polls (one XREAD) by a follower that does not wait in the server.
REDIS_PERIOD = 2.0
#: The longest one ``XREAD BLOCK`` waits (a longer wait asked for is cut to it).
WAIT_MAX = 100.0
#: The waiting client's socket timeout: a wait's answer is due within it.
WAIT_TIMEOUT = WAIT_MAX + 20.0


class RedisFeed(FeedWire):
    """A Redis stream (see the module doc)."""

    period = REDIS_PERIOD
    blocks = True

    def __init__(self, store: RedisConnection) -> None:
        self.store = store  # its client, back-off and counted requests
        self.key = f"{store.prefix}changes"
        self._checked_gap = False

    def head(self) -> str:
        last = self.store.call(lambda: self.store.client.xrevrange(self.key, "+", "-", count=1))
        return last[0][0].decode() if last else "0-0"

    def changed(self, cursor: str, wait: float) -> bool:
        """One ``XREAD BLOCK`` from *cursor*: True as soon as a record is there, False after *wait* seconds
        (at most ``WAIT_MAX``) without one.  The first check reads at once: it asks whether records were
        trimmed away while this node was gone."""
        if not self._checked_gap or not re.fullmatch(r"\d{1,20}-\d{1,20}", cursor):
            return True
        block_ms = max(1, int(min(wait, WAIT_MAX) * 1000))
        client = self.store.waiting_client(WAIT_TIMEOUT)
        got = self.store.call(lambda: client.xread({self.key: cursor}, count=1, block=block_ms))
        return bool(got)

    def read(self, cursor: str) -> tuple[list[bytes | None], str, bool]:
        if not re.fullmatch(r"\d{1,20}-\d{1,20}", cursor):
            cursor = "0-0"
        gap = False
        if not self._checked_gap:  # only a reader away for FEED_MAXLEN records can miss some: at its start
            gap = self._missed(cursor)
            self._checked_gap = True
        got = self.store.call(lambda: self.store.client.xread({self.key: cursor}, count=READ_BATCH))
        out: list[bytes | None] = []
        for _key, records in got or []:
            for record_id, fields in records:
                cursor = record_id.decode()
                raw = fields.get(b"r") if isinstance(fields, dict) else None
                out.append(raw if isinstance(raw, bytes) and len(raw) <= MAX_RECORD_BYTES else None)
        return out, cursor, gap

    def _missed(self, cursor: str) -> bool:
        """Whether the stream dropped records after *cursor* (trimmed while this node was away)."""
        import redis  # redis-py is imported where it is used (``redis.conn``)

        def info() -> Any:
            try:
                return self.store.client.xinfo_stream(self.key)
            except redis.ResponseError:  # no stream (yet, or Redis restarted empty): nothing was trimmed
                return None

        got = self.store.call(info)
        if not got:
            return False

        def as_id(value: Any) -> tuple[int, int]:
            return _stream_id(value.decode() if isinstance(value, bytes) else str(value))

        after = _stream_id(cursor)
        if as_id(got.get("max-deleted-entry-id", b"0-0")) > after:  # XDEL past the cursor
            return True
        # trimming (MAXLEN) takes the oldest records and (Redis 7.0) does not move
        # max-deleted-entry-id: records went when fewer remain than were added, and what remains starts
        # after the cursor (or nothing remains and the last one made is after it)
        removed = int(got.get("entries-added", 0) or 0) - int(got.get("length", 0) or 0)
        first = got.get("first-entry")
        oldest = as_id(first[0]) if first else as_id(got.get("last-generated-id", b"0-0"))
        return removed > 0 and oldest > after

    def append(self, raw: bytes) -> None:
        self.store.call(lambda: self.store.client.xadd(self.key, {"r": raw}, maxlen=FEED_MAXLEN, approximate=True))


def _stream_id(text: str) -> tuple[int, int]:
    ms, _, seq = text.partition("-")
    try:
        return int(ms), int(seq or 0)
    except ValueError:
        return 0, 0
