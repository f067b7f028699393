"""Small blobs fetched in batches: one request (a pipeline, a pack's ranges) for many, verified, written.

The read-ahead, the look-ahead (``in_flight``) and the prefetch's workers
(``warm.prefetch``) all bring small blobs this way: the blobs of a batch
come in one request of the store (``RemoteStore.fetch_small_blobs``), each
verified (size and blake3) by the store that read it; their rows are
recorded, then their files written by the store's writing process, one
batch at a time; the names that claim another size for a blob that arrived
go (*arrived*: ``Reconciler.arrived``).
"""

from __future__ import annotations

from collections.abc import Callable

import trio

from mithrilfs.shared.stores.base import RemoteStore
from mithrilfs.shared.stores.entries import BlobBytes
from mithrilfs.store.blobs import Blobs
from mithrilfs.store.namespace import DirPaths, Inode, Namespace


class SmallBlobs:
    """Batches of small blobs from *remote* into *blobs* (see the module doc)."""

    def __init__(self, *, ns: Namespace, paths: DirPaths, blobs: Blobs, remote: RemoteStore,
                 arrived: Callable[[list[tuple[bytes, int]]], None]) -> None:
        self.ns = ns
        self.paths = paths
        self.blobs = blobs
        self.remote = remote
        #: Told the contents (digest, size) now in the store.
        self.arrived = arrived
        #: One thread writes the blobs' files, a batch at a time (``_write``).
        self._writer = trio.CapacityLimiter(1)

    async def fetch(self, batch: list[Inode], limiter: trio.CapacityLimiter) -> list[bool]:
        """One batch of small blobs: fetched in a thread, verified, recorded, written; which arrived.

        The blobs are taken (hash, size) from the inodes now, on the event loop: an inode is the index's
        live object, and a read that fails meanwhile drops its content (its hash becomes None).
        """
        blobs = [(node.hash, node.size) for node in batch if node.hash is not None]
        if len(blobs) < len(batch):  # content dropped since it was claimed: fetched at its next read
            return [False] * len(batch)
        unplaced = self._directories_to_relearn(batch)
        if unplaced:  # named without where their blobs are (a set recorded by a node that never fetched them)
            await trio.to_thread.run_sync(self.remote.list_dirs, unplaced, limiter=limiter)
        fetched = await trio.to_thread.run_sync(self._fetch_batch, blobs, limiter=limiter)
        good = [(digest, size, data) for (digest, size), data in zip(blobs, fetched) if data is not None]
        self.blobs.intend([(digest, size) for digest, size, _ in good])
        new: list[bool] = []
        try:
            await trio.to_thread.run_sync(self._write, good, new, limiter=self._writer)
        finally:  # a full disk stops the batch: what was written counts, the rest is fetched when read
            for (digest, size, _), is_new in zip(good, new):
                self.blobs.written(digest, size, is_new)
            self.arrived([(digest, size) for digest, size, _ in good[:len(new)]])
            if len(new) < len(good):
                self.blobs.never_came([digest for digest, _, _ in good[len(new):]])
        return [data is not None for data in fetched]

    def _directories_to_relearn(self, batch: list[Inode]) -> list[str]:
        """The directories of the blobs the store cannot find by their hash alone: a bucket's packs are found
        from the entries (``stores.s3.packs``), so their manifests are read first (one request each, the batch's
        files sharing a few directories).  Stores that find blobs by hash: none."""
        dirs: set[str] = set()
        for node in batch:
            if node.hash is not None and not self.remote.placement.knows_where(node.hash.hex()):
                names = self.ns.names_of(node.id)
                d = self.paths.of_dir(names[0][0]) if names else None
                if d is not None:
                    dirs.add(d)
        return sorted(dirs)

    def _fetch_batch(self, blobs: list[tuple[bytes, int]]) -> list[BlobBytes | None]:
        """In a worker thread: one pipelined GET (or a pack's ranges) for the batch, each blob verified (size
        and blake3) by the store that read it (``RemoteStore.fetch_small_blobs``)."""
        return self.remote.fetch_small_blobs([(digest.hex(), size) for digest, size in blobs])

    def _write(self, good: list[tuple[bytes, int, BlobBytes]], new: list[bool]) -> None:
        """The verified blobs become files (their rows were recorded first); *new* gets, in order, whether
        each was new, up to the one whose write failed (a full disk).

        In one thread, one batch at a time, handed to the store's writing
        process while a prefetch runs (``blob_writer``: from a thread of
        this process, each blob's system calls would wait for the event
        loop's lock); creating the files from several threads at once is
        slower (they contend for the same directories), and on the event
        loop it would take most of the loop's time.
        """
        self.blobs.writer.write([(digest, data) for digest, _, data in good], new)
