"""One blob's bytes streamed from a store into a file: bounded by its size, hashed and counted as they come.

Every store streams a blob the same way (``RemoteStore.fetch_blob``): the
pieces go into *out* as they arrive, never held whole, so memory does not
depend on the size an entry claims; each is counted on the store's level
as it arrives (the bound on a wait sees progress); a piece that would pass
the size, or an empty one before the end, is bad data; so are fewer bytes
than the size.  The blake3 is the caller's to compare: bad data gives
``b""``, which matches no digest.
"""

from __future__ import annotations

import logging
from typing import BinaryIO

import blake3

from mithrilfs.shared.stores.base import Level
from mithrilfs.shared.stores.entries import BlobBytes

log = logging.getLogger(__name__)


class HashedCopy:
    """The bytes of one blob of *size* bytes copied into *out* (see the module doc)."""

    def __init__(self, out: BinaryIO, size: int, level: Level) -> None:
        self.out = out
        self.size = size
        self.level = level
        self.got = 0
        self._hasher = blake3.blake3()

    def take(self, part: bytes) -> bool:
        """Copy *part* into *out*; False (nothing copied) when it is bad data: more than the size has left, or
        empty before the end."""
        if len(part) > self.size - self.got or (not part and self.got < self.size):
            return False
        self._hasher.update(part)
        self.out.write(part)
        self.got += len(part)
        self.level.moved(down=len(part), requests=0)
        return True

    @property
    def done(self) -> bool:
        """Whether the size has come (a store that asks piece by piece stops here)."""
        return self.got == self.size

    def digest(self) -> bytes:
        """The blake3 of what came; ``b""`` when it is fewer bytes than the size."""
        return self._hasher.digest() if self.done else b""


def verified_small(blobs: list[tuple[str, int]], got: list[bytes | None], level: Level,
                   counters: dict[str, int]) -> list[BlobBytes | None]:
    """Small blobs (hex, size) as a store read them whole (None: missing), each kept only at its size and
    blake3 (``RemoteStore.fetch_small_blobs``): a bad one is counted (``remote_verify_failures``), logged and
    None; a good one is counted as fetched."""
    out: list[BlobBytes | None] = []
    for (h, size), data in zip(blobs, got):
        ok = data is not None and len(data) == size and blake3.blake3(data).hexdigest() == h
        if data is not None and not ok:  # another size or other bytes than its entry says: bad data
            counters["remote_verify_failures"] += 1
            log.error("remote blob %s does not match its hash: rejected", h)
        out.append(data if ok else None)
        if ok:
            counters["remote_fetched_bytes"] += size
            level.moved(down=size, requests=0)
    return out
