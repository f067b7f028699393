"""Backing files for FUSE passthrough: the ``/dev/fuse`` ioctls that register and drop them.

An OPEN reply with ``FOPEN_PASSTHROUGH`` and a backing id makes the
kernel serve that open's reads and mmap from the backing file itself; the
daemon sees no READ for it.  ``open`` registers an open file descriptor
(``FUSE_DEV_IOC_BACKING_OPEN``: the kernel takes its own reference, so the
caller may close its fd at once) and returns the id; ``close`` drops the
id (``FUSE_DEV_IOC_BACKING_CLOSE``): opens already using it keep their
file.  The kernel allows it only to a daemon with CAP_SYS_ADMIN on a
connection whose INIT agreed ``PASSTHROUGH``; a refusal is returned as
None and said once in the log (``refused`` keeps why), never raised.
"""

from __future__ import annotations

import errno
import fcntl
import logging
import os
import struct

from . import abi

log = logging.getLogger(__name__)

_ID = struct.Struct("<I")


class BackingFiles:
    """Register and drop backing files on the FUSE connection *fd*."""

    def __init__(self, fd: int) -> None:
        self.fd = fd
        #: Why the kernel refused a registration (the first refusal), or None.
        self.refused: str | None = None

    def open(self, file_fd: int) -> int | None:
        """The backing id of the open file *file_fd*; None when the kernel refuses (logged once)."""
        try:
            # a mutable buffer: ioctl returns the call's result (the id), not the buffer
            backing_id = fcntl.ioctl(self.fd, abi.DEV_IOC_BACKING_OPEN, bytearray(abi.BACKING_MAP.pack(file_fd, 0, 0)),
                                     True)
        except OSError as e:
            if self.refused is None:
                self.refused = f"the kernel refused a backing file: {os.strerror(e.errno or errno.EIO)}"
                log.warning("passthrough: %s; files are served through the page cache", self.refused)
            return None
        return int(backing_id)

    def close(self, backing_id: int) -> None:
        """Drop *backing_id*; opens that use it keep reading their file."""
        try:
            fcntl.ioctl(self.fd, abi.DEV_IOC_BACKING_CLOSE, _ID.pack(backing_id))
        except OSError as e:
            log.warning("passthrough: cannot drop backing id %d: %s", backing_id, os.strerror(e.errno or errno.EIO))
