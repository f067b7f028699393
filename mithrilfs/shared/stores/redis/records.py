"""Records in Redis: the shelf of startup sets and purges (``stores.records.Shelf``).

Part of ``stores.redis.store.RedisStore`` (its ``shelf``): a startup set's
records are values (``startup:{NAME}:ID``) indexed by a sorted set of ids
by time (``startup:{NAME}``: the name in braces is a cluster hash tag, so
the index and its records live in one slot); the purges, small, are the
members of one sorted set by version (``purges``): listed and read in one
request.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

from mithrilfs.shared.stores.records import PURGES, Shelf, shelf_set_name
from mithrilfs.shared.stores.redis.conn import RedisConnection

#: A startup set's records stay this long after their last write (seconds).
RECORD_TTL = 30 * 24 * 3600

T = TypeVar("T")


class RedisShelf(Shelf):
    """Startup-set and purge records of a RedisStore, through its connection; may raise RemoteError.

    The primitives run inside ``run`` (one request of the connection: a few
    round trips, one counted)."""

    def __init__(self, conn: RedisConnection) -> None:
        self.conn = conn
        self.prefix = conn.prefix
        self.level = conn.level

    @property
    def client(self) -> Any:
        return self.conn.client

    def run(self, fn: Callable[[], T]) -> T:
        return self.conn.call(fn)

    def _index(self, shelf: str) -> str:
        name = shelf_set_name(shelf)
        return self.conn.purges_key if name is None else f"{self.prefix}startup:{{{name}}}"

    def put(self, shelf: str, record_id: str, score: float, data: bytes) -> None:
        """A purge: a member of the index; a startup record: its value, and its id in the index (one pipeline)."""
        index = self._index(shelf)
        if shelf == PURGES:
            self.client.zadd(index, {data: score})
            return
        pipe = self.client.pipeline(transaction=False)
        pipe.set(f"{index}:{record_id}", data, ex=RECORD_TTL)
        pipe.zadd(index, {record_id: score})
        pipe.expire(index, RECORD_TTL)
        pipe.execute()
        self.level.moved(up=len(data), requests=0)

    def newest(self, shelf: str, n: int | None = None) -> list[tuple[str, float]]:
        """One ``ZREVRANGE``; a purge's id is the record itself."""
        got = self.client.zrevrange(self._index(shelf), 0, -1 if n is None else n - 1, withscores=True)
        return [(m.decode(errors="surrogateescape"), score) for m, score in got]

    def get(self, shelf: str, ids: list[str], limit: int) -> dict[str, bytes | None]:
        """A purge: its id; startup records: one pipeline of GETRANGEs, each at most *limit* + 1 bytes (a
        planted giant is never read whole); one gone (its time to live) is left out."""
        if shelf == PURGES:
            return {r: r.encode(errors="surrogateescape") for r in ids}
        index = self._index(shelf)
        pipe = self.client.pipeline(transaction=False)
        for r in ids:
            pipe.getrange(f"{index}:{r}", 0, limit)
        out: dict[str, bytes | None] = {}
        for r, data in zip(ids, pipe.execute()):
            if data:
                self.level.moved(down=len(data), requests=0)
                out[r] = data if len(data) <= limit else None
        return out

    def delete(self, shelf: str, ids: list[str]) -> None:
        index = self._index(shelf)
        members = [r.encode(errors="surrogateescape") for r in ids]
        pipe = self.client.pipeline(transaction=False)
        if shelf != PURGES:
            for r in ids:  # one key a command: a cluster pipeline refuses a DEL of several
                pipe.delete(f"{index}:{r}")
        pipe.zrem(index, *members)
        pipe.execute()
