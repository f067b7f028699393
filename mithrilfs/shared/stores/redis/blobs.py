"""Blobs in Redis: content in chunks under ``b:{<hex>}:{i}``, streamed, never allocated by a claimed size.

Part of ``stores.redis.store.RedisStore`` (its ``blobs``): fetching (a blob must come
to exactly its entry's size; the caller compares the hash), checking which
are missing, uploading, the hot set's copies of a bucket's blobs, and the
path each blob was first written at (shown by ``fleet`` commands).
"""

from __future__ import annotations

import os
from typing import Any, BinaryIO

from mithrilfs.shared.stores import ages
from mithrilfs.shared.stores.entries import BlobBytes
from mithrilfs.shared.stores.redis.conn import RedisConnection
from mithrilfs.shared.stores.stream import HashedCopy, verified_small

#: Largest chunk of a blob in one Redis value (far below Redis's 512 MB limit).
CHUNK = int(os.environ.get("MITHRILFS_REMOTE_CHUNK_BYTES", 32 << 20))
#: Bytes of small blobs sent in one pipeline.
_PIPELINE_BYTES = 16 << 20


class RedisBlobs:
    """The blob half of a RedisStore, through its connection; every method may raise RemoteError."""

    def __init__(self, conn: RedisConnection, blob_ttl: int | None) -> None:
        self.conn = conn
        self.prefix = conn.prefix
        self.counters = conn.counters
        self.level = conn.level
        #: Seconds a blob stays after its last write or read (in front of a bucket: Redis holds the hot
        #: set, the bucket everything); None: for good.
        self.blob_ttl = blob_ttl

    @property
    def client(self) -> Any:
        return self.conn.client

    def _call(self, fn: Any, *args: Any) -> Any:
        return self.conn.call(fn, *args)

    def _blob_key(self, hex_digest: str, i: int) -> str:
        return self.conn.blob_key(hex_digest, i)

    def note_blob_names(self, names: dict[str, str]) -> None:
        """One key per blob, set only if absent (the first node's path stays), living as long as the blob:
        ``NODE<tab>PATH``."""
        def note() -> None:
            pipe = self.client.pipeline(transaction=False)
            for h, path in names.items():
                pipe.set(f"{self.prefix}bn:{{{h}}}", path.encode(errors="surrogateescape"), nx=True, ex=self.blob_ttl)
            pipe.execute()

        if names:
            self._call(note)

    def blob_names(self, hashes: list[str]) -> dict[str, str]:
        """Paths kept by ``note_blob_names``; a value that is not a plain relative path is ignored (anyone
        with write access to Redis can put one there, and it is only ever shown)."""
        def get() -> list[Any]:
            pipe = self.client.pipeline(transaction=False)
            for h in hashes:
                pipe.get(f"{self.prefix}bn:{{{h}}}")
            return pipe.execute()

        if not hashes:
            return {}
        out = {}
        for h, raw in zip(hashes, self._call(get)):
            path = raw.decode(errors="replace") if isinstance(raw, bytes) else None
            if path and len(path) < 4096 and "\0" not in path and not path.startswith("/") \
                    and ".." not in path.split("/"):
                out[h] = path
        return out

    def fetch_blob(self, hex_digest: str, size: int, out: BinaryIO) -> bytes | None:
        """Stream a blob of *size* bytes into *out*; its blake3, or None when Redis lacks (part of) it.

        Chunk by chunk: memory never depends on the claimed size.  The bytes
        must come to exactly *size*: more is bad data (``b""`` is returned,
        which matches no digest), a missing chunk before the end is a miss.
        The caller compares the digest.
        """
        return self._call(self._fetch_blob, hex_digest, size, out)

    def _fetch_blob(self, hex_digest: str, size: int, out: BinaryIO) -> bytes | None:
        copy = HashedCopy(out, size, self.level)
        i = 0
        while True:
            part = self._get(self.client, self._blob_key(hex_digest, i))
            if part is None:
                return None
            if not copy.take(part):
                return b""
            i += 1
            if copy.done:
                break
        self.counters["remote_fetched_bytes"] += copy.got
        return copy.digest()

    def _get(self, client: Any, key: str) -> Any:
        """GET, or GETEX renewing the blob's time to live (a hot blob stays)."""
        return client.get(key) if self.blob_ttl is None else client.getex(key, ex=self.blob_ttl)

    def _chunk_count(self, size: int) -> int:
        return max(1, -(-size // CHUNK))

    def missing_blobs(self, blobs: dict[str, int]) -> list[str]:
        """Which of these blobs (hex → size) Redis lacks in full: every chunk is checked."""
        if not blobs:
            return []

        timed = self.blob_ttl is None  # alone, Redis keeps blobs for good: ``fleet gc`` deletes old ones

        def check() -> list[str]:
            pipe = self.client.pipeline(transaction=False)
            order = []
            for h, size in blobs.items():
                n = self._chunk_count(size)
                order.append((h, n))
                for i in range(n):
                    pipe.exists(self._blob_key(h, i))
                if timed:
                    pipe.zscore(self.conn.blob_times_key, h)
            flags = iter(pipe.execute())
            now = self.conn.clock.now()
            out = []
            for h, n in order:
                whole = all([bool(next(flags)) for _ in range(n)])
                written = next(flags) if timed else None
                # a blob written long ago (or before times were kept) may be gc's next: written again
                if not whole or (timed and (written is None or not ages.younger(now - float(written),
                                                                                    ages.BLOB_TRUST_SECONDS))):
                    out.append(h)
            return out

        return self._call(check)

    def upload_blobs(self, files: list[tuple[str, str]]) -> set[str]:
        """Upload blobs (hex, file path; "" for empty content); the hashes whose files were gone.

        Small blobs share pipelines of up to ``_PIPELINE_BYTES``; a large one
        is sent a chunk at a time, so memory stays bounded by the chunk size.
        """
        gone = self._call(self._upload_blobs, files)
        self.level.wrote()
        return gone

    def _upload_blobs(self, files: list[tuple[str, str]]) -> set[str]:
        gone: set[str] = set()
        pipe = self.client.pipeline(transaction=False)
        pending = 0
        for h, path in files:
            try:
                f = open(path, "rb") if path else None
            except FileNotFoundError:
                gone.add(h)  # evicted before it could be uploaded: publish nothing for it
                continue
            try:
                i = 0
                while True:
                    part = f.read(CHUNK) if f is not None else b""
                    if not part and i:
                        break
                    if i == 0 and self.blob_ttl is None:
                        # when it was written (gc's grace, ``fleet.usage``), before its bytes: a gc deleting
                        # the old copy meanwhile either goes first or sees it young
                        pipe.zadd(self.conn.blob_times_key, {h: self.conn.clock.now()})
                    pipe.set(self._blob_key(h, i), part, ex=self.blob_ttl)
                    pending += len(part)
                    self.counters["remote_uploaded_bytes"] += len(part)
                    self.level.moved(up=len(part), requests=0)
                    i += 1
                    if pending >= _PIPELINE_BYTES:
                        pipe.execute()
                        pending = 0
                    if len(part) < CHUNK:
                        break
            finally:
                if f is not None:
                    f.close()
        pipe.execute()
        return gone

    def put_blobs(self, blobs: list[tuple[str, BlobBytes]]) -> None:
        """Small verified blobs (one chunk each) read from the store behind Redis: into the hot set."""
        def put() -> None:
            pipe = self.client.pipeline(transaction=False)
            for h, data in blobs:
                pipe.set(self._blob_key(h, 0), data, ex=self.blob_ttl)
                self.level.moved(up=len(data), requests=0)
            pipe.execute()

        if blobs:
            self._call(put)

    def fetch_small_blobs(self, blobs: list[tuple[str, int]]) -> list[BlobBytes | None]:
        """Single-chunk blobs (hex, size), one pipelined GET each, verified; None where missing or bad."""
        def get() -> list[bytes | None]:
            pipe = self.client.pipeline(transaction=False)
            for h, _ in blobs:
                self._get(pipe, self._blob_key(h, 0))
            return pipe.execute()

        return verified_small(blobs, self._call(get), self.level, self.counters)
