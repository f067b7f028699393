"""Empty files made ahead: a blob's file is written without its create on the caller's path.

Creating a file allocates an inode, and on a journal-less ext4 (this
project's development VM) the allocator skips every inode freed in the last
30 seconds (``recently_deleted``), reading its table block: on a disk whose
files come and go that was most of a rename's time in the daemon
(docs/benchmarks.md, "N-blanks").  ``BlankFiles`` keeps empty, nameless
files (``O_TMPFILE`` in ``staging/``) made by a thread of their own: the create's
system call runs without the GIL, on another CPU, while the event loop
answers the next request, and a nameless file locks no directory, so the
loop's own directory changes never wait for it.  A commit takes one, writes
the blob's bytes into it and links it under the blob's name
(``blob_writer_child.fill_and_link``): the blob appears whole, in one
directory change.  A blank never taken vanishes with its descriptor (at
``close``, or with a killed daemon): nothing is left to clear.

``NO_BLANKS`` is the null implementation (``take`` finds none): everything
but a mounted daemon writes blobs with a create of their own.
"""

from __future__ import annotations

import collections
import errno
import logging
import os
import threading
from collections.abc import Callable

from mithrilfs.store.blob_writer_child import BLOB_MODE

log = logging.getLogger(__name__)

#: Blanks kept ready at most; the thread makes more when half or fewer are left.
DEPTH = 64
#: Blanks kept ready at first (``BlankFiles``).
FIRST_KEPT = 4


class Blanks:
    """Where a blob's writer finds an empty file made ahead, if one is ready."""

    def take(self) -> int | None:
        """A descriptor on an empty nameless file (``O_TMPFILE``, mode ``BLOB_MODE``) opened for writing on
        the store's disk, or None: the caller creates its own file."""
        return None

    def refused(self, error: OSError) -> None:
        """A blank could not be linked (a filesystem that makes nameless files but links none across
        ``/proc``): no more are taken."""

    def close(self) -> None:
        """Stop making blanks and close those not taken."""


NO_BLANKS = Blanks()


class BlankFiles(Blanks):
    """Blanks made in the directory *staging* by a thread, as many as the writers use, up to *depth*.

    The thread starts at the first ``take``: a mount that writes nothing makes none.  It keeps
    ``FIRST_KEPT`` ready at first, and twice as many each time a ``take`` finds none (a burst of commits
    outran it), up to *depth*; a store that takes a few blobs makes a few blanks.  Reaching *depth*, it
    runs *burst* once (``CAS.make_shards``: the directories the blobs go to, made off the caller's path
    too; a mkdir costs what a create does).  Where the filesystem makes no nameless files (``O_TMPFILE``:
    ext4, xfs, btrfs and tmpfs do), it stops at the first refusal and every ``take`` finds none.
    """

    def __init__(self, staging: str | os.PathLike[str], depth: int = DEPTH,
                 burst: Callable[[], None] = lambda: None) -> None:
        self._dir = os.fspath(staging)
        self._burst = burst
        self._depth = depth
        #: How many the thread keeps ready now.
        self._kept = min(FIRST_KEPT, depth)
        self._ready: collections.deque[int] = collections.deque()
        #: Whether a ``take`` came before (the first finds none: it starts the thread, and is no burst).
        self._started = False
        self._wanted = threading.Event()
        self._closed = False
        self._thread = threading.Thread(target=self._make, name="blank-files", daemon=True)
        self._thread.start()

    def take(self) -> int | None:
        if self._closed:
            return None
        try:
            blank: int | None = self._ready.popleft()
        except IndexError:
            blank = None
            if self._started:
                self._kept = min(self._kept * 2, self._depth)
        self._started = True
        if len(self._ready) <= self._kept // 2:
            self._wanted.set()
        return blank

    def _make(self) -> None:
        if not os.path.isdir("/proc/self/fd"):  # a blank is linked through it (``fill_and_link``)
            log.info("no blank files made ahead: /proc is not mounted")
            return
        burst_done = False
        while not self._closed:
            self._wanted.wait()
            self._wanted.clear()
            if self._kept == self._depth and not burst_done:
                burst_done = True
                try:
                    self._burst()
                except OSError as e:  # the writers make what they need themselves
                    log.debug("the blanks' burst: %s", e)
            while len(self._ready) < self._kept and not self._closed:
                try:
                    fd = os.open(self._dir, os.O_WRONLY | os.O_TMPFILE | os.O_CLOEXEC, BLOB_MODE)
                except OSError as e:  # no nameless files here, or no inode left: the writers create their own
                    if e.errno in (errno.EOPNOTSUPP, errno.EISDIR, errno.EINVAL):
                        log.info("no blank files made ahead in %s: %s", self._dir, e.strerror)
                        return
                    break
                self._ready.append(fd)

    def refused(self, error: OSError) -> None:
        if not self._closed:
            log.warning("no blank files made ahead in %s: linking one failed (%s)", self._dir, error)
        self._closed = True
        self._wanted.set()

    def close(self) -> None:
        self._closed = True
        self._wanted.set()
        self._thread.join()
        while self._ready:
            os.close(self._ready.popleft())
