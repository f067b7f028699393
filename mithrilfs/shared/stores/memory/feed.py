"""The change feed of a memory store: a list of records on its server, read from a cursor, trimmed past a length.

Like the Redis stream: a cursor is a record's position (the count of
records ever appended before it), so a reader away for a while reads what
it missed; one whose cursor fell below what was trimmed is told it missed
some (it reconciles everything it holds).
"""

from __future__ import annotations

from mithrilfs.shared.stores.feed import FEED_MAXLEN, MAX_RECORD_BYTES, READ_BATCH, FeedWire
from mithrilfs.shared.stores.memory.store import MemoryStore


class MemoryFeed(FeedWire):
    """The feed of *store*'s namespace; *maxlen*: records kept (older ones are trimmed)."""

    period = 0.05

    def __init__(self, store: MemoryStore, maxlen: int = FEED_MAXLEN) -> None:
        self.store = store
        self.maxlen = maxlen

    def head(self) -> str:
        return self.store.call(lambda: str(self.store.space.feed_base + len(self.store.space.feed)))

    def changed(self, cursor: str, wait: float) -> bool:
        """Whether records lie after *cursor* (one request, at once)."""
        def changed() -> bool:
            space = self.store.space
            return not (cursor.isdigit() and len(cursor) < 20) or int(cursor) < space.feed_base + len(space.feed)

        return bool(self.store.call(changed))

    def read(self, cursor: str) -> tuple[list[bytes | None], str, bool]:
        def read() -> tuple[list[bytes | None], str, bool]:
            space = self.store.space
            at = int(cursor) if cursor.isdigit() and len(cursor) < 20 else 0
            gap = at < space.feed_base
            start = max(at, space.feed_base)
            got = space.feed[start - space.feed_base:start - space.feed_base + READ_BATCH]
            out: list[bytes | None] = [raw if len(raw) <= MAX_RECORD_BYTES else None for raw in got]
            return out, str(start + len(got)), gap

        return self.store.call(read)

    def append(self, raw: bytes) -> None:
        def append() -> None:
            space = self.store.space
            space.feed.append(raw)
            over = len(space.feed) - self.maxlen
            if over > 0:
                del space.feed[:over]
                space.feed_base += over

        self.store.call(append)
