"""Notifications to the kernel: names and inodes the daemon changed on its own.

A delete, an entry invalidation or an inode invalidation is written to the
FUSE fd by a thread of its own: the kernel takes the directory's lock to
apply one, so writing it from the event loop while a request in that
directory waits on us would deadlock.  ENOENT (nothing cached) is ignored.
Notifications are sent only once INIT is done and until the session stops
(``open``, ``shut``): before INIT the kernel would refuse them, after the
end there is nobody to tell.

Nothing is ever pushed into the page cache (NOTIFY_STORE): a store copies
into the pages whatever they hold, and nothing orders it against a writer
(``mount --push-on-lookup`` lost in-place writes that way and was removed;
docs/design.md).

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
from typing import Any

from . import abi

log = logging.getLogger(__name__)


class Notifier:
    def __init__(self, fd: int) -> None:
        self.fd = fd
        self._open = False
        self._queue: queue.SimpleQueue[tuple[int, list[Any]] | None] = queue.SimpleQueue()
        self._thread = threading.Thread(target=self._loop, name="fuse-notify", daemon=True)
        self._thread.start()

    def open(self) -> None:
        """INIT is done: the kernel accepts notifications from now on."""
        self._open = True

    def shut(self) -> None:
        """The session is stopping: later notifications are dropped."""
        self._open = False

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
        """Drop the kernel's cached attributes and pages of *inode* (length 0: to the end)."""
        self._send(abi.NOTIFY_INVAL_INODE, [abi.NOTIFY_INVAL_INODE_OUT.pack(inode, off, length)])

    def _send(self, code: int, parts: list[Any]) -> None:
        if self._open:
            self._queue.put((code, parts))

    def _loop(self) -> None:
        while (item := self._queue.get()) is not None:
            code, parts = item
            size = 16 + sum(len(p) for p in parts)
            try:
                os.writev(self.fd, [abi.OUT_HEADER.pack(size, code, 0), *parts])
            except OSError as e:
                # ENOENT: the kernel had nothing cached for it; EBADF/ENODEV: the session ended
                if e.errno not in (errno.ENOENT, errno.ENOTDIR, errno.EBADF, errno.ENODEV):
                    log.warning("notification %d failed: %s", code, e)
