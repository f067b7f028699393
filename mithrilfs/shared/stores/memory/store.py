"""The shared tier in this process's memory: a ``RemoteStore`` for unit tests, with the real stores' semantics.

A ``MemoryServer`` plays the server: one per test, shared by the stores
made on it, each store one node of a fleet (its own counters, level and
clock).  It holds what Redis or a bucket would, by namespace: each
directory's entries as their signed bytes (``EntryCodec``: what is read is
validated and checked against the signature exactly as a real store's), blobs by
blake3 with the time each was written, startup-set records, purge records,
use records, the epoch, the change feed's records and the last gc's summary.
A test plants hostile data by writing the server's dicts directly, as it
would with ``redis-cli`` or an S3 client.

The semantics are the real stores' (the contract suite in tests/contract
runs the same scenarios on every backend): the newest (version, node) per
name stays, an entry that is not valid for the reader (forged, unsigned,
dated past the tier's time) never keeps a write out; a blob must come to
exactly its size, a small one is verified (size and blake3) where it is
read; a blob written longer ago than ``ages.BLOB_TRUST_SECONDS`` counts as
missing (gc may delete it once unreferenced), as in Redis alone; the
newest ``RECORDS_READ`` records are read, a last write keeps the
``RECORDS_KEPT`` newest; the newest ``PURGES_READ`` purges with the floor.
The server's clock is the process's plus ``MemoryServer.offset`` (a test
moves the tier's time); ``fail_next`` makes a store's next requests fail
as an unreachable server does (``RemoteError``, and the level backs off).
Blobs are found by hash alone: no pack placement.
"""

from __future__ import annotations

import logging
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, BinaryIO, TypeVar

from mithrilfs.shared.stores import ages
from mithrilfs.shared.stores.base import Level, RemoteStore, new_counters
from mithrilfs.shared.stores.clock import TierClock
from mithrilfs.shared.stores.entries import BlobBytes, EntryCodec, RemoteEntry
from mithrilfs.shared.stores.records import Shelf
from mithrilfs.shared.stores.stream import HashedCopy, verified_small
from mithrilfs.shared.stores.summary import parse_summary

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Blobs up to this size are fetched in batches by the prefetcher.
SMALL_BLOB_BYTES = 8 << 20

@dataclass
class Space:
    """One namespace's data on a ``MemoryServer`` (raw, as a store would hold it)."""

    #: Directory path -> entry name -> the entry's bytes (``EntryCodec.encode``).
    dirs: dict[str, dict[bytes, bytes]] = field(default_factory=dict)
    #: Blob hex -> (its bytes, when it was last written, the tier's unix seconds).
    blobs: dict[str, tuple[bytes, float]] = field(default_factory=dict)
    #: Blob hex -> the path it was first published under.
    blob_names: dict[str, str] = field(default_factory=dict)
    #: Shelf (``records.Shelf``: a startup set's, the purges') -> record id -> (its score, its bytes).
    shelves: dict[str, dict[str, tuple[float, bytes]]] = field(default_factory=dict)
    #: Directory path -> its last use (unix seconds).
    used: dict[str, float] = field(default_factory=dict)
    #: The change feed's records, oldest first (``memory.feed``); *feed_base*: how many were trimmed before.
    feed: list[bytes] = field(default_factory=list)
    feed_base: int = 0
    epoch: str | None = None
    #: The last ``fleet gc``'s summary (``summary``).
    summary: bytes | None = None

class MemoryServer:
    """The data of a fleet's memory stores, by namespace, and the tier's clock (see the module doc)."""

    def __init__(self) -> None:
        self.lock = threading.RLock()
        #: Seconds the tier's clock runs ahead of this process's (a test's skew).
        self.offset = 0.0
        self.spaces: dict[str, Space] = {}
        self.url = f"memory://{secrets.token_hex(4)}"

    def time(self) -> float:
        """The tier's clock, unix seconds."""
        return time.time() + self.offset

    def space(self, namespace: str) -> Space:
        with self.lock:
            return self.spaces.setdefault(namespace, Space())

    def lose_data(self) -> None:
        """Everything gone, as a server restarted empty (the epoch too: nodes upload again)."""
        with self.lock:
            self.spaces.clear()

