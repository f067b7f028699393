"""Records in Redis: startup sets (one record per mount, ``startup_sets``) and use records (fleet gc).

Part of ``redis_wire.RedisStore`` (its ``records``): what a mount read first,
for the next mount's prefetch, and when each directory was last used, for
``fleet gc`` (``shared.gc``); both small, written in one pipeline.
"""

from __future__ import annotations

import math
from typing import Any

from mithrilfs.shared.stores.entries import MAX_VERSION, RemoteEntry
from mithrilfs.shared.stores.records import (
    MAX_RECORD_BYTES,
    PURGES_KEPT,
    PURGES_READ,
    RECORDS_KEPT,
    RECORDS_READ,
    Record,
    decode_records,
    encode_record,
    record_time,
    valid_record_id,
)
from mithrilfs.shared.stores.redis.conn import _BATCH, RedisConnection

#: A startup set's records stay this long after their last write (seconds).
RECORD_TTL = 30 * 24 * 3600


class RedisRecords:
    """Startup-set and use records of a RedisStore, through its connection; may raise RemoteError."""

    def __init__(self, conn: RedisConnection) -> None:
        self.conn = conn
        self.prefix = conn.prefix
        self.codec = conn.codec
        self.level = conn.level

    @property
    def client(self) -> Any:
        return self.conn.client

    def _call(self, fn: Any, *args: Any) -> Any:
        return self.conn._call(fn, *args)

    def _set_key(self, name: str) -> str:
        """The set's index (a sorted set of record ids by time); the name in braces is a cluster hash tag,
        so the index and its records live in one slot."""
        return f"{self.prefix}startup:{{{name}}}"

    def write_startup_record(self, name: str, record_id: str, items: list[tuple[str, RemoteEntry]], *,
                             last: bool = False) -> None:
        """This mount's record, written over (one pipeline): the value, and its id in the set's index; the
        last write also drops the records past the ``RECORDS_KEPT`` newest."""
        def write() -> None:
            data = encode_record(self.codec, items)
            index = self._set_key(name)
            pipe = self.client.pipeline(transaction=False)
            pipe.set(f"{index}:{record_id}", data, ex=RECORD_TTL)
            pipe.zadd(index, {record_id: record_time(record_id)})
            pipe.expire(index, RECORD_TTL)
            pipe.execute()
            self.level.moved(up=len(data), requests=0)
            if last:
                old = [m.decode() for m in self.client.zrange(index, 0, -(RECORDS_KEPT + 1))]
                if old:
                    pipe = self.client.pipeline(transaction=False)
                    for r in old:  # one key a command: a cluster pipeline refuses a DEL of several
                        pipe.delete(f"{index}:{r}")
                    pipe.zrem(index, *old)
                    pipe.execute()

        self._call(write)

    def startup_records(self, name: str, skip: frozenset[str] = frozenset()) -> list[Record]:
        """The newest records: their ids (ZREVRANGE), then their values (one pipeline of GETRANGEs, each
        at most ``MAX_RECORD_BYTES`` + 1: a planted giant is never read whole); never a write.  *skip*: ids
        the caller holds already (the bucket behind gave them), neither read nor decoded again."""
        def read() -> list[Record]:
            index = self._set_key(name)
            ids = [m.decode(errors="replace") for m in self.client.zrevrange(index, 0, RECORDS_READ - 1)]
            ids = [r for r in ids if valid_record_id(r) and r not in skip]
            if not ids:
                return []
            pipe = self.client.pipeline(transaction=False)
            for r in ids:
                pipe.getrange(f"{index}:{r}", 0, MAX_RECORD_BYTES)
            raw: list[tuple[str, bytes | None]] = []
            for r, data in zip(ids, pipe.execute()):
                if data:  # gone (its time to live): nothing to read
                    self.level.moved(down=len(data), requests=0)
                    raw.append((r, data if len(data) <= MAX_RECORD_BYTES else None))
            return decode_records(self.codec, raw)

        return self._call(read)

    def keep_purge(self, version: int, raw: bytes) -> None:
        """A sorted set of the records by version (one pipeline: add, and drop past ``PURGES_KEPT``)."""
        def write() -> None:
            pipe = self.client.pipeline(transaction=False)
            pipe.zadd(self.conn.purges_key, {raw: version})
            pipe.zremrangebyrank(self.conn.purges_key, 0, -(PURGES_KEPT + 1))
            pipe.execute()

        self._call(write)

    def kept_purges(self) -> tuple[list[bytes], int]:
        """One ``ZREVRANGE``: the newest records and the next one's version (the floor)."""
        def read() -> tuple[list[bytes], int]:
            got = self.client.zrevrange(self.conn.purges_key, 0, PURGES_READ, withscores=True)
            floor = 0
            if len(got) > PURGES_READ:
                score = got[PURGES_READ][1]  # planted out of range: nothing in the set is trusted
                floor = int(score) if math.isfinite(score) and 0 <= score < MAX_VERSION else MAX_VERSION
            return [raw for raw, _ in got[:PURGES_READ]], floor

        return self._call(read)

    def record_use(self, records: dict[str, float]) -> None:
        """``ZADD GT``: a record never moves a directory's last use back."""
        def add() -> None:
            pipe = self.client.pipeline(transaction=False)
            items = list(records.items())
            for start in range(0, len(items), _BATCH):
                pipe.zadd(self.conn.used_key, dict(items[start:start + _BATCH]), gt=True)
            pipe.execute()

        if records:
            self._call(add)

