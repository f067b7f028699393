"""What this node last saw of each directory's manifest in a bucket: a publish merges into it without a GET.

A publish is a compare-and-swap per directory (``stores.s3.store``): read
the manifest and its ETag, merge, put ``If-Match``.  Read first every time,
that is two requests per directory per batch, and a writer's batches come
every few hundred milliseconds.  But most of the time the last
state this node read or wrote *is* the current one: it is usually the only
writer of a directory.  So the state of each manifest as last read or
written (its entries and ETag) is kept, and a publish merges into it and
puts ``If-Match`` that ETag at once; another writer in between makes it a
412, and the publish reads and merges again, as before.  A publish that
changes nothing in the kept state sends nothing at all (an ancestor's
entry, written again with every batch).  A directory never seen is tried
as absent (``If-None-Match: *``), which a new directory is.

Kept by bytes (``SEEN_BYTES``), oldest forgotten first; manifests larger
than a quarter of that are not kept.  Forgotten whole when the bucket's
epoch changes (emptied).  The price: a publish that changes nothing does
not learn, in that moment, of a newer entry another node wrote over its
own; it learns it at its next sync of that directory, like any reader.
"""

from __future__ import annotations

import threading

#: Bytes of manifests kept (names and entries).
SEEN_BYTES = 64 << 20


class SeenManifests:
    """directory -> (raw entries, ETag) as last read or written (see the module doc); thread-safe."""

    def __init__(self, limit: int = SEEN_BYTES) -> None:
        self.limit = limit
        self._lock = threading.Lock()
        self._seen: dict[str, tuple[dict[bytes, bytes], str, int]] = {}
        self._bytes = 0

    def get(self, dir_path: str) -> tuple[dict[bytes, bytes], str] | None:
        """A copy of the kept state (the caller merges into it), None when not kept."""
        with self._lock:
            got = self._seen.get(dir_path)
            return (dict(got[0]), got[1]) if got is not None else None

    def saw(self, dir_path: str, raw: dict[bytes, bytes], etag: str | None) -> None:
        """The manifest holds *raw* under *etag* now (read, or just written); None: no ETag, not kept."""
        size = sum(len(k) + len(v) for k, v in raw.items())
        with self._lock:
            self._drop(dir_path)
            if etag is None or size > self.limit // 4:
                return
            self._seen[dir_path] = (dict(raw), etag, size)
            self._bytes += size
            while self._bytes > self.limit:
                self._drop(next(iter(self._seen)))

    def forget(self, dir_path: str) -> None:
        with self._lock:
            self._drop(dir_path)

    def forget_all(self) -> None:
        with self._lock:
            self._seen.clear()
            self._bytes = 0

    def _drop(self, dir_path: str) -> None:
        old = self._seen.pop(dir_path, None)
        if old is not None:
            self._bytes -= old[2]
