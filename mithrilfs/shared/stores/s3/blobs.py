"""A bucket's blobs: fetched from their packs or their own objects, found missing, uploaded.

Part of ``stores.s3.store.S3Store`` (its ``blobs``), which runs these in its
``call`` (failures become a ``RemoteError`` and a back-off).  Small blobs
travel in packs (``stores.s3.packs``); larger ones, and blobs written over
(found at the wrong size, or reported bad by a reader: ``stores.s3.repair``), are
objects of their own, ``blobs/HH/HEX``.  It speaks to the bucket through the
store's connection (``stores.s3.conn``) and is handed the packs and the reports:
no back reference to the store.
"""

from __future__ import annotations

import logging
import os
import threading
from typing import Any, BinaryIO

import blake3

from mithrilfs.shared.stores import ages
from mithrilfs.shared.stores.entries import BlobBytes
from mithrilfs.shared.stores.s3.conn import PART_BYTES, PROGRESS_BYTES, S3Connection, obstore_api
from mithrilfs.shared.stores.s3.packs import PACK_BLOB_BYTES, Packs
from mithrilfs.shared.stores.s3.repair import BadBlobReports, hashes_to
from mithrilfs.shared.stores.stream import HashedCopy

log = logging.getLogger(__name__)



class S3Blobs:
    """One store's blobs (see the module doc); every method runs in the store's threads."""

    def __init__(self, store: S3Connection, packs: Packs, reports: BadBlobReports) -> None:
        self.store = store
        #: Where blobs are (a small one in a pack), and the blobs readers reported bad: the store's parts too.
        self.packs = packs
        self.reports = reports
        self._lock = threading.Lock()
        #: Blobs found in the bucket at the wrong size (planted or cut short) or reported bad by a reader:
        #: written over, not if-absent.
        self.bad: set[str] = set()
        #: Of those, the ones reported bad: our copy is hashed before it replaces theirs (a planted report
        #: must not let a corrupt local file replace a good object), and the report goes once replaced.
        self.verify_first: set[str] = set()

    def blob_key(self, hex_digest: str) -> str:
        return f"blobs/{hex_digest[:2]}/{hex_digest}"

    def fetch_blob(self, hex_digest: str, size: int, out: BinaryIO) -> bytes | None:
        """From its pack when its place is known (verified before a byte is written), else, or when the
        pack does not give it right, from its own object."""
        if size == 0:
            return blake3.blake3(b"").digest()
        in_pack = self.packs.location(hex_digest) is not None and size <= PACK_BLOB_BYTES
        if in_pack:
            got: list[BlobBytes | None] = [None]
            self.packs.fetch([(hex_digest, size)], got)
            if got[0] is not None:  # verified: its size and hash
                out.write(got[0])
                return bytes.fromhex(hex_digest)
        digest = self._fetch_own_object(hex_digest, size, out)
        if digest is None and in_pack and self.packs.knows(hex_digest):  # not a pack gone (``Packs.fetch``)
            self._bad_in_pack(hex_digest)
        return digest

    def _bad_in_pack(self, hex_digest: str) -> None:
        """A blob its pack did not give right and that has no good object of its own: never served, and
        reported, so a node holding it writes it again (``missing_blobs``)."""
        self.store.count("remote_verify_failures")
        self.reports.report(hex_digest)

    def _fetch_own_object(self, hex_digest: str, size: int, out: BinaryIO) -> bytes | None:
        result = self.store.unless_absent(
            lambda: obstore_api().get(self.store.blobs_for(size), self.store.base + self.blob_key(hex_digest)))
        if result is None:
            return None
        if result.meta["size"] != size:
            return b""  # never read: more (or fewer) bytes than the entry says
        copy = HashedCopy(out, size, self.store.level)
        for chunk in result.stream(min_chunk_size=PROGRESS_BYTES):
            if not copy.take(bytes(chunk)):
                return b""
        digest = copy.digest()
        if not digest:
            return b""
        self.store.count("remote_fetched_bytes", copy.got)
        if digest.hex() != hex_digest:
            self.reports.report(hex_digest)
        return digest

    def fetch_small(self, blobs: list[tuple[str, int]]) -> list[BlobBytes | None]:
        """Those in packs by coalesced range GETs (``stores.s3.packs``), the rest (and those their pack did not
        give right) from their own objects, concurrently; each verified (``RemoteStore.fetch_small_blobs``)."""
        def own(i: int) -> bytes | None:
            h, size = blobs[i]
            got = self.store.get_object(self.store.blobs_for(size), self.blob_key(h), size)
            if got is None:
                return None
            if got[0] is None or len(got[0]) != size:  # another size than its entry says: bad data
                self.store.count("remote_verify_failures")
                return None
            self.store.count("remote_fetched_bytes", size)
            if blake3.blake3(got[0]).hexdigest() != h:  # never served; the bucket learns it is bad
                self.store.count("remote_verify_failures")
                log.error("remote blob %s does not match its hash: rejected", h)
                self.reports.report(h)
                return None
            return got[0]

        def run() -> list[BlobBytes | None]:
            out: list[BlobBytes | None] = [b"" if size == 0 else None for _, size in blobs]
            failed = set(self.packs.fetch(blobs, out))
            rest = [i for i, (_, size) in enumerate(blobs) if size and out[i] is None]
            for i, data in zip(rest, self.store.parallel(own, rest)):
                out[i] = data
                if data is None and i in failed:
                    self._bad_in_pack(blobs[i][0])
            return out

        return run()

    def missing(self, blobs: dict[str, int]) -> list[str]:
        """What the bucket lacks in full, at the wrong size, or holds with bytes a reader reported bad
        (a node holding verified bytes writes those over: ``upload_blobs``).

        A small blob is there when this node knows its pack (from the
        entries it read, ``will_publish``'s manifests included, or its own
        uploads) and that pack was written less than ``BLOB_TRUST_SECONDS``
        ago (the time its place carries), missing otherwise: no HEAD per
        blob (two nodes racing may both pack it, a duplicate).  Larger ones, and those known only as
        their own objects, are asked for (HEAD).
        """
        def one(item: tuple[str, int]) -> str | None:
            h, size = item
            if h in bad:
                return h
            loc = self.packs.location(h)
            if loc is not None:
                # a pack written longer ago than the trust period may be one ``fleet gc`` deletes once no
                # name locates it: the blob is packed again (a new place), as an old loose blob is written again
                return None if ages.younger(self.store.clock.now() - loc[2], ages.BLOB_TRUST_SECONDS) else h
            if size <= PACK_BLOB_BYTES and not self.packs.knows(h):
                return h
            meta = self.store.unless_absent(lambda: obstore_api().head(self.store.quick, self.store.base + self.blob_key(h)))
            if meta is None:
                return h
            if meta["size"] != size or not ages.younger(object_age(meta, self.store.clock.now()),
                                                             ages.BLOB_TRUST_SECONDS):
                # the wrong size, or old enough that ``fleet gc`` may delete it once unreferenced: written
                # over (renewing its time, ``fleet.usage``)
                with self._lock:
                    self.bad.add(h)
                return h
            return None

        if not blobs:
            return []

        def check() -> list[str]:
            bad.update(h for h in self.reports.reported() if h in blobs)
            with self._lock:
                self.bad |= bad
                self.verify_first.update(bad)
            return [h for h in self.store.parallel(one, blobs.items()) if h is not None]

        bad: set[str] = set()
        return check()

    def upload(self, files: list[tuple[str, str]]) -> set[str]:
        """Small blobs into packs, in the order given (``stores.s3.packs``); large ones, and those written over
        (found at the wrong size or reported bad), as their own objects."""
        gone: set[str] = set()
        packed: list[tuple[str, str, int]] = []
        alone: list[tuple[str, str]] = []
        for h, path in files:
            if not path:
                continue  # empty content: never fetched (a reader knows its bytes)
            try:
                size = os.stat(path).st_size
            except FileNotFoundError:
                gone.add(h)  # evicted before it could be uploaded: publish nothing for it
                continue
            with self._lock:
                bad = h in self.bad
            (alone.append((h, path)) if bad or size > PACK_BLOB_BYTES else packed.append((h, path, size)))

        def one(item: tuple[str, str]) -> None:
            """One PUT if absent.  Large ones: in parts, streamed from the file, unconditional (the client
            buffers a conditional put whole in memory); ``missing_blobs`` found them absent, and a writer
            that raced us wrote the same bytes under the same name."""
            h, path = item
            with self._lock:
                bad = h in self.bad
            try:
                f = open(path, "rb")
            except FileNotFoundError:
                with self._lock:
                    gone.add(h)  # evicted before it could be uploaded: publish nothing for it
                return
            with f:
                size = os_size(f)
                with self._lock:
                    verify = h in self.verify_first
                if verify and not hashes_to(f, h):
                    log.error("local copy of blob %s does not match its hash: not uploaded", h)
                    with self._lock:
                        gone.add(h)
                    return
                if size <= PART_BYTES:
                    written = self.store.put_object(self.store.blobs_for(size), self.blob_key(h), f.read(),
                                        "overwrite" if bad else "create", size)
                else:
                    written = self.store.put_object(self.store.blobs_for(size), self.blob_key(h), f, "overwrite", size)
                if written:
                    self.store.count("remote_uploaded_bytes", size)
            if verify:
                self.reports.repaired(h)
            if bad:
                self.packs.in_own_object(h)
            with self._lock:
                self.bad.discard(h)
                self.verify_first.discard(h)

        def run() -> None:
            self.packs.upload(packed, gone)
            self.store.parallel(one, alone)

        run()
        return gone


def os_size(f: BinaryIO) -> int:
    return os.fstat(f.fileno()).st_size


def object_age(meta: Any, now: float) -> float:
    """Seconds from an object's last write to *now* (the bucket's time, ``stores.clock``); 0 when the server
    does not say."""
    written = meta.get("last_modified")
    return now - written.timestamp() if written is not None else 0.0
