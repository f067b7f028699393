"""Notifications to the kernel: names and inodes the daemon changed on its own.

A delete, an entry invalidation or an inode invalidation is written to the
FUSE fd by a thread of its own: the kernel takes the directory's lock to
apply one, so writing it from the event loop while a request in that
directory waits on us would deadlock.  ENOENT (nothing cached) is ignored.
Notifications are sent only once INIT is done and until the session stops
(``open``, ``shut``): before INIT the kernel would refuse them, after the
end there is nobody to tell.

``store`` pushes a file's content into the kernel's page cache
(NOTIFY_STORE) so that its first read needs no READ.  The kernel copies a
store into pages whatever they hold, so a store must never land on content
newer than its own: before a file's content changes the filesystem calls
``withdraw``, which drops a store not written yet and, for one being
written at that moment, queues an inode invalidation right after it (the
queue is written in order), so the kernel reads the new content.

A ``Notifier`` exists before the filesystem that uses it (it needs only the
fd), so the daemon builds it first and passes it in; the session opens and
shuts it.
"""

from __future__ import annotations

import errno
import logging
import os
import queue
import threading
import time
from typing import Any

from . import abi

log = logging.getLogger(__name__)


_QUEUED, _WRITING = 0, 1
#: How long a store the kernel refused waits before each new try (the process that looked the file up
#: makes the inode once it runs again after our reply: under load, that can take a few milliseconds).
STORE_RETRY_SECONDS = (50e-6, 200e-6, 1e-3, 4e-3)
#: Stores queued at once, in bytes, at most.
MAX_QUEUED_STORE_BYTES = 64 << 20


