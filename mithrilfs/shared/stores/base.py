"""The one interface every shared store speaks: Redis, an S3 bucket, or Redis in front of a bucket.

``RemoteTier`` (the glue between the local namespace and the fleet) asks a
``RemoteStore`` for directories of entries and for blobs, and never knows
which store it is: ``stores.redis.store.RedisStore``,
``stores.s3.store.S3Store`` or ``stores.layered.store.LayeredStore`` (two
of them, read front first, written to both), built in one place
(``connect.open_remote``), like sccache's one ``Storage`` trait with its
backends and multi-level storage behind it.

Every method is blocking network I/O with short timeouts; the tier runs them
in worker threads.  Every method may raise ``RemoteError`` naming the cause
in one line (never a secret).  A store stays away for a growing back-off
after a failure (``Level``), so a dead server costs one timeout, not one per
request.
"""

from __future__ import annotations

import logging
import threading
import time
from abc import ABC, abstractmethod
from typing import Any, BinaryIO

from mithrilfs.shared.stores.clock import TierClock
from mithrilfs.shared.stores.entries import BlobBytes, EntryCodec, RemoteEntry, RemoteError
from mithrilfs.shared.stores.placement import NULL_PLACEMENT, Placement
from mithrilfs.shared.stores.records import (
    NULL_SHELF,
    Record,
    Shelf,
    keep_purge,
    kept_purges,
    read_records,
    write_record,
)

log = logging.getLogger(__name__)

_MAX_BACKOFF = 30.0
#: Seconds a request of the mount waits on the tier without a byte arriving (design.md, "Requests"; the
#: bound is ``sync.bounded``'s, a bucket's patience with a throttled request is the same).
REMOTE_WAIT = 2.0
#: A level asked to slow down says so in the log at most this often (``Level.slowed``).
SLOWED_LOG_SECONDS = 60.0

#: The counters every store adds to (one dict per mount, shared by the levels of a layered store).
COUNTERS = ("remote_hits", "remote_misses", "remote_fetched_bytes", "remote_uploaded_bytes",
            "remote_uploaded_entries", "remote_tombstones", "remote_verify_failures", "remote_rejected",
            "remote_errors", "remote_conflicts", "remote_adopted", "remote_data_lost", "remote_bad_blobs_reported",
            "remote_blobs_repaired")


def new_counters() -> dict[str, int]:
    return dict.fromkeys(COUNTERS, 0)


class Level:
    """One server's reachability and traffic: its back-off after failures, and what ``stats`` shows of it.

    *kind* names it in stats ("redis", "s3"); *url* is already redacted.
    """

    def __init__(self, kind: str, url: str, counters: dict[str, int]) -> None:
        self.kind = kind
        self.url = url
        self.counters = counters
        self._lock = threading.Lock()
        self._backoff = 0.0
        self._down_until = 0.0
        #: The last error, in one line ("" once a request succeeds again).
        self.last_error = ""
        self.requests = 0
        self.errors = 0
        self.bytes_in = 0
        self.bytes_out = 0
        #: When a request last succeeded (``stalled`` spares a level that answered meanwhile).
        self.last_ok = 0.0
        #: Why the server refuses writes while it serves reads (Redis at ``maxmemory``); "" once a write
        #: succeeds again (``wrote``).
        self.refused = ""
        #: Answers asking for fewer requests (a bucket's 503 SlowDown), each request sent again after a pause.
        self.slowdowns = 0
        self._slowed_logged = -SLOWED_LOG_SECONDS
        self._slowed_since_log = 0

    def available(self) -> bool:
        return time.monotonic() >= self._down_until

    def retry_now(self) -> None:
        """Forget the back-off (an explicit ``ping``: the user asks now)."""
        self._down_until = 0.0

    def refuse(self) -> RemoteError:
        return RemoteError(f"{self.url} unavailable ({self.last_error}); backing off")

    def failed(self, why: str, log: Any, *, back_off: bool = True) -> RemoteError:
        """Count a failure, back off, and return the error to raise.

        *back_off* False: the server answered, refusing only this kind of
        request (Redis at ``maxmemory`` refuses writes and still serves
        reads): the error shows and counts, and other requests go on.
        """
        with self._lock:
            self.counters["remote_errors"] += 1
            self.errors += 1
            if back_off:
                self._backoff = min(_MAX_BACKOFF, max(0.5, self._backoff * 2))
                self._down_until = time.monotonic() + self._backoff
                self.last_error = why
            else:
                self.refused = why
        if back_off:
            log.warning("remote tier %s: %s (retrying in %.1f s)", self.url, why, self._backoff)
        else:
            log.warning("remote tier %s: %s", self.url, why)
        return RemoteError(why)

    def slowed(self, log: Any) -> None:
        """The server answered that it wants fewer requests (S3's ``503 SlowDown`` under a burst): the request
        is sent again after a pause (``stores.s3.conn.S3Connection.patiently``).  No failure, no back-off; counted
        (``slowdowns``), and logged in one line a minute at most, however many requests it slows."""
        now = time.monotonic()
        with self._lock:
            self.slowdowns += 1
            self._slowed_since_log += 1
            if now - self._slowed_logged < SLOWED_LOG_SECONDS:
                return
            self._slowed_logged, n, self._slowed_since_log = now, self._slowed_since_log, 0
        log.warning("remote tier %s asks for fewer requests (503 SlowDown): each is sent again after a pause"
                    " (%d such answers since this was last said, %d in all)", self.url, n, self.slowdowns)

    def succeeded(self) -> None:
        with self._lock:
            self._backoff = 0.0
            self.last_error = ""
            self.last_ok = time.monotonic()

    def wrote(self) -> None:
        """A write succeeded: the server takes writes again."""
        self.refused = ""

    def moved(self, *, down: int = 0, up: int = 0, requests: int = 1) -> None:
        with self._lock:
            self.requests += requests
            self.bytes_in += down
            self.bytes_out += up

    def state(self) -> dict[str, Any]:
        return {"kind": self.kind, "url": self.url, "reachable": not self.last_error,
                "last_error": self.last_error or self.refused, "refuses_writes": bool(self.refused),
                "requests": self.requests, "errors": self.errors, "slowdowns": self.slowdowns,
                "bytes_in": self.bytes_in, "bytes_out": self.bytes_out}


