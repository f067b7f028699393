"""A prefetch's batches not yet taken by its workers: in the prefetch's order, following its reader.

The prefetch cuts what it fetches into batches (``warm.prefetch.Todo``) and
its workers take them one after another.  A read of a file whose blob is in
a batch nobody has taken yet does not fetch the blob on its own, one round
trip for one file while the prefetch brings the rest: the batch is taken
out of turn and started at once (``hurry``), the read waits for it as for
any blob on its way (``sync.in_flight``), and the workers go on with the
batches after it, where a workload that reads in the set's order reads
next.  The batches it passed are taken after those (``take``): the
prefetch still brings everything, in the order its reader needs it.
"""

from __future__ import annotations

from collections.abc import Callable

import trio

from mithrilfs.store.namespace import Inode


class Batches:
    """The batches of one prefetch not yet taken (see the module doc); *start* fetches a hurried batch,
    at once, beside the workers."""

    def __init__(self, start: Callable[[list[Inode]], None]) -> None:
        self._start = start
        self._batches: list[list[Inode] | None] = []
        #: Each queued content's batch (by index; a taken batch's entry is None).
        self._of: dict[bytes, int] = {}
        #: Where the workers go on: the first batch that may be waiting after the last one hurried.
        self._next = 0
        #: The first batch that may be waiting at all (those a hurried batch passed).
        self._first = 0
        self._closed = False
        self._more = trio.Event()

    def put(self, batch: list[Inode]) -> None:
        """Queue *batch* after the others."""
        at = len(self._batches)
        self._batches.append(batch)
        for node in batch:
            if node.hash is not None:
                self._of[node.hash] = at
        self._wake()

    def close(self) -> None:
        """No more batches come: the workers end once the queued ones are taken."""
        self._closed = True
        self._wake()

    def _wake(self) -> None:
        self._more.set()
        self._more = trio.Event()

    async def next(self) -> list[Inode] | None:
        """The batch a worker takes next (waiting for one); None when all are taken and none will come."""
        while True:
            batch = self.take()
            if batch is not None or self._closed:
                return batch
            await self._more.wait()

    def take(self) -> list[Inode] | None:
        """The first batch waiting after the last one hurried, else the first waiting at all, else None."""
        self._next = self._waiting_from(self._next)
        if self._next < len(self._batches):
            return self._pop(self._next)
        self._first = self._waiting_from(self._first)
        return self._pop(self._first) if self._first < len(self._batches) else None

    def hurry(self, digest: bytes) -> bool:
        """If *digest* is in a batch still waiting, start that batch now and have the workers go on after
        it; whether it did (the blob is on its way then)."""
        at = self._of.get(digest)
        if at is None or self._batches[at] is None:
            return False
        batch = self._pop(at)
        self._next = at + 1
        self._start(batch)
        return True

    def _waiting_from(self, at: int) -> int:
        while at < len(self._batches) and self._batches[at] is None:
            at += 1
        return at

    def _pop(self, at: int) -> list[Inode]:
        batch = self._batches[at]
        assert batch is not None
        self._batches[at] = None
        return batch
