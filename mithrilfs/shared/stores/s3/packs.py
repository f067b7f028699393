"""Small blobs in a bucket travel in packs: one PUT for a batch's blobs, one range GET for a directory's files.

One object per blob costs one request per file to publish and one per file
to read, and a fleet's bucket is tens of milliseconds per request away
(see docs/benchmarks.md, 'H, a new node across a 20 ms bucket').  So the uploader puts the
small blobs of a batch (up to ``PACK_BLOB_BYTES`` each; larger ones stay
their own objects, ``blobs/HH/HEX``) into *packs*: ``packs/HH/ID``, the
blobs concatenated in the order the batch gives them (one directory's
together, in the order they were written), cut at ``PACK_BYTES``, written
``If-None-Match: *`` (a pack of the very same bytes already there is
written over, renewing its time for ``fleet gc``); ID is the first 128
bits of the pack's own blake3, so a pack is never two things.  A pack has no index of its own:
each file's entry in its directory's manifest carries its blob's pack and
offset (``RemoteEntry.pack``/``offset``, signed and validated like every
other field), so a reader learns where a directory's blobs are from the
same GET that lists it, and fetches a kernel's files with one range GET
(adjacent ranges of one pack coalesced: gaps up to ``GAP_BYTES``, at most
``RANGE_BYTES`` a request).

Content addressing and verification stay per blob: every range is cut into
its blobs and each must hash to its name at its size.  A range that does
not (a corrupted or truncated pack, a pack gone, a location that lies) is
never served: the blob's own object is tried instead, and when that is not
good either the blob is reported bad (``stores.s3.repair``), so the next upload of
it by a node holding the bytes (at the latest a ``push``) writes it as its
own object, where readers then find it.

Where blobs are is remembered per store (``KNOWN_BLOBS``, oldest forgotten
first), learned from every entry this node reads or writes and from its
own uploads; the uploader counts a small blob it knows the place of as
present (no HEAD), and one it does not as missing: two nodes racing to
publish the same bytes may both pack them (a duplicate, never a loss).  A
blob materialized in an earlier mount whose place is not known is found by
reading its directory again (``Placement.knows_where``).  The map is
forgotten when the bucket's epoch changes (emptied: every pack is gone).

``fleet gc`` deletes a pack no entry locates once it is older than its
grace (``stores.s3.gc``).  So a place carries when its pack was written
(``RemoteEntry.packed``, ``pt``), a writer counts a blob present only in a
pack younger than ``ages.BLOB_TRUST_SECONDS`` (``S3Blobs.missing``: an
older one is packed again), a publish refuses a place it adds in a pack
older than ``ages.min_grace`` (one learned from a read after the check:
``stale``), and the places in packs written over while a gc sweep runs are
forgotten (``swept``).
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Iterable
from dataclasses import replace
from typing import Any

import blake3

from mithrilfs.crash_points import crash_point
from mithrilfs.shared.stores import ages
from mithrilfs.shared.stores.entries import MAX_PACK_BYTES, BlobBytes, RemoteEntry, is_hex_digest, is_pack_id
from mithrilfs.shared.stores.s3.conn import PART_BYTES, S3Connection, obstore_api

log = logging.getLogger(__name__)

#: A pack is cut once it would grow past this (``MAX_PACK_BYTES`` bounds what a reader accepts).
PACK_BYTES = 32 << 20
#: Blobs up to this size go into packs; larger ones stay their own objects.  ``MITHRILFS_PACK_BLOB_BYTES=0``
#: writes every blob as its own object.
PACK_BLOB_BYTES = int(os.environ.get("MITHRILFS_PACK_BLOB_BYTES", 1 << 20))
#: Ranges of one pack this close are fetched in one request (the gap's bytes are read and dropped).
GAP_BYTES = 256 << 10
#: One coalesced range GET holds the blobs that begin within this of its start (so at most this plus one
#: blob): a pack's upload part (``stores.s3.conn.PART_BYTES``: a pack is put in parts of that size), which a
#: prefetch's batches follow (``PackPlacement.container_of``), so a part is one GET, as S3 advises for
#: multipart objects; larger ranges also cost the store less (see docs/benchmarks.md, 'H10, the daemon's
#: own share of the prefetch').
RANGE_BYTES = PART_BYTES
#: Places of blobs remembered (about 250 bytes each); the oldest are forgotten first (re-learned from
#: their directory when read).  1,500 Triton kernels are 10,500 files.
KNOWN_BLOBS = 1 << 18

#: Places kept from one mount to the next (about 120 bytes each in the index).
KEPT_PLACES = 1 << 16
assert PACK_BYTES + PACK_BLOB_BYTES <= MAX_PACK_BYTES

#: Where a blob is: (pack id, offset, when the pack was written: unix seconds, 0 unknown), or None for its
#: own object.
Location = tuple[str, int, int] | None


def pack_key(pack_id: str) -> str:
    return f"packs/{pack_id[:2]}/{pack_id}"


class Packs:
    """One store's packs: where blobs are, writing packs, reading ranges (see the module doc)."""

    def __init__(self, store: S3Connection) -> None:
        self.store = store
        self._lock = threading.Lock()
        self._where: dict[str, Location] = {}
        #: Packs this node wrote again over an old one of the same bytes (``_put_pack``) since the last
        #: sweep it saw: a gc that listed the old one may delete it after checking its time.
        self._renewed: set[str] = set()

    # -- where blobs are ---------------------------------------------------------
    def learn(self, entries: Iterable[RemoteEntry]) -> None:
        """Entries read or written: a located one tells where its blob is; one without a location says
        the blob is its own object (unless a pack of it is known)."""
        with self._lock:
            for e in entries:
                if e.type != "f" or e.hash is None:
                    continue
                if e.pack is not None and e.size <= PACK_BLOB_BYTES:  # no reader holds more in memory
                    self._remember(e.hash, (e.pack, e.offset, e.packed))
                elif e.hash not in self._where:
                    self._remember(e.hash, None)

    def _remember(self, h: str, loc: Location) -> None:
        self._where.pop(h, None)
        self._where[h] = loc
        if len(self._where) > KNOWN_BLOBS:
            del self._where[next(iter(self._where))]

    def knows(self, h: str) -> bool:
        with self._lock:
            return h in self._where

    def location(self, h: str) -> Location:
        with self._lock:
            return self._where.get(h)

    def in_own_object(self, h: str) -> None:
        """The blob was just written as its own object (a repair): readers go there first."""
        with self._lock:
            self._remember(h, None)

    def swept(self) -> None:
        """A ``fleet gc`` sweep is running (the writer holds its names back): the places in packs this node
        wrote over an old one are forgotten, so the next try packs those blobs again instead of trusting a
        pack gc may have deleted between its check of the time and its DELETE."""
        with self._lock:
            if self._renewed:
                self._where = {h: loc for h, loc in self._where.items() if loc is None or loc[0] not in self._renewed}
                self._renewed.clear()

    def export(self) -> list[list[Any]]:
        """The newest ``KEPT_PLACES`` places in packs, as [hex, pack id, offset, written] (``known_places``).

        A node that published its files and is remounted knows no place (it
        read nothing from the bucket), and the startup record it writes at
        its next unmount must carry them: it would read every directory's
        manifest for them then.  Kept in the local index instead, they cost
        nothing.
        """
        with self._lock:
            located = [[h, *loc] for h, loc in self._where.items() if loc is not None]
        return located[-KEPT_PLACES:]

    def take(self, places: list[Any]) -> int:
        """Places an earlier mount of this store kept (``export``); anything that is not one is left out (the
        index is the daemon's own, but a place is checked like every other: a range that does not hash to
        its blob is never served).  Places learned in this mount stay.  How many were taken."""
        taken = 0
        with self._lock:
            for p in places:
                if not (isinstance(p, list) and len(p) == 4 and is_hex_digest(p[0]) and is_pack_id(p[1])
                        and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in p[2:])):
                    continue
                if p[0] not in self._where:
                    self._remember(p[0], (p[1], p[2], p[3]))
                    taken += 1
        return taken

    def forget(self, hashes: list[str]) -> None:
        """Places found stale (their pack is gone: collected by ``fleet gc`` after its blobs were packed
        again elsewhere): the next read of these blobs learns their place from their directory again."""
        with self._lock:
            for h in hashes:
                self._where.pop(h, None)

    def forget_all(self) -> None:
        """The bucket was emptied (a new epoch): no pack this node knew of is there."""
        with self._lock:
            self._where.clear()
            self._renewed.clear()

    def locate(self, items: list[tuple[str, RemoteEntry]]) -> list[tuple[str, RemoteEntry]]:
        """File entries with the place of their blob where it is in a known pack."""
        out = []
        with self._lock:
            for path, e in items:
                loc = self._where.get(e.hash) if e.type == "f" and e.pack is None and e.hash else None
                out.append((path, replace(e, pack=loc[0], offset=loc[1], packed=loc[2]) if loc is not None else e))
        return out

    @staticmethod
    def stale(before: list[tuple[str, RemoteEntry]], located: list[tuple[str, RemoteEntry]], now: float) -> list[str]:
        """The paths ``locate`` gave a place in a pack written longer than ``ages.min_grace`` ago: a place
        learned (from a read) after the blob was checked, which ``fleet gc`` may be deleting; the publish
        refuses the batch, whose next check packs those blobs again.  A place the entry had already is not
        this node's to judge (a live name's, kept by ``_merge_into``).  *now*: the bucket's time; a pack dated
        past it (a writer's clock ahead) is no fresher than an old one."""
        return [path for (path, was), (_, e) in zip(before, located)
                if was.pack is None and e.pack is not None and not ages.younger(now - e.packed, ages.min_grace())]

    # -- writing -----------------------------------------------------------------
    def upload(self, files: list[tuple[str, str, int]], gone: set[str]) -> None:
        """Pack these blobs (hex, file, size) in their order, one pack at a time (memory: one pack).

        Each file is hashed as it is packed: a local copy that does not
        match its name is not uploaded (it joins *gone*: its names are not
        published), so a corrupt local file never reaches the fleet.
        """
        buf = bytearray()
        members: list[tuple[str, int]] = []
        for h, path, _size in files:
            try:
                with open(path, "rb") as f:
                    data = f.read(PACK_BLOB_BYTES + 1)
            except FileNotFoundError:
                gone.add(h)  # evicted before it could be uploaded: publish nothing for it
                continue
            if blake3.blake3(data).hexdigest() != h:
                log.error("local copy of blob %s does not match its hash: not uploaded", h)
                gone.add(h)
                continue
            if buf and len(buf) + len(data) > PACK_BYTES:
                self._put_pack(bytes(buf), members)
                buf, members = bytearray(), []
            members.append((h, len(buf)))
            buf += data
        if members:
            self._put_pack(bytes(buf), members)

    def _put_pack(self, data: bytes, members: list[tuple[str, int]]) -> None:
        pack_id = blake3.blake3(data).hexdigest()[:32]
        s = self.store
        # before the PUT, whole seconds down, on the bucket's clock: never after the object's Last-Modified
        written = int(s.clock.now())
        if not s.put_object(s.blobs_for(len(data)), pack_key(pack_id), data, "create", len(data)):
            # a pack with these very bytes is there already (its id is their hash), maybe old enough for
            # ``fleet gc`` to be deleting it: written again, which renews its time (as an old loose blob is)
            s.put_object(s.blobs_for(len(data)), pack_key(pack_id), data, "overwrite", len(data))
            with self._lock:
                self._renewed.add(pack_id)
        s.count("remote_uploaded_bytes", len(data))
        with self._lock:
            for h, offset in members:
                self._remember(h, (pack_id, offset, written))
        crash_point("pack_uploaded")  # the tests': a node killed between a pack and its names

    # -- reading -----------------------------------------------------------------
    def fetch(self, blobs: list[tuple[str, int]], out: list[BlobBytes | None]) -> list[int]:
        """Fill *out* with the verified bytes of the blobs known to be in packs, coalescing each pack's
        ranges; the indices whose pack did not give good bytes (the caller tries their own objects).  A pack
        that is not there at all gave nothing wrong: its places are stale (a record or a listing older than
        the gc that collected it), forgotten rather than reported, and not in the answer."""
        located: dict[str, list[tuple[int, int, int]]] = {}
        for i, (h, size) in enumerate(blobs):
            loc = self.location(h)
            if loc is not None and 0 < size <= PACK_BLOB_BYTES:
                located.setdefault(loc[0], []).append((loc[1], size, i))
        runs: list[tuple[str, int, int, list[tuple[int, int, int]]]] = []
        for pack_id, members in located.items():
            members.sort()
            run: list[tuple[int, int, int]] = []
            start = end = 0
            for offset, size, i in members:
                if run and (offset - end > GAP_BYTES or offset - start >= RANGE_BYTES):
                    runs.append((pack_id, start, end, run))
                    run = []
                if not run:
                    start, end = offset, offset
                run.append((offset, size, i))
                end = max(end, offset + size)
            runs.append((pack_id, start, end, run))
        failed: list[int] = []
        lock = threading.Lock()

        def one(item: tuple[str, int, int, list[tuple[int, int, int]]]) -> None:
            pack_id, start, end, members = item
            data = self.read_range(pack_id, start, end)
            if data is None and not self.exists(pack_id):
                self.forget([blobs[i][0] for _, _, i in members])
                return
            for offset, size, i in members:  # views of the range, not copies (every byte once)
                piece = data[offset - start:offset - start + size] if data is not None else b""
                if len(piece) == size and blake3.blake3(piece).hexdigest() == blobs[i][0]:
                    out[i] = piece
                    self.store.count("remote_fetched_bytes", size)
                else:
                    with lock:
                        failed.append(i)

        self.store.parallel(one, runs)
        return sorted(failed)

    def exists(self, pack_id: str) -> bool:
        """One HEAD: whether the pack is in the bucket (a range it did not give: gone, or a place that lies)."""
        s = self.store
        return s.unless_absent(lambda: obstore_api().head(s.quick, s.base + pack_key(pack_id))) is not None

    def read_range(self, pack_id: str, start: int, end: int) -> memoryview | None:
        """Bytes [start, end) of a pack (fewer when it is shorter), counted as they arrive; None when the
        pack is not there or the range is past its end (a location that lies: bad data, no failure).

        Copied once, from the client's chunks into one buffer, and handed out as a view: its blobs are
        views of it too (``fetch``).  A prefetch moves every byte of a startup set this way, on threads
        that hold the interpreter's lock while they copy: copying each chunk, joining them and slicing
        each blob out cost several times one copy."""
        import obstore.exceptions

        s = self.store
        client = s.blobs_for(end - start)
        try:
            result = s.unless_absent(lambda: obstore_api().get(client, s.base + pack_key(pack_id),
                                                             options={"range": (start, end)}))
        except obstore.exceptions.GenericError as e:
            if "416" not in str(e) and "Range" not in str(e):
                raise
            s.level.moved()
            return None
        if result is None:
            return None
        buf = bytearray(end - start)
        got = 0
        for chunk in result.stream(min_chunk_size=256 << 10):
            part = memoryview(chunk)
            n = min(len(part), len(buf) - got)
            buf[got:got + n] = part[:n]
            got += n
            s.level.moved(down=len(part), requests=0)  # as it arrives: the bound on a wait sees progress
            if got >= len(buf):
                break
        return memoryview(buf)[:got]
