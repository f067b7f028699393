"""What this node owes the tier: names to publish and tombstones to send, queued in the index.

A commit or rename queues the inode (``queue_upload``, ``queue_tree``), a
user's unlink, rmdir or rename of a published name queues its tombstone
(``removing``); both queues live in the index (``store.tier_queue``), so
they survive unmounts and crashes.  The uploader (``write_behind``) waits
here for something to send (``wait``) and says what it sent.  A removed
path whose tombstone is not sent yet (``pending_tombstones``) is never
materialized again meanwhile (``reconcile``).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager

import trio

from mithrilfs.shared.stores.clock import TierClock
from mithrilfs.store.namespace import ROOT_INODE, DirPaths, Namespace, join_path
from mithrilfs.store.tier_queue import TierQueue

#: A queued name waits this long before it is sent (a temporary name renamed away never is).
UPLOAD_DELAY = 0.3


def made_here(ns: Namespace, d: int) -> bool:
    """A directory this node made and has not published: the tier has no manifest of it to read, unless
    another node made the same one meanwhile."""
    names = ns.names_of(d) if d != ROOT_INODE else []
    return bool(names) and not ns.is_published(*names[0])


class Outbox:
    """The index's upload queue and tombstones, and the event that wakes the uploader (see the module doc)."""

    def __init__(self, ns: Namespace, queue: TierQueue, paths: DirPaths, clock: TierClock) -> None:
        self.ns = ns
        self.queue = queue
        self.paths = paths
        self.clock = clock
        #: Removed paths whose tombstones are not sent yet: never materialized again meanwhile.
        self.pending_tombstones: dict[str, int] = dict(queue.tombstones())
        #: (parent, name) of the batch being sent: not published yet, but a removal now must still tombstone
        #: them (a writer renaming its temporary file while its batch was on the wire left it in the tier)
        self.sending: frozenset[tuple[int, bytes]] = frozenset()
        self._wake = trio.Event()

    def queue_upload(self, ino: int) -> None:
        self.queue.add([ino], time.time_ns())
        self._wake.set()

    def queue_tree(self, d: int) -> None:
        """Queue every file and symlink under directory *d* (it was renamed: their paths changed)."""
        stack, found = [d], list[int]()
        while stack:
            for _, child in self.ns.children(stack.pop()):
                node = self.ns.get(child)
                if node is not None:
                    (stack if node.is_dir else found).append(child)
        self.queue.add(found, time.time_ns())
        self._wake.set()

    def removing(self, parent: int, name: bytes) -> None:
        """A user or framework is about to remove a name: if it was published, queue its tombstone.

        Evictions do not come here: a name evicted locally stays valid for
        other nodes.  A name in the batch on its way is as good as published.
        """
        if (parent, name) not in self.sending and not self.ns.is_published(parent, name):
            return
        dir_path = self.paths.of_dir(parent)
        if dir_path is None:
            return
        path = join_path(dir_path, name)
        version = self.clock.now_us()
        self.queue.add_tombstone(path, version)
        self.pending_tombstones[path] = version
        self._wake.set()

    def owe_tombstones(self, paths: list[str], version: int) -> None:
        """Tombstones of *paths* at *version* to send, in one transaction (a purge the tier did not take)."""
        with self.ns.txn():
            for path in paths:
                self.queue.add_tombstone(path, version)
                self.pending_tombstones[path] = version
        self._wake.set()

    def queue_all(self, *, unpublished_only: bool = False) -> int:
        """Queue every named file and symlink (``push``, or after the tier lost its data); *unpublished_only*:
        those never published nor taken from the tier."""
        with self.ns.txn():
            n = self.queue.add_all(time.time_ns(), int(UPLOAD_DELAY * 1e9), unpublished_only=unpublished_only)
        self._wake.set()
        return n

    def holds(self, ino: int) -> bool:
        """Whether inode *ino* waits in the queue."""
        return self.queue.holds(ino)

    def pending(self) -> int:
        return self.queue.length()

    @contextmanager
    def on_the_way(self, names: list[tuple[int, bytes]]) -> Iterator[None]:
        """While a batch is sent: its names count as published for ``removing``."""
        self.sending = frozenset(names)
        try:
            yield
        finally:
            self.sending = frozenset()

    def tombstones_sent(self, tombs: list[tuple[str, int]]) -> None:
        """The tier holds these tombstones now: their paths may be materialized again."""
        for path, _ in tombs:
            self.pending_tombstones.pop(path, None)

    async def wait(self, seconds: float) -> None:
        """Wait until something is queued (since the last wait) or *seconds* pass."""
        with trio.move_on_after(seconds):
            await self._wake.wait()
        self._wake = trio.Event()
