"""Redis in front of a bucket: one store to the tier, read front first, written to both.

The bucket (the back) holds everything, durably; Redis (the front) answers
in a fraction of the time and holds the names plus the hot set of blobs.
Like sccache's multi-level storage:

- names: a directory Redis marked *complete* is answered by Redis alone;
  any other (new, evicted, or Redis restarted empty) is read from the
  bucket, merged newest-wins with what Redis has, written back into Redis
  and marked complete.  Writers write both, so a complete directory stays
  complete.  A write the bucket refuses raises (the tier's queue sends it
  again); one only Redis missed does not, but the directories it touched
  lose their mark as soon as Redis answers again, so they are read from the
  bucket once more.  A mark is trusted for ``COMPLETE_SECONDS`` (10 min):
  whatever slipped past it (a node that died before it could clear a mark,
  a reader that marked a directory while a writer's Redis write failed,
  Redis restarted from an old snapshot) is seen within that time;
- blobs: read from Redis, else from the bucket (verified, then written back
  into Redis when small); uploads go to the bucket, and small ones to Redis
  too, where they live ``HOT_TTL`` after their last use;
- the epoch is the bucket's: an emptied bucket makes every node upload
  again; Redis restarted empty refills from the bucket as it is read.

Either level alone keeps the mount served: reads fall through a dead front
to the back, and a dead back leaves what the front has.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from typing import Any, BinaryIO

from mithrilfs.shared.stores.base import Level, RemoteStore
from mithrilfs.shared.stores.clock import TierClock
from mithrilfs.shared.stores.entries import BlobBytes, RemoteEntry, RemoteError, newest
from mithrilfs.shared.stores.records import Record
from mithrilfs.shared.stores.redis.store import RedisStore
from mithrilfs.store.cas import hash_bytes

log = logging.getLogger(__name__)

#: Seconds a blob stays in Redis after its last write or read.
HOT_TTL = 24 * 3600
#: Blobs up to this size are kept in Redis too (larger ones come from the bucket only).
HOT_BLOB_BYTES = 8 << 20


class LayeredStore(RemoteStore):
    """*front* (Redis) in front of *back* (a bucket); see the module doc."""

    def __init__(self, front: RedisStore, back: RemoteStore) -> None:
        self.front = front
        self.back = back
        self.url = f"{front.url} + {back.url}"
        self.namespace = back.namespace
        self.counters = back.counters
        self.small_blob_bytes = min(HOT_BLOB_BYTES, back.small_blob_bytes)
        self.packs_by_directory = back.packs_by_directory
        self.use_flush_seconds = back.use_flush_seconds
        #: The bucket's: Redis's names say where the bucket holds each blob too.
        self.placement = back.placement
        #: Directories whose writes Redis missed (it was away): read from the bucket until it has them.
        self._front_missed: set[str] = set()
        #: Both levels date by one clock: Redis's (``TIME``: one request), the bucket's while Redis is away.
        self.clock = TierClock(self.server_time)
        front.date_by(self.clock)
        back.date_by(self.clock)

    def levels(self) -> list[Level]:
        return self.front.levels() + self.back.levels()

    def _to_front(self, call: Callable[[], Any], dirs: frozenset[str] | set[str] = frozenset()) -> None:
        """A write to Redis that may fail: the directories it touched are then not complete there."""
        try:
            self._mend_front()
            call()
        except RemoteError as e:
            self._front_missed |= dirs
            log.debug("%s missed a write: %s", self.front.url, e)

    def _mend_front(self) -> None:
        """Directories written while Redis was away lose their complete mark once it answers."""
        if self._front_missed and self.front.level.available():
            missed = set(self._front_missed)
            self.front.unmark_complete(sorted(missed))
            self._front_missed -= missed

    def ping(self) -> None:
        """Fine when either level answers; the error names both when neither does."""
        errors = []
        for level in (self.front, self.back):
            try:
                level.ping()
                return
            except RemoteError as e:
                errors.append(f"{level.url}: {e}")
        raise RemoteError("; ".join(errors))

    def server_time(self) -> float:
        """Redis's clock; the bucket's when Redis does not answer (writes go on to the bucket then)."""
        try:
            return self.front.server_time()
        except RemoteError:
            return self.back.server_time()

    def epoch(self) -> tuple[str, bool]:
        """The bucket's; asked every few seconds by the uploader, which also mends Redis's marks here: a
        node whose Redis write failed and that has nothing more to write would otherwise leave a directory
        marked complete without its names for ``COMPLETE_SECONDS`` (a new node would not find them)."""
        try:
            self._mend_front()
        except RemoteError as e:
            log.debug("%s: marks not mended yet: %s", self.front.url, e)
        return self.back.epoch()

    # -- names --------------------------------------------------------------
    def list_dirs(self, dir_paths: list[str]) -> dict[str, dict[bytes, RemoteEntry]]:
        out = self._list_dirs(dir_paths)
        for entries in out.values():  # names Redis answered: the bucket learns where their blobs are
            self.placement.learn(entries.values())
        return out

    def _list_dirs(self, dir_paths: list[str]) -> dict[str, dict[bytes, RemoteEntry]]:
        front: dict[str, tuple[dict[bytes, RemoteEntry], bool]] = {}
        try:
            self._mend_front()
            front = self.front.list_dirs_complete(dir_paths)
        except RemoteError:
            front = {}
        todo = [d for d in dir_paths if not front.get(d, ({}, False))[1]]
        out = {d: front[d][0] for d in dir_paths if d not in todo}
        if not todo:
            return out
        try:
            back = self.back.list_dirs(todo)
        except RemoteError:
            if not front:
                raise
            return out | {d: front[d][0] for d in todo}
        fill: list[tuple[str, RemoteEntry]] = []
        for d in todo:
            held = front.get(d, ({}, False))[0]
            merged = dict(held)
            for name, entry in back[d].items():
                best = newest(held.get(name), entry)
                assert best is not None
                if best is not entry and best.pack is None and entry.pack is not None and best.hash == entry.hash:
                    best = entry  # the same version: the bucket's names where its blob is (a pack)
                merged[name] = best
                if best is entry and held.get(name) != entry:
                    fill.append((f"{d}/{name.decode(errors='surrogateescape')}" if d else
                                 name.decode(errors="surrogateescape"), entry))
            out[d] = merged
        if front:
            try:
                self.front.publish_entries(fill)
                self.front.mark_complete(todo)
            except RemoteError as e:
                log.debug("names not copied into %s: %s", self.front.url, e)
        return out

    def all_dirs(self) -> list[str]:
        try:
            dirs = set(self.back.all_dirs())
        except RemoteError:
            return self.front.all_dirs()
        try:
            dirs.update(self.front.all_dirs())
        except RemoteError:
            pass
        return sorted(dirs)

    def dirs_under(self, paths: list[str]) -> set[str]:
        found = self.back.dirs_under(paths)
        try:
            found |= self.front.dirs_under(paths)
        except RemoteError:
            pass
        return found

    def publish_entries(self, items: list[tuple[str, RemoteEntry]]) -> list[tuple[bool, RemoteEntry | None]]:
        items = self.placement.locate_for_publish(items)  # Redis's names say where the bucket holds each blob too
        results = self.back.publish_entries(items)
        self._to_front(lambda: self.front.publish_entries(items), {path.rpartition("/")[0] for path, _ in items})
        return results

    # -- blobs ---------------------------------------------------------------
    def fetch_blob(self, hex_digest: str, size: int, out: BinaryIO) -> bytes | None:
        try:
            got = self.front.fetch_blob(hex_digest, size, out)
        except RemoteError:
            got = None
        if got is not None and got.hex() == hex_digest:
            return got
        out.seek(0)
        out.truncate()
        if size > HOT_BLOB_BYTES:
            return self.back.fetch_blob(hex_digest, size, out)
        data = self.back.fetch_small_blobs([(hex_digest, size)])[0]
        if data is None:
            return None
        digest = hash_bytes(data)
        out.write(data)
        if digest.hex() == hex_digest:
            self._fill_front([(hex_digest, data)])
        return digest

    def fetch_small_blobs(self, blobs: list[tuple[str, int]]) -> list[BlobBytes | None]:
        try:
            out = self.front.fetch_small_blobs(blobs)
        except RemoteError:
            out = [None] * len(blobs)
        missing = [i for i, data in enumerate(out) if data is None]
        if missing:
            found = self.back.fetch_small_blobs([blobs[i] for i in missing])
            fill = []
            for i, data in zip(missing, found):
                out[i] = data
                if data is not None:  # verified by the bucket's reader
                    fill.append((blobs[i][0], data))
            self._fill_front(fill)
        return out

    def _fill_front(self, blobs: list[tuple[str, BlobBytes]]) -> None:
        """Verified blobs read from the back go into the hot set."""
        try:
            self.front.put_blobs(blobs)
        except RemoteError as e:
            log.debug("blobs not copied into %s: %s", self.front.url, e)

    def missing_blobs(self, blobs: dict[str, int]) -> list[str]:
        """What the bucket lacks (Redis is a cache: ``upload_blobs`` asks it for itself)."""
        return self.back.missing_blobs(blobs)

    def upload_blobs(self, files: list[tuple[str, str]]) -> set[str]:
        """To the bucket; and the small ones to Redis too, where it lacks them."""
        gone = self.back.upload_blobs(files)
        sizes = {h: _size(path) for h, path in files if h not in gone}
        hot = {h: size for h, size in sizes.items() if size is not None and size <= HOT_BLOB_BYTES}

        def to_front() -> None:
            lacking = set(self.front.missing_blobs(hot))
            gone.update(self.front.upload_blobs([(h, p) for h, p in files if h in lacking]))

        self._to_front(to_front)
        return gone

    # -- startup sets ----------------------------------------------------------
    def write_startup_record(self, name: str, record_id: str, items: list[tuple[str, RemoteEntry]], *,
                             last: bool = False) -> None:
        items = self.placement.with_locations(items)  # both levels' records say where the bucket holds each blob
        self.back.write_startup_record(name, record_id, items, last=last)
        self._to_front(lambda: self.front.write_startup_record(name, record_id, items, last=last))

    def keep_purge(self, version: int, raw: bytes) -> None:
        self.back.keep_purge(version, raw)
        self._to_front(lambda: self.front.keep_purge(version, raw))

    def kept_purges(self) -> tuple[list[bytes], int]:
        """The bucket's (Redis's when the bucket does not answer: it keeps the same records)."""
        try:
            return self.back.kept_purges()
        except RemoteError:
            return self.front.kept_purges()

    def startup_records(self, name: str, skip: frozenset[str] = frozenset()) -> list[Record]:
        """Both levels' newest records; Redis's only those the bucket did not give (both usually hold the
        same ones, and decoding a large record twice would double a new node's set load)."""
        try:
            records = self.back.startup_records(name, skip)
        except RemoteError:
            return self.front.startup_records(name, skip)
        try:
            front = self.front.startup_records(name, skip | {r.id for r in records})
        except RemoteError:
            front = []
        for r in front:  # Redis's records say where the bucket holds their blobs too
            self.placement.learn(e for _, e in r.items if e.pack is not None)
        return records + front

    def note_blob_names(self, names: dict[str, str]) -> None:
        self._to_front(lambda: self.front.note_blob_names(names))

    def blob_names(self, hashes: list[str]) -> dict[str, str]:
        try:
            return self.front.blob_names(hashes)
        except RemoteError:
            return {}

    def record_use(self, records: dict[str, float]) -> None:
        """Into the bucket, which ``fleet gc`` collects (Redis's blobs expire on their own)."""
        self.back.record_use(records)

    def tier_summary(self) -> dict[str, Any] | None:
        return self.back.tier_summary()

    def sweeping(self) -> bool:
        return self.back.sweeping()

    def close(self) -> None:
        self.front.close()
        self.back.close()


def _size(path: str) -> int | None:
    """A blob file's size (0 for empty content, ""), None once it is gone (evicted meanwhile)."""
    import os

    if not path:
        return 0
    try:
        return os.stat(path).st_size
    except FileNotFoundError:
        return None
