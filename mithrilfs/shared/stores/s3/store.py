"""The shared tier in an S3-compatible bucket (AWS S3, SeaweedFS, MinIO, Ceph RGW, R2, GCS's XML API).

Layout under ``s3://BUCKET/PREFIX/NAMESPACE/``
  ``names/~C1/~C2/#``   one manifest per directory (components percent-quoted,
                        each after a ``~``, so no directory's manifest is another's
                        directory): JSON ``{"mithrilfs": 1, "entries": {name: entry}}``,
                        each entry the same signed JSON as in Redis (``entries``)
  ``packs/HH/ID``       small blobs (up to 1 MiB), many to an object of up to
                        32 MiB, written once; each file's entry names its blob's
                        pack and offset (``stores.s3.packs``)
  ``blobs/HH/HEX``      a larger blob (or one repaired), one immutable object per
                        blake3 hash, written only if absent (``If-None-Match: *``);
                        a large one (a conditional put is one request, buffered
                        whole by the client) goes in 8 MiB parts once a HEAD found
                        it absent
  ``startup/~NAME/ID``  a startup set: one record per mount that recorded one, written
                        over by that mount at most once a minute (``stores.records``)
  ``changes/``, ``purges/``  the change feed's journal and the purges kept
                        (``stores.feed``, ``stores.s3.records``); ``feed``, the
                        journal's head, rewritten with each record: followers ask
                        for it ``If-None-Match`` and list only when it changed
  ``usage/T-R``         use records, one per node flush (``fleet gc`` merges them)
  ``bad/HEX``           a blob a reader found corrupt (``stores.s3.repair``)
  ``gc-sweeps/T-R``     a running ``fleet gc``'s sweep marker, one per run (``stores.s3.gc``)
  ``epoch``             a random token: gone means the bucket was emptied, and
                        every node uploads what it has again; ``gc``, the last
                        ``fleet gc``'s summary; ``gc-state``, the manifests it
                        read (``stores.s3.gc_state``)

These names are reserved (``stores.s3.layout``): gc and the prunings take only the
keys below them that parse as their own records, and a namespace inside
another fleet's reserved directories is refused.

Names converge by compare-and-swap: a writer reads a directory's manifest
and its ETag, merges its entries in (per name the newest (version, node)
stays: a maximum, so the order writers merge in does not matter), and puts
it back ``If-Match`` that ETag (``If-None-Match: *`` for a new one).  A 412
means another writer got there first: read again, merge again.  Every
successful put is a merge of the previous state, so no writer's entry is
ever lost, and every reader sees one manifest, so a directory's names come
in one request.  A writer merges into the manifest as it last read or
wrote it and puts at once (``stores.s3.seen``): a 412 makes it read first.
Small blobs travel in packs that the entries locate (``stores.s3.packs``), the
blob requests are ``stores.s3.blobs``'s.  Startup sets are one record per mount,
the newest few read and merged in memory, never rewritten by a reader.

Everything read from the bucket is hostile: a manifest larger than
``MAX_MANIFEST_BYTES`` or not JSON is ignored (and replaced by the next
writer), entries are validated and verified like Redis's, blobs are
streamed, never allocated by a claimed size, and must come to exactly the
entry's size and hash.  Credentials and region come from the AWS
conventions (``stores.s3.settings``); errors name the cause in one line and never
carry a secret.  The client is obstore (Rust's object_store): compared in
docs/design.md against boto3 and opendal.
"""

from __future__ import annotations

import json
import logging
import random
import secrets
import time
from dataclasses import replace
from typing import Any, BinaryIO
from urllib.parse import unquote_to_bytes

