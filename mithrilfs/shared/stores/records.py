"""A startup set: what a workload read first, in the order it read it, with each name's entry.

A new node wants two things from the fleet before its workload asks: the
names the workload will look up, and their content, in the order it will
read them.  A set is made of *records*, one per mount that recorded one:
the paths its workload read in its first minutes (``STARTUP_SECONDS``), in
first-read order, each directory before what it holds, each with its entry
as the tier publishes it (the same signed JSON: ``EntryCodec``).  So a
reader materializes the names straight from the set, without one manifest
request per directory, and streams the blobs in the order they are wanted.

*Cheap to write, merge-free to read.*  A mount writes its own record (one
key or object, overwritten) at most once a minute while it records and
once at its unmount (``warm.recorder``): a few writes per mount whatever
its workload reads.  A reader takes the ``RECORDS_READ`` newest records
(their keys sort newest first) and merges them in memory: the newest
record's order first, then what the older ones add.  Nobody rewrites,
compacts or deletes another's record on the read path; a writer prunes
the records past the ``RECORDS_KEPT`` newest when it writes its last.

*Hostile until checked.*  A record is read from a store anyone with access
can write: one larger than ``MAX_RECORD_BYTES`` is never read, one that is
not a record or names more than ``MAX_RECORD_PATHS`` paths (no writer
records more) is refused whole, and each path and entry is checked like a
manifest's (``valid_name`` for every component, ``EntryCodec.decode``:
``parse_entry`` and the signature over namespace and path).  What fails is
dropped and counted in ``remote_rejected``; nothing here raises.

*Written once.*  What "the newest few, the rest pruned by a writer" means,
for startup sets and for the purges kept beside them (``forget --fleet``),
is here (``write_record``, ``read_records``, ``keep_purge``,
``kept_purges``), above four primitives a backend gives (``Shelf``: put a
record, list the newest ids, get some, delete some).
"""

from __future__ import annotations

import json
import logging
import math
import os
import secrets
import time
from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TypeVar

from mithrilfs.shared.stores.entries import MAX_VERSION, EntryCodec, RemoteEntry, newest
from mithrilfs.shared.stores.feed import MAX_RECORD_BYTES as MAX_FEED_RECORD_BYTES
from mithrilfs.store.namespace import valid_name

log = logging.getLogger(__name__)

#: Paths one record holds at most (a Triton load of 1,500 kernels reads 10,500 files).
MAX_RECORD_PATHS = 50_000
#: A path a set names is at most this long (``PATH_MAX`` less its NUL: what a program can open in one call).
MAX_PATH_BYTES = 4095
#: The purge records (``forget --fleet``) a loaded set is checked against: a new node never read the change
#: feed.  A set's entry older than the newest record left unread is not taken from the set (its directory
#: is listed instead).
PURGES_READ = max(1, int(_n)) if (_n := os.environ.get("MITHRILFS_PURGES_READ", "")).isdigit() else 64  # tests lower it
#: The purge records a store keeps (so that a reader sees where its reading stopped).
PURGES_KEPT = 2 * PURGES_READ
#: A purge record is the change feed's own (``stores.feed``): larger ones are not read.
MAX_PURGE_BYTES = MAX_FEED_RECORD_BYTES
#: The shelf of the purge records (``Shelf``); a startup set's is ``startup_shelf(name)``.
PURGES = "purges"
#: A record larger than this is refused unread (``MAX_RECORD_PATHS`` signed entries fit in it).
MAX_RECORD_BYTES = 32 << 20
#: Records a reader takes, the newest first: one request each, in parallel.
RECORDS_READ = 4
#: Records a set keeps: a writer deletes older ones when it writes its last (the reader never does).
RECORDS_KEPT = 16
#: Paths a merged set holds at most.
MAX_SET_PATHS = 100_000
FORMAT = 1


def new_record_id(started_ns: int | None = None) -> str:
    """A record's id: sorts newest first as text (the bucket lists keys in that order), unique per mount;
    *started_ns*: when the mount began, on the tier's clock (``stores.clock``; default: this machine's)."""
    return f"{(1 << 63) - (time.time_ns() if started_ns is None else started_ns):019d}-{secrets.token_hex(4)}"


def record_time(record_id: str) -> float:
    """When the record's mount began (seconds since the epoch)."""
    return ((1 << 63) - int(record_id[:19])) / 1e9


def valid_record_id(text: str) -> bool:
    head, _, tail = text.partition("-")
    return len(head) == 19 and head.isdigit() and len(tail) == 8 and all(c in "0123456789abcdef" for c in tail)


def valid_path(path: str) -> bool:
    """A path a set may name: relative, every component a name (no "", ".", "..", NUL or over 255 bytes),
    at most ``MAX_PATH_BYTES`` in all."""
    try:
        raw = path.encode(errors="surrogateescape")
    except UnicodeError:  # a lone surrogate JSON allows, no name can hold
        return False
    return len(raw) <= MAX_PATH_BYTES and all(valid_name(p) for p in raw.split(b"/"))


