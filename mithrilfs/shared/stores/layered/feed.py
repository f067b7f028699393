"""The change feed of Redis in front of a bucket: appended to both, followed in Redis.

A node with the bucket alone reads the bucket's journal; one with both
follows the cheaper Redis stream.  An announcement fails only when neither
level took it.
"""

from __future__ import annotations

from mithrilfs.shared.stores.entries import RemoteError
from mithrilfs.shared.stores.feed import FeedWire


class LayeredFeed(FeedWire):
    """Redis in front of a bucket: appended to both, followed in Redis."""

    def __init__(self, front: FeedWire, back: FeedWire) -> None:
        self.front = front
        self.back = back
        self.period = front.period
        self.blocks = front.blocks

    def changed(self, cursor: str, wait: float) -> bool:
        return self.front.changed(cursor, wait)

    def head(self) -> str:
        return self.front.head()

    def read(self, cursor: str) -> tuple[list[bytes | None], str, bool]:
        return self.front.read(cursor)

    def append(self, raw: bytes) -> None:
        errors = []
        for wire in (self.back, self.front):
            try:
                wire.append(raw)
            except RemoteError as e:
                errors.append(str(e))
        if len(errors) == 2:
            raise RemoteError("; ".join(errors))
