"""The one way content becomes a blob, is verified, and stops being one: index row and file together.

Every producer of blobs (a committed write, a fetch from the shared tier, an
archive import) goes through ``Blobs.add``: record a refcount-0 intent row,
then hard-link the finished staging file into ``objects/``.  A crash between
the two leaves a row that startup collects, never an untracked file; the
caller points an inode at the blob in its own transaction afterwards.  A
commit of content staged in memory (``adding_data``) writes the file first
and its row in the transaction that points the inode at it: a crash between
leaves a file no row names, which the first collection after an unclean
stop deletes.
``collect`` deletes a blob whose last reference went.  ``bytes`` is the
running total of blob bytes on disk, the budget's physical size: it moves
only when a file really appears or goes (a row whose file never came, a
write that failed for room, is no byte on disk), and ``recount`` sets it
afresh after the startup repair, which deletes blobs the total was summed
with (after an unclean stop, against the files actually there).
"""

from __future__ import annotations

import logging
import os
import sqlite3
from collections.abc import Callable, Iterator
from contextlib import contextmanager

from mithrilfs.store.blob_writer import BlobWriter
from mithrilfs.store.cas import CAS, hash_bytes, hash_file
from mithrilfs.store.namespace import Namespace
from mithrilfs.store.reserve import NO_RESERVE, NoReserve, is_disk_full

log = logging.getLogger(__name__)


