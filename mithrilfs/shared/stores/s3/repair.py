"""Blobs in a bucket whose bytes do not hash to their name: reported by readers, written over at a push.

An object of the right size with other bytes passes the uploader's HEAD,
so nothing would ever replace it: every new node would get EIO, and a node
holding the right bytes would push "0 B of new blobs".  A reader that
hashes one (``S3Store``'s streamed and batch fetches) leaves a report, an
empty object ``bad/HEX``; ``S3Store.missing_blobs`` lists the reports (at
most once per ``REPORTS_SECONDS``, and in the first upload batch after a
``push`` or ``prefetch`` asked the bucket, not once per batch) and counts a
reported blob as missing, so the next upload of it (at the latest a
``push`` of a node holding it) writes it over, once
the local copy hashes right (a planted report must not let a corrupt local
file replace a good object), and then deletes the report.
"""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, BinaryIO

import blake3

from mithrilfs.shared.stores.s3.conn import obstore_api

if TYPE_CHECKING:
    from mithrilfs.shared.stores.s3.conn import S3Connection

log = logging.getLogger(__name__)

#: Reports read per upload batch (one listing page): more wait for the next batch.
REPORTS_READ = 1000
#: The reports are listed again after this long (or once a user asked the bucket: ``refresh``).
REPORTS_SECONDS = 60.0
_HEX = frozenset("0123456789abcdef")


class BadBlobReports:
    """The ``bad/`` reports of one store (see the module doc); every method runs in the store's threads."""

    def __init__(self, store: S3Connection) -> None:
        self.store = store
        self._listed: set[str] = set()
        self._listed_at: float | None = None

    def refresh(self) -> None:
        """List the reports again at the next ``reported`` (a ``push`` is how a repair is asked for)."""
        self._listed_at = None

    def _key(self, hex_digest: str) -> str:
        return f"bad/{hex_digest}"

    def report(self, hex_digest: str) -> None:
        """A reader found the blob's bytes do not hash to its name.  Best effort: the read fails either way,
        and the next reader reports it again."""
        import obstore.exceptions

        s = self.store
        log.error("blob %s in %s does not match its hash: reported for repair", hex_digest, s.url)
        try:
            s.put_object(s.quick, self._key(hex_digest), b"", "overwrite", 0)
            s.count("remote_bad_blobs_reported")
            self._listed.add(hex_digest)
        except (obstore.exceptions.BaseError, OSError) as e:
            log.warning("cannot report bad blob %s: %s", hex_digest, s.why(e))

    def reported(self) -> set[str]:
        """The blobs reported bad (one listing, at most every ``REPORTS_SECONDS``; what is not a blake3 hex
        name is ignored)."""
        if self._listed_at is not None and time.monotonic() - self._listed_at < REPORTS_SECONDS:
            return set(self._listed)
        listed = self._list()
        self._listed, self._listed_at = listed, time.monotonic()
        return set(listed)

    def _list(self) -> set[str]:
        s = self.store
        prefix = s.base + "bad/"
        pages: Any = obstore_api().list(s.quick, prefix=prefix, chunk_size=REPORTS_READ)
        first: list[Any] = next(iter(pages), [])
        s.level.moved()
        return {h for meta in first if len(h := meta["path"][len(prefix):]) == 64 and set(h) <= _HEX}

    def repaired(self, hex_digest: str) -> None:
        """The blob was written over with bytes that hash to its name: its report goes."""
        s = self.store
        obstore_api().delete(s.quick, s.base + self._key(hex_digest))
        self._listed.discard(hex_digest)
        s.count("remote_blobs_repaired")
        log.warning("blob %s in %s written over with verified bytes (a reader reported it bad)", hex_digest, s.url)


def hashes_to(f: BinaryIO, hex_digest: str) -> bool:
    """Whether an open file's bytes hash to *hex_digest* (read through, then rewound)."""
    hasher = blake3.blake3()
    while chunk := f.read(1 << 20):
        hasher.update(chunk)
    f.seek(0)
    return hasher.hexdigest() == hex_digest