class Notifier:
    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._open = False
        self._queue: queue.SimpleQueue[tuple[int, list[Any]] | None] = queue.SimpleQueue()
        #: Stores queued or being written, by inode: [state] (``withdraw`` reads and changes it).
        self._stores: dict[int, list[int]] = {}
        self._stores_lock = threading.Lock()
        #: Bytes of stores queued: past ``MAX_QUEUED_STORE_BYTES`` new ones are not made (a burst of lookups
        #: must not hold the content of every file in memory, nor keep deletes waiting behind it).
        self._queued_bytes = 0
        #: Stores the kernel took, and those it refused (it did not hold the inode yet, or any more).
        self.stored = 0
        self.store_missed = 0
        #: Attempts the kernel refused before it took a store (the inode not made yet).
        self.store_retries = 0
        self._thread = threading.Thread(target=self._loop, name="fuse-notify", daemon=True)
        self._thread.start()

    def open(self) -> None:
        """INIT is done: the kernel accepts notifications from now on."""
        self._open = True

    def shut(self) -> None:
        """The session is stopping: later notifications are dropped, and so are stores not written yet (a
        daemon taking over would not know to withdraw them)."""
        self._open = False
        with self._stores_lock:
            self._stores.clear()

    def close(self) -> None:
        """Stop the thread once what was queued is written (the fd belongs to whoever mounted)."""
        self._open = False
        self._queue.put(None)
        self._thread.join(timeout=5)

    def delete(self, parent: int, child: int, name: bytes) -> None:
        """The daemon removed *name* from *parent* on its own: drop the kernel's dentry (and child's cache)."""
        self._send(abi.NOTIFY_DELETE, [abi.NOTIFY_DELETE_OUT.pack(parent, child, len(name), 0), name, b"\0"])

    def invalidate_entry(self, parent: int, name: bytes) -> None:
        """Make the kernel look *name* up again (it appeared, or points elsewhere now)."""
        self._send(abi.NOTIFY_INVAL_ENTRY, [abi.NOTIFY_INVAL_ENTRY_OUT.pack(parent, len(name), 0), name, b"\0"])

    def invalidate_inode(self, inode: int, off: int = 0, length: int = 0) -> None:
        """Drop the kernel's cached attributes and pages of *inode* (length 0: to the end).

        A store of *inode* not written yet is dropped first: it would put back what this takes away.
        """
        if self._stores:
            with self._stores_lock:
                self._stores.pop(inode, None)
        self._send(abi.NOTIFY_INVAL_INODE, [abi.NOTIFY_INVAL_INODE_OUT.pack(inode, off, length)])

    def store(self, inode: int, data: bytes | memoryview) -> None:
        """Put *data*, the whole content of *inode*, into the kernel's page cache (see the module doc).

        Only for an inode the kernel has just been told of (so it holds no
        pages of it yet); the kernel refuses a store for an inode it does not
        hold (ENOENT), and the file's first read then asks as usual.
        """
        if not self._open or self._queued_bytes + len(data) > MAX_QUEUED_STORE_BYTES:
            return
        state = [_QUEUED]
        with self._stores_lock:
            self._stores[inode] = state
            self._queued_bytes += len(data)
        self._queue.put((abi.NOTIFY_STORE, [inode, data, state]))

    def withdraw(self, inode: int) -> None:
        """*inode*'s content is about to change: no store of its old content may land after this."""
        if not self._stores:
            return
        with self._stores_lock:
            state = self._stores.pop(inode, None)
        if state is not None and state[0] == _WRITING:
            self.invalidate_inode(inode)  # written after the store: the kernel drops what it put there

    def _store(self, inode: int, data: bytes | memoryview, state: list[int]) -> None:
        """Write one store unless withdrawn.  The kernel may not hold the inode yet (the process that
        looked it up makes it after our reply), so a refused store is tried again after each pause of
        ``STORE_RETRY_SECONDS``."""
        try:
            parts = [abi.OUT_HEADER.pack(16 + abi.NOTIFY_STORE_OUT.size + len(data), abi.NOTIFY_STORE, 0),
                     abi.NOTIFY_STORE_OUT.pack(inode, 0, len(data), 0), data]
            for attempt, pause in enumerate((*STORE_RETRY_SECONDS, None)):
                with self._stores_lock:
                    if self._stores.get(inode) is not state or not self._open:
                        return  # withdrawn (the content changes), or the session is stopping
                    state[0] = _WRITING
                try:
                    os.writev(self.fd, parts)
                    self.stored += 1
                    self.store_retries += attempt
                    return
                except FileNotFoundError:
                    if pause is None:
                        self.store_missed += 1
                        return
                with self._stores_lock:
                    state[0] = _QUEUED
                time.sleep(pause)
        except OSError as e:
            if e.errno not in (errno.EBADF, errno.ENODEV):
                log.warning("pushing inode %d into the page cache failed: %s", inode, e)
        except Exception:  # the thread must go on: a push is only a head start
            log.exception("pushing inode %d into the page cache failed", inode)
        finally:
            with self._stores_lock:
                self._queued_bytes -= len(data)
                if self._stores.get(inode) is state:
                    del self._stores[inode]

    def pushes(self) -> dict[str, int]:
        """Stores the kernel took and refused (``stats``: how often a first read was spared)."""
        return {"pushed_files": self.stored, "push_missed": self.store_missed, "push_retries": self.store_retries}

    def _send(self, code: int, parts: list[Any]) -> None:
        if self._open:
            self._queue.put((code, parts))

    def _loop(self) -> None:
        while (item := self._queue.get()) is not None:
            code, parts = item
            if code == abi.NOTIFY_STORE:
                self._store(*parts)
                continue
            size = 16 + sum(len(p) for p in parts)
            try:
                os.writev(self.fd, [abi.OUT_HEADER.pack(size, code, 0), *parts])
            except OSError as e:
                # ENOENT: the kernel had nothing cached for it; EBADF/ENODEV: the session ended
                if e.errno not in (errno.ENOENT, errno.ENOTDIR, errno.EBADF, errno.ENODEV):
                    log.warning("notification %d failed: %s", code, e)