from mithrilfs.shared.stores import ages
from mithrilfs.shared.stores.base import RemoteStore
from mithrilfs.shared.stores.clock import TierClock
from mithrilfs.shared.stores.entries import MAX_DIR_NAMES, BlobBytes, EntryCodec, RemoteEntry, RemoteError
from mithrilfs.shared.stores.s3.blobs import S3Blobs, object_age
from mithrilfs.shared.stores.s3.conn import S3Connection, obstore_api
from mithrilfs.shared.stores.s3.layout import SWEEPS, USAGE, is_record_key, record_key
from mithrilfs.shared.stores.s3.packs import Packs
from mithrilfs.shared.stores.s3.placement import PackPlacement
from mithrilfs.shared.stores.s3.records import S3Shelf, quoted
from mithrilfs.shared.stores.s3.repair import BadBlobReports
from mithrilfs.shared.stores.s3.seen import SeenManifests
from mithrilfs.shared.stores.s3.settings import S3Location, S3Settings
from mithrilfs.shared.stores.summary import MAX_SUMMARY_BYTES, parse_summary
from mithrilfs.store.namespace import valid_name

log = logging.getLogger(__name__)

#: A manifest larger than this is refused as hostile, never read (``MAX_DIR_NAMES`` signed entries fit in it).
MAX_MANIFEST_BYTES = 32 << 20
#: Blobs up to this size are fetched by the prefetcher in concurrent batches.
SMALL_BLOB_BYTES = 8 << 20
#: Attempts of one manifest update before the tier gives up for now (the queue retries later).
CAS_ATTEMPTS = 25


def unquote_component(part: str) -> str:
    return unquote_to_bytes(part[1:]).decode(errors="surrogateescape")


