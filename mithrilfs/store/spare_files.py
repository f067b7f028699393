"""Empty files made ahead of need by a thread of their own, for blob files written from memory.

Writing a small blob costs a create on the backing filesystem (an inode to
allocate, which on ext4 may scan past many recently deleted ones), a write
and a rename; a commit at a rename does it on the event loop while the
client waits.  ``SpareFiles`` keeps up to ``SPARE_FILES`` empty files ready
in the store's ``spare/`` directory, made by a thread whenever fewer than
half are left, so ``CAS.write_blob`` writes into one and renames it into
``objects/``.  With none ready (a burst, a full disk, a store that cannot
be written) the caller makes its own file, as it would without spares.

A spare holds no content, so a crash can only leave empty files, which the
next mount removes (``CAS.clear_staging``); ``close`` removes those left.
The thread starts at the first ``take``: tools that never write a blob
never start it.
"""

from __future__ import annotations

import logging
import os
import threading
import uuid
from collections import deque

log = logging.getLogger(__name__)

#: At most this many spare files are kept ready.
SPARE_FILES = 64


class SpareFiles:
    """Empty files in *directory* (a path ending in its separator), each open for writing, made ahead."""

    def __init__(self, directory: str, mode: int, count: int = SPARE_FILES) -> None:
        self._dir = directory
        self._mode = mode
        self._count = count
        #: (fd, path) of files ready; appended by the thread, taken by any other (a deque is safe for both).
        self._ready: deque[tuple[int, str]] = deque()
        self._wanted = threading.Event()
        self._closed = False
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()

    def take(self) -> tuple[int, str] | None:
        """A spare's (fd, path), now the caller's to write, rename and close; None when none is ready."""
        try:
            spare = self._ready.popleft()
        except IndexError:
            spare = None
        if len(self._ready) < self._count // 2 and not self._closed:
            self._start()
            self._wanted.set()
        return spare

    def _start(self) -> None:
        if self._thread is not None:
            return
        with self._lock:
            if self._thread is None and not self._closed:
                self._thread = threading.Thread(target=self._run, name="mithrilfs-spare-files", daemon=True)
                self._thread.start()

    def _run(self) -> None:
        try:
            os.makedirs(self._dir, mode=0o700, exist_ok=True)  # a store made before spares were
        except OSError:
            pass
        while True:
            self._wanted.wait()
            self._wanted.clear()
            while not self._closed and len(self._ready) < self._count:
                path = f"{self._dir}{uuid.uuid4().hex}"
                try:
                    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, self._mode)
                except OSError as e:  # a full disk, a store that cannot be written: callers make their own
                    log.debug("no spare file (%s)", e)
                    break
                self._ready.append((fd, path))
            if self._closed:
                self._drain()
                return

    def close(self) -> None:
        """Stop making spares and remove those ready (a second call does nothing)."""
        self._closed = True
        thread = self._thread
        if thread is not None:
            self._wanted.set()
            thread.join()
        self._drain()

    def _drain(self) -> None:
        while True:
            try:
                fd, path = self._ready.popleft()
            except IndexError:
                return
            os.close(fd)
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