class MemoryStore(RemoteStore):
    """One node's view of one namespace on a ``MemoryServer``; every method may raise RemoteError."""

    small_blob_bytes = SMALL_BLOB_BYTES

    def __init__(self, server: MemoryServer, namespace: str = "default", key: bytes | None = None, *,
                 counters: dict[str, int] | None = None) -> None:
        self.server = server
        self.namespace = namespace
        self.url = server.url
        self.counters = counters if counters is not None else new_counters()
        self.level = Level("memory", self.url, self.counters)
        self.clock = TierClock(self.server_time)
        self.codec = EntryCodec(namespace, key, self.counters, horizon=self.clock.horizon_us)
        self._failures: list[str] = []
        self.shelf = MemoryShelf(self)

    @property
    def space(self) -> Space:
        return self.server.space(self.namespace)

    # -- requests and failures ---------------------------------------------------
    def fail_next(self, n: int = 1, why: str = "connection refused") -> None:
        """The next *n* requests fail as an unreachable server's do (the level backs off after each)."""
        self._failures.extend([why] * n)

    def call(self, fn: Callable[[], T]) -> T:
        """One request: refused while the level backs off, failed when ``fail_next`` says so, else *fn* under
        the server's lock."""
        if not self.level.available():
            raise self.level.refuse()
        if self._failures:
            raise self.level.failed(self._failures.pop(0), log)
        with self.server.lock:
            result = fn()
        self.level.succeeded()
        self.level.moved()
        return result

    def levels(self) -> list[Level]:
        return [self.level]

    def ping(self) -> None:
        self.level.retry_now()
        self.call(lambda: None)

    def server_time(self) -> float:
        return self.call(self.server.time)

    def date_by(self, clock: TierClock) -> None:
        self.clock = clock
        self.codec.horizon = clock.horizon_us

    def epoch(self) -> tuple[str, bool]:
        def check() -> tuple[str, bool]:
            space = self.space
            if space.epoch is not None:
                return space.epoch, False
            space.epoch = secrets.token_hex(8)
            return space.epoch, True

        return self.call(check)

    # -- names -------------------------------------------------------------------
    def list_dirs(self, dir_paths: list[str]) -> dict[str, dict[bytes, RemoteEntry]]:
        raw = self.call(lambda: {d: dict(self.space.dirs.get(d, {})) for d in dir_paths})
        return {d: self.codec.entries(d, raw[d]) for d in dir_paths}

    def all_dirs(self) -> list[str]:
        return self.call(lambda: sorted(d for d, names in self.space.dirs.items() if names))

    def publish_entries(self, items: list[tuple[str, RemoteEntry]]) -> list[tuple[bool, RemoteEntry | None]]:
        """Per name, the newest (version, node) stays; a held entry that is not valid for us (forged,
        unsigned, broken, dated past the tier's time) is written over."""
        def publish() -> list[tuple[bool, RemoteEntry | None]]:
            out: list[tuple[bool, RemoteEntry | None]] = []
            for path, entry in items:
                dir_path, _, name = path.rpartition("/")
                names = self.space.dirs.setdefault(dir_path, {})
                key = name.encode(errors="surrogateescape")
                held = names.get(key)
                other = self.codec.decode(path, held) if held is not None else None
                if other is not None and other.newer_than(entry.version, entry.node):
                    out.append((False, other))
                    continue
                names[key] = self.codec.encode(path, entry)
                out.append((True, other))
            return out

        if not items:
            return []
        out = self.call(publish)
        self.counters["remote_uploaded_entries"] += sum(1 for written, _ in out if written)
        self.level.wrote()
        return out

    # -- blobs ---------------------------------------------------------------------
    def fetch_blob(self, hex_digest: str, size: int, out: BinaryIO) -> bytes | None:
        held = self.call(lambda: self.space.blobs.get(hex_digest))
        if held is None or len(held[0]) < size:
            return None  # absent, or cut short: a miss
        copy = HashedCopy(out, size, self.level)
        if not copy.take(held[0]):
            return b""  # more than its entry says: bad data, matching no digest
        self.counters["remote_fetched_bytes"] += size
        return copy.digest()

    def fetch_small_blobs(self, blobs: list[tuple[str, int]]) -> list[BlobBytes | None]:
        held = self.call(lambda: [self.space.blobs.get(h) for h, _ in blobs])
        return verified_small(blobs, [None if got is None else got[0] for got in held], self.level, self.counters)

    def missing_blobs(self, blobs: dict[str, int]) -> list[str]:
        """Absent, another size, or written longer ago than writers trust (gc's next: written again)."""
        def check() -> list[str]:
            now = self.clock.now()
            out = []
            for h, size in blobs.items():
                held = self.space.blobs.get(h)
                if held is None or len(held[0]) != size or not ages.younger(now - held[1], ages.BLOB_TRUST_SECONDS):
                    out.append(h)
            return out

        return self.call(check) if blobs else []

    def upload_blobs(self, files: list[tuple[str, str]]) -> set[str]:
        gone: set[str] = set()
        read: list[tuple[str, bytes]] = []
        for h, path in files:
            if not path:
                read.append((h, b""))
                continue
            try:
                with open(path, "rb") as f:
                    read.append((h, f.read()))
            except FileNotFoundError:
                gone.add(h)  # evicted before it could be uploaded: publish nothing for it
        now = self.clock.now()

        def put() -> None:
            for h, data in read:
                self.space.blobs[h] = (data, now)

        self.call(put)
        sent = sum(len(data) for _, data in read)
        self.counters["remote_uploaded_bytes"] += sent
        self.level.moved(up=sent, requests=0)
        self.level.wrote()
        return gone

    def note_blob_names(self, names: dict[str, str]) -> None:
        def note() -> None:
            for h, path in names.items():
                self.space.blob_names.setdefault(h, path)

        if names:
            self.call(note)

    def blob_names(self, hashes: list[str]) -> dict[str, str]:
        known = self.call(lambda: dict(self.space.blob_names))
        return {h: known[h] for h in hashes if h in known}

    def record_use(self, records: dict[str, float]) -> None:
        """A record never moves a directory's last use back."""
        def add() -> None:
            used = self.space.used
            for d, t in records.items():
                used[d] = max(used.get(d, t), t)

        if records:
            self.call(add)

    def tier_summary(self) -> dict[str, Any] | None:
        return parse_summary(self.call(lambda: self.space.summary))

    def close(self) -> None:
        return None

class MemoryShelf(Shelf):
    """A memory store's records (``records.Shelf``): each shelf a dict of id -> (score, bytes)."""

    def __init__(self, store: MemoryStore) -> None:
        self.store = store

    def run(self, fn: Callable[[], T]) -> T:
        return self.store.call(fn)

    def _held(self, shelf: str) -> dict[str, tuple[float, bytes]]:
        return self.store.space.shelves.setdefault(shelf, {})

    def put(self, shelf: str, record_id: str, score: float, data: bytes) -> None:
        self._held(shelf)[record_id] = (score, data)
        self.store.level.moved(up=len(data), requests=0)

    def newest(self, shelf: str, n: int | None = None) -> list[tuple[str, float]]:
        held = sorted(((r, s) for r, (s, _) in self._held(shelf).items()), key=lambda rs: (-rs[1], rs[0]))
        return held if n is None else held[:n]

    def get(self, shelf: str, ids: list[str], limit: int) -> dict[str, bytes | None]:
        held = self._held(shelf)
        return {r: (held[r][1] if len(held[r][1]) <= limit else None) for r in ids if r in held}

    def delete(self, shelf: str, ids: list[str]) -> None:
        held = self._held(shelf)
        for r in ids:
            held.pop(r, None)