class RemoteStore(ABC):
    """Names (entries by directory) and blobs (content by blake3) shared by a fleet (see the module doc).

    A backend implements the abstract methods; the rest have defaults.  Two
    facets have null defaults: ``placement`` (where blobs are held with
    others: ``NullPlacement`` for a store that finds blobs by hash) and
    ``shelf`` (where startup sets and purges are kept: ``NullShelf`` keeps
    none); the records' meaning is written once above the shelf
    (``stores.records``).
    """

    #: Shown in logs, errors and stats: never carries a secret.
    url: str
    namespace: str
    #: The mount's remote counters (shared with the tier).
    counters: dict[str, int]
    #: Blobs up to this size are fetched in batches by the prefetcher (``fetch_small_blobs``).
    small_blob_bytes: int
    #: Whether the uploader sends a directory's names together (``write_behind``): a bucket packs the
    #: blobs of one batch together, so a directory sent whole is one range for its readers.
    packs_by_directory: bool = False
    #: A node sends its use records at most this often (``record_use``: a bucket pays a PUT each time).
    use_flush_seconds: float = 0.0
    #: The store's time as this node sees it: what versions, use records and ages are dated by (``stores.clock``).
    clock: TierClock
    #: Encodes and checks entries as the store holds them (startup records carry them the same way).
    codec: EntryCodec
    #: Where the store holds blobs with others (``stores.placement``).
    placement: Placement = NULL_PLACEMENT
    #: Where the store keeps startup sets and purges (``stores.records.Shelf``).
    shelf: Shelf = NULL_SHELF

    def date_by(self, clock: TierClock) -> None:
        """Date and judge by *clock* instead of this store's own (a layered store's levels share its front's)."""
        self.clock = clock

    @property
    def last_error(self) -> str:
        return next((lv.last_error or lv.refused for lv in self.levels() if lv.last_error or lv.refused), "")

    def available(self) -> bool:
        return any(lv.available() for lv in self.levels())

    def received(self) -> int:
        """Bytes received so far from every level, and answers asking for fewer requests (a bucket's SlowDown:
        it answers): what the bound on a wait watches (``bounded``)."""
        return sum(lv.bytes_in + lv.slowdowns for lv in self.levels())

    def stalled(self, why: str, *, since: float) -> None:
        """A request of the mount waited the bound for nothing: the levels that have not answered anything
        since *since* back off, so the next requests answer at once instead of waiting again."""
        for lv in self.levels():
            if lv.last_ok < since and lv.available():
                lv.failed(why, log)

    # -- what a backend implements ---------------------------------------------------
    @abstractmethod
    def levels(self) -> list[Level]:
        """The servers behind this store, front first."""

    @abstractmethod
    def ping(self) -> None:
        """Raise RemoteError naming the cause unless the store answers now (ignores the back-off)."""

    @abstractmethod
    def server_time(self) -> float:
        """The store's clock now, unix seconds (a request: in a thread), for ``clock`` to measure against."""

    @abstractmethod
    def epoch(self) -> tuple[str, bool]:
        """(a token that changes when the store lost its data, True when it was just made)."""

    @abstractmethod
    def list_dirs(self, dir_paths: list[str]) -> dict[str, dict[bytes, RemoteEntry]]:
        """Every valid entry (tombstones included) of many directories, by name, in as few requests as the
        store allows."""

    @abstractmethod
    def all_dirs(self) -> list[str]:
        """The path of every directory the namespace has entries in."""

    def dirs_under(self, paths: list[str]) -> set[str]:
        """The directories at or under *paths* that the namespace has entries in (``forget --fleet``): by
        default ``all_dirs`` filtered; a store that can list below a path lists only there."""
        return {d for d in self.all_dirs() if any(d == p or d.startswith(p + "/") for p in paths)}

    @abstractmethod
    def publish_entries(self, items: list[tuple[str, RemoteEntry]]) -> list[tuple[bool, RemoteEntry | None]]:
        """Write entries where they are newer than what the store holds.

        For each: (written, the other entry) -- the one replaced when ours
        was written, the newer one that stayed when not.  A newer entry that
        is not valid for us (forged, unsigned, broken) does not get to stay.
        """

    @abstractmethod
    def fetch_blob(self, hex_digest: str, size: int, out: BinaryIO) -> bytes | None:
        """Stream a blob of *size* bytes into *out*; its blake3, None when the store lacks it.

        Memory never depends on the claimed size; more bytes than *size* is
        bad data (``b""``, which matches no digest).  The caller compares
        (``stores.stream``).
        """

    @abstractmethod
    def fetch_small_blobs(self, blobs: list[tuple[str, int]]) -> list[BlobBytes | None]:
        """Small blobs (hex, size) in one batch, each verified (size and blake3); None where missing or bad.

        The store verifies, once: a bucket's pack reader has to anyway (a
        piece that fails is fetched from the blob's own object and the pack
        reported), and a second pass in the caller would cost a blake3 of
        every prefetched byte.  A bad blob is counted
        (``remote_verify_failures``) and logged where it is found."""

    @abstractmethod
    def missing_blobs(self, blobs: dict[str, int]) -> list[str]:
        """Which of these blobs (hex -> size) the store lacks in full."""

    @abstractmethod
    def upload_blobs(self, files: list[tuple[str, str]]) -> set[str]:
        """Upload blobs (hex, file path; "" for empty content); the hashes whose files were gone."""

    # -- written once above the backends' primitives -------------------------------------
    def list_dir(self, dir_path: str) -> dict[bytes, RemoteEntry]:
        """Every valid entry of a directory (tombstones included), by name."""
        return self.list_dirs([dir_path])[dir_path]

    def write_startup_record(self, name: str, record_id: str, items: list[tuple[str, RemoteEntry]], *,
                             last: bool = False) -> None:
        """Write (over) this mount's record of startup set *name* (``stores.records``), with the places of its
        blobs where the store keeps them (``Placement.for_record``); *last*: its final write, which also drops
        the set's records past the ``RECORDS_KEPT`` newest."""
        self.shelf.run(lambda: write_record(self.shelf, self.codec, name, record_id,
                                            self.placement.for_record(items), last=last))

    def startup_records(self, name: str, skip: frozenset[str] = frozenset()) -> list[Record]:
        """The ``RECORDS_READ`` newest records of a startup set, checked (a bounded number of requests); the
        places their entries carry are learned.  *skip*: ids the caller holds already, not read again."""
        def read() -> list[Record]:
            got = read_records(self.shelf, self.codec, name, skip)
            for r in got:  # where their blobs are, where the recording node knew (else their manifests say)
                self.placement.learn(entry for _, entry in r.items if entry.pack is not None)
            return got

        return self.shelf.run(read)

    def keep_purge(self, version: int, raw: bytes) -> None:
        """Keep a ``forget --fleet``'s record (the change feed's, *raw*) beside the startup sets, the
        ``PURGES_KEPT`` newest: a new node never read the feed, and must not bring a purged name back from a
        set recorded before the purge (``StartupOrder``)."""
        self.shelf.run(lambda: keep_purge(self.shelf, version, raw))

    def kept_purges(self) -> tuple[list[bytes], int]:
        """The ``PURGES_READ`` newest purge records (unchecked), and the version of the newest one left unread
        (0: none), below which a set's entry cannot be checked (``stores.records.kept_purges``)."""
        return self.shelf.run(lambda: kept_purges(self.shelf))

    # -- optional, with null defaults ----------------------------------------------------
    def note_blob_names(self, names: dict[str, str]) -> None:
        """Remember the path each of these blobs (hex -> path) was first published under, where a store can
        keep that cheaply (``blob_names``); by default nowhere."""
        return None

    def blob_names(self, hashes: list[str]) -> dict[str, str]:
        """The paths ``note_blob_names`` kept for these blobs (``mithrilfs why`` across nodes); by default none."""
        return {}

    def record_use(self, records: dict[str, float]) -> None:
        """Tell the store when these directories were last used (``fleet.usage``: what ``fleet gc`` keeps);
        by default nowhere."""
        return None

    def sweeping(self) -> bool:
        """Whether a ``fleet gc`` is deleting blobs now and a writer must not publish names on blobs it
        checked (a store that deletes blobs atomically against writers, like Redis, never says so)."""
        return False

    def tier_summary(self) -> dict[str, Any] | None:
        """What the last ``fleet gc`` found and did (its sizes and counts: the tier's size where known
        cheaply), None when no gc ran or the store keeps none."""
        return None

    def close(self) -> None:
        """Release connections (the process may go on); by default nothing to release."""
        return None
