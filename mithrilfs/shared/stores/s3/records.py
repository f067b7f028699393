"""A bucket's shelf of startup sets and purges (``stores.records.Shelf``): one object per record.

A startup set's records are ``startup/~NAME/ID`` (the id sorts newest first
as text), each written over by its mount; the purges of ``forget --fleet``
are ``purges/V-R``, V the purge's version inverted (a listing gives the
newest first), each written once.  A listing is one page: a writer prunes
to a few records, and a flood of planted keys costs one request; a key
that is no record of the shelf (planted, or another fleet's nested below
it) is left out, never read, never pruned.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar
from urllib.parse import quote

from mithrilfs.shared.stores.entries import MAX_VERSION
from mithrilfs.shared.stores.records import Shelf, record_time, shelf_set_name, valid_record_id
from mithrilfs.shared.stores.s3.conn import S3Connection, obstore_api
from mithrilfs.shared.stores.s3.layout import is_record_key

PURGES_PREFIX = "purges/"

T = TypeVar("T")


def quoted(text: str) -> str:
    """A name as one component of a key (percent-quoted, no ``/``)."""
    return quote(text.encode(errors="surrogateescape"), safe="")


def purge_version(key: str) -> int | None:
    """The purge version a key was written with; None for a key that is no purge record's."""
    if not is_record_key(PURGES_PREFIX, key):
        return None
    version = MAX_VERSION - int(key[len(PURGES_PREFIX):len(PURGES_PREFIX) + 20])
    return version if 0 < version < MAX_VERSION else None


class S3Shelf(Shelf):
    """The records of an ``S3Store`` (its ``shelf``), through its connection (see the module doc)."""

    def __init__(self, s3: S3Connection) -> None:
        self.s3 = s3

    def run(self, fn: Callable[[], T]) -> T:
        return self.s3.call(fn)

    @staticmethod
    def _prefix(shelf: str) -> str:
        name = shelf_set_name(shelf)
        return PURGES_PREFIX if name is None else f"startup/~{quoted(name)}/"

    def put(self, shelf: str, record_id: str, score: float, data: bytes) -> None:
        """A startup record written over (no read, no merge); a purge's only if absent."""
        prefix = self._prefix(shelf)
        mode = "create" if prefix == PURGES_PREFIX else "overwrite"
        self.s3.put_object(self.s3.names, prefix + record_id, data, mode, len(data))

    def newest(self, shelf: str, n: int | None = None) -> list[tuple[str, float]]:
        """One LIST page, sorted newest first."""
        prefix = self._prefix(shelf)
        out: list[tuple[str, float]] = []
        for key in self.s3.first_page(prefix):
            if prefix == PURGES_PREFIX:
                if (version := purge_version(key)) is not None:
                    out.append((key[len(prefix):], version))
            elif valid_record_id(record_id := key[len(prefix):]):
                out.append((record_id, record_time(record_id)))
        if prefix == PURGES_PREFIX:
            out.sort(key=lambda r: -r[1])
        else:
            out.sort()  # by id: newest first
        return out if n is None else out[:n]

    def get(self, shelf: str, ids: list[str], limit: int) -> dict[str, bytes | None]:
        """One GET each, in parallel."""
        prefix = self._prefix(shelf)

        def one(record_id: str) -> Any:
            return self.s3.get_object(self.s3.names, prefix + record_id, limit)

        return {r: got[0] for r, got in zip(ids, self.s3.parallel(one, ids)) if got is not None}

    def delete(self, shelf: str, ids: list[str]) -> None:
        """One DELETE each, in parallel."""
        keys = [self.s3.base + self._prefix(shelf) + r for r in ids]
        self.s3.parallel(lambda key: obstore_api().delete(self.s3.names, key), keys)
        self.s3.level.moved(requests=len(keys))
