"""The purges a bucket keeps beside its startup sets: one object per record of ``forget --fleet``.

A startup set names files with their entries, and a new node creates them
without listing their directories; it never read the change feed either
(it starts at the feed's head, and the feed keeps days at most).  So each
purge's record (the feed's own, signed like it) is also kept here, under
``purges/`` with the purge's version inverted in the key (a listing gives
the newest first), and a set is checked against them when it is loaded
(``StartupOrder``).  One LIST and at most ``PURGES_READ`` GETs in parallel
per loaded set; a writer deletes the records past the ``PURGES_KEPT``
newest, so the reader can tell where its reading stopped (the floor).
"""

from __future__ import annotations

from typing import Any

from mithrilfs.shared.stores.entries import MAX_VERSION
from mithrilfs.shared.stores.feed import MAX_RECORD_BYTES
from mithrilfs.shared.stores.records import PURGES_KEPT, PURGES_READ
from mithrilfs.shared.stores.s3.conn import _obstore
from mithrilfs.shared.stores.s3.layout import is_record_key, record_key

PREFIX = "purges/"


def _version(key: str) -> int | None:
    """The purge version a key was written with; None for a key that is no purge record's (planted, or
    another fleet's nested below ``purges/``: never read, never pruned)."""
    if not is_record_key(PREFIX, key):
        return None
    version = MAX_VERSION - int(key[len(PREFIX):len(PREFIX) + 20])
    return version if 0 < version < MAX_VERSION else None


class S3Purges:
    """The purge records of an ``S3Store`` (its ``purges``), through its connection."""

    def __init__(self, s3: Any) -> None:
        self.s3 = s3

    def _keys(self) -> list[tuple[str, int]]:
        """(key, version), newest first, of one LIST page (``S3Store._first_page``)."""
        out = [(k, v) for k in self.s3._first_page(PREFIX) if (v := _version(k)) is not None]
        return sorted(out, key=lambda kv: -kv[1])

    def keep(self, version: int, raw: bytes) -> None:
        def write() -> None:
            key = record_key(PREFIX, MAX_VERSION - version)
            self.s3._put(self.s3.names, key, raw, "create", len(raw))
            old = [k for k, _ in self._keys()[PURGES_KEPT:]]
            self.s3._parallel(lambda k: _obstore().delete(self.s3.names, self.s3.base + k), old)
            self.s3.level.moved(requests=len(old))

        self.s3._call(write)

    def kept(self) -> tuple[list[bytes], int]:
        """The newest records and the floor: the newest version left unread, or listed and gone before its
        GET (a writer pruned it): its paths are unknown, so entries older than it are not trusted."""
        def read() -> tuple[list[bytes], int]:
            keys = self._keys()
            floor = keys[PURGES_READ][1] if len(keys) > PURGES_READ else 0

            def one(key: str) -> bytes | None:
                got = self.s3._get(self.s3.names, key, MAX_RECORD_BYTES)
                return None if got is None else got[0]

            out = []
            for (_, version), raw in zip(keys, self.s3._parallel(one, [k for k, _ in keys[:PURGES_READ]])):
                if raw is None:
                    floor = max(floor, version)
                else:
                    out.append(raw)
            return out, floor

        return self.s3._call(read)