class Blobs:
    def __init__(self, ns: Namespace, cas: CAS, reserve: NoReserve = NO_RESERVE) -> None:
        self.ns = ns
        self.cas = cas
        #: The index's room on a full disk (``never_came`` writes the index just as the disk filled).
        self.reserve = reserve
        #: Bytes of blob files on disk (placeholders of remote blobs count 0).
        self.bytes = ns.physical_bytes()
        #: Blobs hashed and found right during this mount: not re-read before serving.
        self.verified: set[bytes] = set()
        #: Blob files deleted before the index could record it (disk full; see free_early).
        self._freed_early: set[bytes] = set()
        #: Batches of blobs written by a child process while a prefetch runs (``blob_writer``).
        self.writer = BlobWriter(cas)

    def add(self, staging_path: str, digest: bytes, size: int, *, trusted: bool = False,
            between: Callable[[str], None] = lambda point: None) -> bool:
        """Make the finished file *staging_path* (blake3 *digest*) a blob; True when it is new.

        The staging file is left for the caller to remove once its index
        change is committed (so a failed attempt can be retried).  An
        existing blob not verified this mount is replaced by these bytes,
        known good, unless *trusted*.  *between* is called at the crash
        points ("after_intent").
        """
        with self.ns.txn():
            self.ns.blob_intent(digest, size)
        between("after_intent")
        new = self.cas.adopt(staging_path, digest, trust_existing=trusted or digest in self.verified)
        self.written(digest, size, new)
        return new

    @contextmanager
    def adding_data(self, data: bytes | bytearray, digest: bytes, *,
                    between: Callable[[str], None] = lambda point: None) -> Iterator[bool]:
        """Make *data* (blake3 *digest*, content staged in memory) a blob; yields True when it is new.

        The file comes first (``CAS.write_blob``: one create and one rename,
        no staging file to link and unlink), then its row, inside the index
        transaction this opens: the caller points inodes at the blob in the
        same transaction, so a commit of content staged in memory costs one
        transaction, not two.  A crash between the file and the transaction
        leaves a file no row names, which the first collection after an
        unclean stop deletes (``recount``); a transaction that fails deletes
        a file it made.  *between* is called between the two ("after_adopt",
        then "after_intent": the row is not in the index yet).
        """
        new = self.cas.write_blob(digest, data, trust_existing=digest in self.verified)
        between("after_adopt")
        between("after_intent")
        try:
            with self.ns.txn():
                self.ns.blob_intent(digest, len(data))
                yield new
        except BaseException:
            if new:
                self.cas.delete(digest)
            raise
        self.written(digest, len(data), new)

    def recount(self, *, check_files: bool = False) -> int:
        """Set ``bytes`` afresh from the index (after the startup repair deleted blobs); returns it.

        *check_files* (after an unclean stop, which can leave a row whose
        file never came, or a file whose row went): only rows whose file is
        on disk count, and a blob file no row names is deleted (nothing can
        reach it: every blob's row is written before its file), so the total
        is exactly the bytes of the blob files that remain.  One listing of
        ``objects/``, no stat per blob.
        """
        if not check_files:
            self.bytes = self.ns.physical_bytes()
            return self.bytes
        rows = self.ns.blob_sizes()
        total = 0
        for digest in list(self.cas.iter_digests()):
            size = rows.get(digest)
            if size is None:
                self.cas.delete(digest)
            else:
                total += size
        self.bytes = total
        return total

    def intend(self, items: list[tuple[bytes, int]]) -> None:
        """Record many blobs (digest, size) about to appear on disk, in one transaction.

        The first half of ``add`` for callers that write the files
        themselves (``writer``, a prefetch's batches in worker threads): the
        rows come first, so a crash never leaves an untracked file.  Then
        ``written`` for each.
        """
        with self.ns.txn():
            self.ns.blob_intents(items)

    def never_came(self, digests: list[bytes]) -> None:
        """Blobs from the shared tier recorded by ``intend`` whose files could not be written (the disk
        filled): their rows say so again (``Namespace.blob_never_came``), so nothing counts, serves or
        checks them as local blobs; their names stay, fetched at their next read.  One written
        meanwhile (the same content by another path) is left alone."""
        gone = [d for d in digests if not self.cas.exists(d)]
        try:
            self._never_came(gone)
        except (OSError, sqlite3.OperationalError) as e:
            if not is_disk_full(e):
                raise
            log.warning("the index is full recording %d blobs that never came (%s): using its reserve", len(gone), e)
            self.reserve.release()  # the index's own room, held for this (the reserve's job)
            try:
                self._never_came(gone)
            finally:
                self.reserve.ensure()  # back once there is room; the budget makes room when it must

    def _never_came(self, digests: list[bytes]) -> None:
        with self.ns.txn():
            for digest in digests:
                self.ns.blob_never_came(digest)

    def written(self, digest: bytes, size: int, new: bool) -> None:
        """A blob recorded by ``intend`` is on disk, verified (*new*: it was not there before)."""
        if new:
            self.bytes += size
            self._freed_early.discard(digest)
        self.verified.add(digest)

    def add_bytes(self, data: bytes, digest: bytes | None = None) -> tuple[bytes, bool]:
        """Store *data* (already verified against *digest* when given); returns (digest, new)."""
        digest = digest if digest is not None else hash_bytes(data)
        fd, path = self.cas.new_staging()
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
            return digest, self.add(path, digest, len(data), trusted=True)
        finally:
            os.unlink(path)

    def verify(self, digest: bytes) -> bool | None:
        """Hash the blob file: True when it matches its name, False when not, None when it is missing."""
        if digest in self.verified:
            return True
        try:
            ok = hash_file(self.cas.path(digest)) == digest
        except FileNotFoundError:
            return None
        if ok:
            self.verified.add(digest)
        return ok

    def read_verifying(self, digest: bytes, off: int, size: int, expected: int) -> memoryview | None:
        """Bytes *off*..*off+size* of a small blob not verified yet, hashed and served from one read.

        The blob is read whole, hashed, and the slice comes from the same
        buffer: what is served is exactly what was hashed (a file changed
        between a hash and a second read could not slip through).  None when
        it is missing or does not match; ``verify`` then says which and what
        to do.  *expected*: the blob's size; a file of another size is not read whole.
        """
        data = self._read_whole(digest, expected, cached_only=False)
        return None if data is None or not self._hashes_right(digest, data) else data[off:off + size]

    def read_ahead(self, digest: bytes, expected: int) -> memoryview | None:
        """All of a small blob if the page cache holds all of it, verified; None otherwise.

        For a head start that must never hold the event loop on the disk
        (``cache.readahead``; a cold blob read after each ``stat`` of a fresh
        mount quadruples its time: docs/benchmarks.md, "K"): read with
        ``RWF_NOWAIT``, and a blob not all in memory is asked of the disk in
        the background (``POSIX_FADV_WILLNEED``, so its READ finds it there).
        Hashed unless verified in this mount already (a prefetch's blob was
        as it arrived), as a READ would serve it.
        """
        data = self._read_whole(digest, expected, cached_only=True)
        if data is None or (digest not in self.verified and not self._hashes_right(digest, data)):
            return None
        return data

    def _read_whole(self, digest: bytes, expected: int, *, cached_only: bool) -> memoryview | None:
        """The blob file's bytes if it is *expected* long (one byte more is asked: a longer file shows);
        None when it is missing, of another size, or (*cached_only*) not all in the page cache."""
        try:
            fd = self.cas.open(digest)
        except FileNotFoundError:
            return None
        try:
            data: bytes | memoryview
            if cached_only:
                buf = bytearray(expected + 1)
                try:
                    n = os.preadv(fd, [buf], 0, os.RWF_NOWAIT)
                except BlockingIOError:
                    n = 0
                if n < expected:
                    os.posix_fadvise(fd, 0, expected, os.POSIX_FADV_WILLNEED)
                    return None
                data = memoryview(buf)[:n]
            else:
                data = os.read(fd, expected + 1)
        finally:
            os.close(fd)
        return memoryview(data) if len(data) == expected else None

    def _hashes_right(self, digest: bytes, data: memoryview) -> bool:
        if hash_bytes(data) != digest:
            return False
        self.verified.add(digest)
        return True

    def collect(self, digest: bytes | None) -> int:
        """Delete a blob whose last reference just went; returns the bytes freed."""
        if digest is None:
            return 0
        info = self.ns.blob_info(digest)
        if info is None or info[0] > 0:
            return 0
        self.verified.discard(digest)
        gone = self.cas.delete(digest)
        with self.ns.txn():
            self.ns.forget_blob(digest)
        self._freed_early.discard(digest)  # if it was, its bytes were counted off when the file went
        if not gone:  # no file (it never came, or went early): no bytes on disk to count off
            return 0
        self.bytes -= info[1]
        return info[1]

    def free_early(self, digest: bytes) -> bool:
        """Delete the file of a blob whose only reference is about to go, before the index says so.

        For a full disk: the index needs room to record the delete that
        would free the room.  Safe because the one inode referencing the
        blob can no longer be reached (no name, no kernel reference, no
        handle); should the index write still fail, the next mount's
        recovery drops that inode and the blob row.  True when a file went.
        """
        info = self.ns.blob_info(digest)
        if info is None or info[0] != 1 or digest in self._freed_early:
            return False
        self.verified.discard(digest)
        if not self.cas.delete(digest):
            return False
        self._freed_early.add(digest)
        self.bytes -= info[1]
        return True

    def quarantine(self, digest: bytes) -> None:
        """Move a blob that failed verification aside (kept for inspection)."""
        self.verified.discard(digest)
        self.cas.quarantine_blob(digest)