@dataclass(frozen=True)
class Record:
    """One mount's record: its id (newest sorts first) and its (path, entry) in first-read order."""

    id: str
    items: list[tuple[str, RemoteEntry]]


def encode_record(codec: EntryCodec, items: list[tuple[str, RemoteEntry]]) -> bytes:
    """A record's bytes: each entry encoded (and signed) exactly as it is published."""
    order = [[path, codec.encode(path, entry).decode()] for path, entry in items[:MAX_RECORD_PATHS]]
    return json.dumps({"mithrilfs": FORMAT, "order": order}, separators=(",", ":")).encode(errors="surrogateescape")


def decode_records(codec: EntryCodec, raw: list[tuple[str, bytes | None]]) -> list[Record]:
    """The records of one store's (id, bytes), newest first, those that are records.

    The records a reader takes mostly name the same paths with the same entries (each mount of a fleet
    records the workload it shares): an item whose path and encoded entry a newer record already gave
    is left out unchecked, since ``merged`` would keep that entry anyway.  Checking each entry's signature
    is most of a set's load (see docs/benchmarks.md, 'H5, a startup set's entries checked once')."""
    known: set[tuple[str, str]] = set()
    out = []
    for record_id, data in sorted(raw, key=lambda r: r[0]):
        record = decode_record(codec, record_id, data, known)
        if record is not None:
            out.append(record)
    return out


def decode_record(codec: EntryCodec, record_id: str, data: bytes | None,
                  known: set[tuple[str, str]] | None = None) -> Record | None:
    """A record from a store's bytes (None: larger than the limit, never read); None when it is not one
    (counted).  Bad paths and entries are dropped one by one (counted by the codec or here).  *known*:
    the (path, encoded entry) pairs decoded from newer records (items equal to one are left out), added to."""
    counters = codec.counters
    if data is None or len(data) > MAX_RECORD_BYTES:
        counters["remote_rejected"] += 1
        log.warning("startup set record %s ignored: larger than %d bytes", record_id, MAX_RECORD_BYTES)
        return None
    try:
        doc = json.loads(data)
        if not isinstance(doc, dict) or doc.get("mithrilfs") != FORMAT or not isinstance(doc.get("order"), list):
            raise ValueError("not a startup set record")
    except (ValueError, RecursionError) as e:
        counters["remote_rejected"] += 1
        log.warning("startup set record %s ignored: %s", record_id, str(e)[:100])
        return None
    if len(doc["order"]) > MAX_RECORD_PATHS:  # no writer records more: planted
        counters["remote_rejected"] += 1
        log.warning("startup set record %s ignored: %d paths, more than a record holds (%d)", record_id,
                    len(doc["order"]), MAX_RECORD_PATHS)
        return None
    items: list[tuple[str, RemoteEntry]] = []
    bad = 0
    known = set() if known is None else known
    for item in doc["order"]:
        if not isinstance(item, list) or len(item) != 2 or not all(isinstance(x, str) for x in item):
            bad += 1
            continue
        path, text = item
        if (path, text) in known:
            continue  # a newer record gave this path this entry: checked there, merged to the same
        if not valid_path(path):
            bad += 1
            continue
        try:
            raw = text.encode(errors="surrogateescape")
        except UnicodeError:
            bad += 1
            continue
        entry = codec.decode(path, raw)  # parse_entry and the signature; counted when refused
        if entry is not None:
            items.append((path, entry))
            known.add((path, text))
    if bad:
        counters["remote_rejected"] += bad
        log.warning("startup set record %s: %d items that are no path and entry ignored", record_id, bad)
    return Record(record_id, items)


def merged(records: list[Record]) -> list[tuple[str, RemoteEntry]]:
    """The set: the newest record's order, then what older ones add (each path once, its newest entry)."""
    order: dict[str, RemoteEntry] = {}
    seen: set[str] = set()
    for record in sorted(records, key=lambda r: r.id):  # ids sort newest first
        if record.id in seen:  # the same record from two levels (Redis in front of a bucket)
            continue
        seen.add(record.id)
        for path, entry in record.items:
            if path in order:
                order[path] = newest(order[path], entry)  # type: ignore[assignment]
            elif len(order) < MAX_SET_PATHS:
                order[path] = entry
    return list(order.items())


T = TypeVar("T")


def startup_shelf(name: str) -> str:
    """The shelf of startup set *name*'s records (``Shelf``)."""
    return f"startup/{name}"


def shelf_set_name(shelf: str) -> str | None:
    """The startup set a shelf holds, None for the purges' (``PURGES``)."""
    return shelf[len("startup/"):] if shelf.startswith("startup/") else None