class S3Store(S3Connection, RemoteStore):
    """One namespace in one bucket (see the module doc); every method may raise RemoteError.

    The connection (clients, errors, basic requests) is its base
    (``stores.s3.conn``); blobs, packs, reports, manifests as last seen, its
    placement (``stores.s3.placement``) and its shelf of records
    (``stores.s3.records``) are parts of their own; the names (manifests and
    their compare-and-swap), the epoch and the use records are here.
    """

    small_blob_bytes = SMALL_BLOB_BYTES
    packs_by_directory = True
    use_flush_seconds = ages.USE_FLUSH_SECONDS

    def __init__(self, location: S3Location, namespace: str, key: bytes | None, settings: S3Settings, *,
                 counters: dict[str, int] | None = None) -> None:
        super().__init__(location, namespace, settings, counters=counters)
        self.codec = EntryCodec(namespace, key, self.counters, horizon=self.clock.horizon_us)
        self.reports = BadBlobReports(self)
        self.packs = Packs(self)
        self.blobs = S3Blobs(self, self.packs, self.reports)
        #: Each manifest as last read or written: a publish merges into it without reading (``stores.s3.seen``).
        self.seen = SeenManifests()
        self.placement = PackPlacement(self.packs, self.seen, now=lambda: self.clock.now(),
                                       read_places=self.read_places, call=self.call)
        self.shelf = S3Shelf(self)
        #: The epoch token last seen: another one means the bucket was emptied (its packs are gone).
        self._epoch_seen: str | None = None
    def date_by(self, clock: TierClock) -> None:
        self.clock = clock
        self.codec.horizon = clock.horizon_us

    # -- availability and epoch -------------------------------------------------
    def ping(self) -> None:
        """The bucket answers a listing with these credentials (a missing bucket or bad key names itself).

        A user asks now (``push``, ``prefetch``): the next upload batch lists the bad-blob reports again."""
        self.level.retry_now()
        self.reports.refresh()

        def probe() -> None:
            stream = obstore_api().list(self.quick, prefix=self.base + "epoch", chunk_size=1)
            next(iter(stream), None)
            self.level.moved()

        self.call(probe)

    def epoch(self) -> tuple[str, bool]:
        token, made = self.call(self._check_epoch)
        if made or (self._epoch_seen is not None and token != self._epoch_seen):
            self.packs.forget_all()  # emptied: no pack this node knew of is there any more, no manifest
            self.seen.forget_all()
        self._epoch_seen = token
        return token, made

    def _check_epoch(self) -> tuple[str, bool]:
        for _ in range(3):
            got = self.get_object(self.names, "epoch", 64)
            if got is not None and got[0] is not None and got[0].isascii() and got[0].isalnum():
                return got[0].decode(), False
            # none: the bucket was emptied; not a token: planted or broken, replaced (nodes upload again)
            token = secrets.token_hex(8)
            mode: Any = "create" if got is None else ({"e_tag": got[1]} if got[1] else "overwrite")
            if self.put_object(self.names, "epoch", token.encode(), mode, len(token)):
                return token, True
        raise RemoteError("the epoch object keeps changing")

    # -- names ------------------------------------------------------------------
    def _manifest_key(self, dir_path: str) -> str:
        parts = dir_path.split("/") if dir_path else []
        return "names/" + "".join(f"~{quoted(p)}/" for p in parts) + "#"

    def read_manifest(self, dir_path: str) -> tuple[dict[bytes, bytes], str | None]:
        """(name -> raw entry, the manifest's ETag; None when it does not exist).

        A manifest too large or not a manifest reads empty (counted), and
        its ETag still guards the next writer's put; so does every entry
        this node cannot read (it is dropped, and counted).
        """
        raw, etag, _ = self.read_manifest_data(dir_path)
        return raw, etag

    def read_manifest_data(self, dir_path: str) -> tuple[dict[bytes, bytes], str | None, bytes | None]:
        """``read_manifest``, and the manifest's bytes as stored (None when absent or too large)."""
        got = self.get_object(self.names, self._manifest_key(dir_path), MAX_MANIFEST_BYTES)
        if got is None:
            self.seen.saw(dir_path, {}, None)
            return {}, None, None
        data, etag = got
        if etag is None:
            raise RemoteError(f"{self.url} gives objects no ETag: names cannot be merged safely")
        raw = self.decode_manifest(dir_path, data)
        self.seen.saw(dir_path, raw, etag)  # the next publish to it merges into this without reading
        return raw, etag, data

    def decode_manifest(self, dir_path: str, data: bytes | None) -> dict[bytes, bytes]:
        """A manifest's entries from its bytes (None: too large); what is not a manifest reads empty, and
        every entry that is no name is dropped (both counted)."""
        if data is None:
            self.count("remote_rejected")
            log.warning("manifest of %r ignored: larger than %d bytes", dir_path, MAX_MANIFEST_BYTES)
            return {}
        try:
            doc = json.loads(data)
            entries = doc["entries"]
            if not isinstance(entries, dict):
                raise ValueError("entries are not an object")
            if len(entries) > MAX_DIR_NAMES:
                raise ValueError(f"{len(entries)} names, more than {MAX_DIR_NAMES}")
        except (ValueError, KeyError, TypeError, RecursionError) as e:
            self.count("remote_rejected")
            log.warning("manifest of %r ignored: not a manifest (%s)", dir_path, e)
            return {}
        out: dict[bytes, bytes] = {}
        for name, raw in entries.items():
            try:
                if not isinstance(raw, str):
                    raise ValueError("not a string")
                out[name.encode(errors="surrogateescape")] = raw.encode(errors="surrogateescape")
            except (ValueError, UnicodeError):  # a lone surrogate JSON allows, no name can hold
                self.count("remote_rejected")
        return out

    @staticmethod
    def _manifest(raw: dict[bytes, bytes]) -> bytes:
        return json.dumps({"mithrilfs": 1, "entries": {n.decode(errors="surrogateescape"): v.decode(
            errors="surrogateescape") for n, v in raw.items()}}, sort_keys=True).encode(errors="surrogateescape")

    def write_manifest(self, dir_path: str, raw: dict[bytes, bytes], etag: str | None) -> bool:
        """Put If-Match *etag* (None: only if absent); False when another writer got there first."""
        import obstore.exceptions

        data = self._manifest(raw)
        mode: Any = "create" if etag is None else {"e_tag": etag}
        try:
            result = self.patiently(
                lambda: obstore_api().put(self.names, self.base + self._manifest_key(dir_path), data, mode=mode))
        except (obstore.exceptions.AlreadyExistsError, obstore.exceptions.PreconditionError):
            self.level.moved()
            self.seen.forget(dir_path)
            return False
        self.level.moved(up=len(data))
        self.seen.saw(dir_path, raw, result.get("e_tag") if isinstance(result, dict) else None)
        return True

    def list_dirs(self, dir_paths: list[str]) -> dict[str, dict[bytes, RemoteEntry]]:
        def one(d: str) -> dict[bytes, RemoteEntry]:
            entries = self.codec.entries(d, self.read_manifest(d)[0])
            self.packs.learn(entries.values())  # where their blobs are: the names say
            return entries

        return self.call(lambda: dict(zip(dir_paths, self.parallel(one, dir_paths))))

    def all_dirs(self) -> list[str]:
        def scan() -> list[str]:
            prefix = self.base + "names/"
            out = []
            for batch in obstore_api().list(self.names, prefix=prefix, chunk_size=1000):
                self.level.moved()
                for meta in batch:
                    rest = meta["path"][len(prefix):]
                    if not rest.endswith("#"):
                        continue
                    parts = [p for p in rest[:-1].split("/") if p]
                    try:
                        names = [unquote_component(p) for p in parts if p.startswith("~")]
                        if len(names) == len(parts) and all(valid_name(n.encode(errors="surrogateescape"))
                                                            for n in names):
                            out.append("/".join(names))
                    except UnicodeError:
                        self.count("remote_rejected")
            return sorted(out)

        return self.call(scan)

    def dirs_under(self, paths: list[str]) -> set[str]:
        """One listing of the manifests below each path (a purge of one entry never lists a whole fleet's)."""
        return set().union(*self.call(lambda: [_dirs_below(self, p) for p in paths]))

    # -- where blobs are (``stores.s3.placement``) ----------------------------------------
    def read_places(self, dirs: list[str]) -> None:
        """Read these directories' manifests (in parallel) for where their blobs are (``Packs.learn``); inside
        a request (``call``)."""
        for d, (raw, _) in zip(dirs, self.parallel(self.read_manifest, dirs)):
            self.packs.learn(self.codec.entries(d, raw).values())

    def publish_entries(self, items: list[tuple[str, RemoteEntry]]) -> list[tuple[bool, RemoteEntry | None]]:
        if not items:
            return []
        items = self.placement.locate_for_publish(items)
        by_dir: dict[str, list[int]] = {}
        for i, (path, _) in enumerate(items):
            by_dir.setdefault(path.rpartition("/")[0], []).append(i)
        results: list[tuple[bool, RemoteEntry | None]] = [(False, None)] * len(items)

        def one(d: str) -> None:
            for i, r in zip(by_dir[d], self._merge_into(d, [items[i] for i in by_dir[d]])):
                results[i] = r

        def deepest_first() -> None:
            """A directory's names before its entry in its parent: ``fleet gc`` removes a directory's entry
            only once the directory is empty, and checks again after (docs/design.md, *Fleet gc*)."""
            for depth in sorted({_depth(d) for d in by_dir}, reverse=True):
                self.parallel(one, [d for d in by_dir if _depth(d) == depth])

        self.call(deepest_first)
        self.count("remote_uploaded_entries", sum(1 for w, _ in results if w))
        return results

    def _merge_into(self, dir_path: str, items: list[tuple[str, RemoteEntry]]) -> list[tuple[bool, RemoteEntry | None]]:
        """One directory's compare-and-swap: merge *items* newest-wins, put If-Match, retry on a 412.

        The first attempt merges into the manifest as this node last saw it
        (``stores.s3.seen``; never seen: absent), without reading it: a 412 says
        another writer came in between, and the next attempts read first.
        """
        seen = self.seen.get(dir_path)
        for attempt in range(CAS_ATTEMPTS):
            if attempt == 0:
                raw, etag = seen if seen is not None else ({}, None)
            else:
                raw, etag = self.read_manifest(dir_path)
            out: list[tuple[bool, RemoteEntry | None]] = []
            changed = False
            for path, entry in items:
                name = path.rpartition("/")[2].encode(errors="surrogateescape")
                held = raw.get(name)
                cur = self.codec.decode(path, held) if held is not None else None
                if cur is not None and cur.newer_than(entry.version, entry.node):
                    out.append((False, cur))
                    continue
                if (cur is not None and cur.pack is not None and entry.type == "f" and entry.pack is None
                        and cur.hash == entry.hash):
                    # where the bucket has it (the place, with its pack's time, is a live name's)
                    entry = replace(entry, pack=cur.pack, offset=cur.offset, packed=cur.packed)

                if held is None and len(raw) >= MAX_DIR_NAMES:  # readers would refuse the manifest whole
                    self.count("remote_rejected")
                    log.warning("%r not published: directory %r holds %d names already", path, dir_path, len(raw))
                    out.append((False, None))
                    continue
                new = self.codec.encode(path, entry)
                if held != new:
                    raw[name] = new
                    changed = True
                out.append((True, cur))
            if attempt == 0 and seen is not None and not all(w for w, _ in out):
                continue  # lost to what this node saw: the newest that stayed is read, not remembered
            if not changed or self.write_manifest(dir_path, raw, etag):
                return out
            if attempt:  # the first try merged into what this node saw last: read it at once
                time.sleep(random.uniform(0, min(0.5, 0.01 * (2 ** attempt))))  # another writer won: merge again
        raise RemoteError(f"directory {dir_path!r}: {CAS_ATTEMPTS} writers in a row got there first")

    # -- blobs (``stores.s3.blobs``) ------------------------------------------------------
    def fetch_blob(self, hex_digest: str, size: int, out: BinaryIO) -> bytes | None:
        return self.call(self.blobs.fetch_blob, hex_digest, size, out)

    def fetch_small_blobs(self, blobs: list[tuple[str, int]]) -> list[BlobBytes | None]:
        return self.call(self.blobs.fetch_small, blobs)

    def missing_blobs(self, blobs: dict[str, int]) -> list[str]:
        return self.call(self.blobs.missing, blobs) if blobs else []

    def upload_blobs(self, files: list[tuple[str, str]]) -> set[str]:
        return self.call(self.blobs.upload, files)

    # -- fleet gc (``fleet.gc``) ----------------------------------------------
    def record_use(self, records: dict[str, float]) -> None:
        """One new object of use records (directory -> when), never a rewrite; gc merges them."""
        def add() -> None:
            data = json.dumps(records, sort_keys=True).encode(errors="surrogateescape")
            self.put_object(self.names, record_key(USAGE), data, "create", len(data))

        if records:
            self.call(add)

    def sweeping(self) -> bool:
        """A sweep marker younger than a gc run's limit (one LIST of ``gc-sweeps/``, a marker per run): a gc
        deletes blobs and packs now (``stores.s3.gc``)."""
        def get() -> bool:
            batch: Any = next(iter(obstore_api().list(self.quick, prefix=self.base + SWEEPS, chunk_size=100)), [])
            self.level.moved()
            now = self.clock.now()
            return any(is_record_key(SWEEPS, m["path"][len(self.base):])
                       and ages.younger(object_age(m, now), ages.GC_RUN_SECONDS) for m in batch)

        if not self.call(get):
            return False
        self.packs.swept()  # the names wait for the sweep: packs gc may be deleting are not trusted after it
        return True

    def tier_summary(self) -> dict[str, Any] | None:

        got = self.call(lambda: self.get_object(self.names, "gc", MAX_SUMMARY_BYTES))
        return parse_summary(got[0]) if got is not None else None


def _depth(dir_path: str) -> int:
    return dir_path.count("/") + 1 if dir_path else 0


def _dirs_below(s3: S3Store, path: str) -> set[str]:
    """*path* and the directories below it that have a manifest: one listing of the manifests under it."""
    prefix = s3.base + s3._manifest_key(path)[:-1]  # "names/~a/~b/": the manifest "#" and those below
    out = set()
    for batch in obstore_api().list(s3.names, prefix=prefix, chunk_size=1000):
        s3.level.moved()
        for meta in batch:
            rest = meta["path"][len(prefix):]
            parts = [q for q in rest[:-1].split("/") if q] if rest.endswith("#") else None
            if parts is None or not all(q.startswith("~") for q in parts):
                continue
            try:
                out.add("/".join([path, *(unquote_component(q) for q in parts)]))
            except UnicodeError:
                continue
    return out