def purge_id(version: int) -> str:
    """A new purge record's id: sorts newest (highest *version*) first as text, unique per writer."""
    return f"{MAX_VERSION - version:020d}-{secrets.token_hex(6)}"


class Shelf(ABC):
    """Where a store keeps small records: the primitives startup sets and purges are written on.

    A *shelf* (``startup_shelf(NAME)``, ``PURGES``) holds records, each with
    an id and a score (a startup record's ``record_time``, a purge's
    version), listed newest first.  What "the newest N, the rest pruned, and
    the floor" means is written once, here (``write_record``,
    ``read_records``, ``keep_purge``, ``kept_purges``); a backend gives the
    four primitives and, where its requests need it, ``run``.
    """

    def run(self, fn: Callable[[], T]) -> T:
        """*fn* (a few of the primitives) as one request of the store: its failures a RemoteError and a
        back-off.  By default *fn* itself."""
        return fn()

    @abstractmethod
    def put(self, shelf: str, record_id: str, score: float, data: bytes) -> None:
        """Write record *record_id* (over the one of that id, if any)."""

    @abstractmethod
    def newest(self, shelf: str, n: int | None = None) -> list[tuple[str, float]]:
        """The (id, score) of the shelf's *n* newest records (None: all the store lists at once), newest
        first; a key that is no record of the shelf may be left out (planted, or another fleet's)."""

    @abstractmethod
    def get(self, shelf: str, ids: list[str], limit: int) -> dict[str, bytes | None]:
        """The bytes of those of *ids* still there (None: more than *limit* bytes, never read whole)."""

    @abstractmethod
    def delete(self, shelf: str, ids: list[str]) -> None:
        """Delete these records (one gone already is no error)."""


class NullShelf(Shelf):
    """A store that keeps no records: its startup sets and purges are nowhere, and read empty."""

    def put(self, shelf: str, record_id: str, score: float, data: bytes) -> None:
        return None

    def newest(self, shelf: str, n: int | None = None) -> list[tuple[str, float]]:
        return []

    def get(self, shelf: str, ids: list[str], limit: int) -> dict[str, bytes | None]:
        return {}

    def delete(self, shelf: str, ids: list[str]) -> None:
        return None


def write_record(shelf: Shelf, codec: EntryCodec, name: str, record_id: str,
                 items: list[tuple[str, RemoteEntry]], *, last: bool = False) -> None:
    """Write (over) a mount's record of set *name*; *last*, its final write, also deletes the set's records
    past the ``RECORDS_KEPT`` newest (a writer prunes, never a reader)."""
    where = startup_shelf(name)
    shelf.put(where, record_id, record_time(record_id), encode_record(codec, items))
    if last:
        old = [r for r, _ in shelf.newest(where)[RECORDS_KEPT:]]
        if old:
            shelf.delete(where, old)


def read_records(shelf: Shelf, codec: EntryCodec, name: str, skip: frozenset[str] = frozenset()) -> list[Record]:
    """The ``RECORDS_READ`` newest records of set *name*, checked; *skip*: ids the caller holds already,
    neither read nor decoded again.  Never a write."""
    where = startup_shelf(name)
    ids = [r for r, _ in shelf.newest(where, RECORDS_READ) if valid_record_id(r) and r not in skip]
    if not ids:
        return []
    got = shelf.get(where, ids, MAX_RECORD_BYTES)
    return decode_records(codec, [(r, got[r]) for r in ids if r in got])


def keep_purge(shelf: Shelf, version: int, raw: bytes) -> None:
    """Keep a ``forget --fleet``'s record, and only the ``PURGES_KEPT`` newest (so that a reader sees where
    its reading stopped)."""
    shelf.put(PURGES, purge_id(version), version, raw)
    old = [r for r, _ in shelf.newest(PURGES)[PURGES_KEPT:]]
    if old:
        shelf.delete(PURGES, old)


def kept_purges(shelf: Shelf) -> tuple[list[bytes], int]:
    """The ``PURGES_READ`` newest purge records (unchecked) and the floor: the version of the newest one left
    unread, or listed and gone (or too large) before it was read: its paths are unknown, so a set's entries
    older than it are not trusted.  0: none; a score that is no version trusts nothing (``MAX_VERSION``)."""
    listed = shelf.newest(PURGES, PURGES_READ + 1)
    floor = _version_floor(listed[PURGES_READ][1]) if len(listed) > PURGES_READ else 0
    read = listed[:PURGES_READ]
    got = shelf.get(PURGES, [r for r, _ in read], MAX_PURGE_BYTES) if read else {}
    out = []
    for r, score in read:
        data = got.get(r)
        if data is None:
            floor = max(floor, _version_floor(score))
        else:
            out.append(data)
    return out, floor


def _version_floor(score: float) -> int:
    return int(score) if math.isfinite(score) and 0 <= score < MAX_VERSION else MAX_VERSION


#: The shelf of every store that keeps no records (it holds no state).
NULL_SHELF = NullShelf()
