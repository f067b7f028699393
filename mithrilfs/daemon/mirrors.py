"""Mirrors of content staged in memory, made in batches and reused: ``MirrorPool`` (the daemon's) and ``claimed``
(the supervisor's).

A file staged in memory (``cache.staging``) keeps a copy of its content in
a memfd the supervisor holds too, so that a crash of the daemon loses no
write it answered.  The daemon makes these mirrors ``BATCH`` at a time and
sends each batch in one message (``daemon.channel``); which inode a mirror
holds is written in its slot of the slot table, one more memfd that both
hold and the daemon maps.  So taking a mirror for a file and giving it back
after its commit is a store into shared memory and a truncate, with no
message, no memfd made and none closed.  When the daemon is gone the
supervisor reads the table (``claimed``): a mirror whose slot names an inode
holds exactly that inode's staged content, with no header (the content of a
mirror is the file's, as ``WritePath.adopt`` reads it).

Order keeps that true.  A slot names its inode once the mirror holds the
content staged so far (a copy of the committed file being written
again), and before the first write into the mirror is answered; a
mirror is given back (its slot cleared first, then its content emptied) only once its content is needless: after the commit's
transaction, or after the message that tells the supervisor where the
content went instead (a staging file, or lost), which wins over the slot.
"""

from __future__ import annotations

import errno
import mmap
import os
import struct
from collections.abc import Callable, Sequence

from mithrilfs.crash_points import crash_point

#: A slot of the table: the inode whose content the mirror holds, 0 for a free mirror.
SLOT = struct.Struct("<q")
#: Mirrors made at once when none is free (one message carries their descriptors).
BATCH = 64
#: Slots in the table (a sparse memfd: memory only for the pages of slots in use).
MAX_SLOTS = 1 << 20
#: Free mirrors kept; one given back beyond that is closed (after a burst of thousands of files staged at once).
MAX_FREE = 256

#: Sends one message with descriptors to the supervisor; False when it could not (the supervisor is gone).
Send = Callable[[str, Sequence[int]], bool]


class MirrorPool:
    """The daemon's mirrors: the supervisor holds each one from before it is taken (see the module doc).

    Messages: ``mirror-slots`` with the table's descriptor, once;
    ``mirrors SLOT...`` with one descriptor per slot named; ``unmirror SLOT``:
    that mirror is closed (a slot number may be named again later).
    """

    def __init__(self, send: Send) -> None:
        self._send = send
        self._table: mmap.mmap | None = None
        #: Slot of every mirror, by descriptor.
        self._slots: dict[int, int] = {}
        self._free: list[int] = []
        #: Slot numbers of mirrors closed, named again before new ones.
        self._unused: list[int] = []
        self._next = 0

    def take(self, ino: int, content: bytes | bytearray | memoryview = b"") -> int:
        """A mirror holding *content* whose slot names *ino*, in that order (a slot never names a mirror
        its content is not in yet); OSError when none can be had (the supervisor is gone, no memory or
        descriptors left)."""
        if not self._free:
            self._grow()
        assert self._table is not None
        fd = self._free.pop()
        try:
            if content:
                os.pwrite(fd, content, 0)
        except OSError:
            self.give_back(fd)
            raise
        SLOT.pack_into(self._table, self._slots[fd] * SLOT.size, ino)
        crash_point("mirror_taken")
        return fd

    def give_back(self, fd: int) -> None:
        """The mirror's content is needless now: its slot is cleared, then its content emptied for the next file."""
        assert self._table is not None
        slot = self._slots[fd]
        SLOT.pack_into(self._table, slot * SLOT.size, 0)
        if len(self._free) < MAX_FREE:
            try:
                os.ftruncate(fd, 0)
                self._free.append(fd)
                return
            except OSError:
                pass
        del self._slots[fd]
        os.close(fd)
        self._unused.append(slot)
        self._send(f"unmirror {slot}", ())

    def _grow(self) -> None:
        if self._table is None:
            table = os.memfd_create("mithrilfs-mirror-slots", os.MFD_CLOEXEC)
            try:
                os.ftruncate(table, MAX_SLOTS * SLOT.size)
                mapped = mmap.mmap(table, MAX_SLOTS * SLOT.size)
                if not self._send("mirror-slots", (table,)):
                    mapped.close()
                    raise OSError(errno.EPIPE, "the supervisor is gone")
            finally:
                os.close(table)
            self._table = mapped
        count = min(BATCH, len(self._unused) + MAX_SLOTS - self._next)
        if count <= 0:
            raise OSError(errno.ENFILE, f"all {MAX_SLOTS} mirror slots are in use")
        fds: list[int] = []
        try:
            for _ in range(count):
                fds.append(os.memfd_create("mithrilfs-staging", os.MFD_CLOEXEC))
        except OSError:
            if not fds:
                raise
        slots = [self._unused.pop() if self._unused else self._new_slot() for _ in fds]
        if not self._send("mirrors " + " ".join(map(str, slots)), fds):
            for fd in fds:
                os.close(fd)
            self._unused += slots
            raise OSError(errno.EPIPE, "the supervisor is gone")
        self._slots.update(zip(fds, slots))
        self._free += reversed(fds)

    def _new_slot(self) -> int:
        self._next += 1
        return self._next - 1


def claimed(table: int, mirrors: dict[int, int]) -> dict[int, int]:
    """The supervisor's reading of a gone daemon's table: {inode: descriptor} of the mirrors (*mirrors*: slot ->
    descriptor) whose slot names an inode; the other descriptors are closed, and so is *table*."""
    named: dict[int, int] = {}
    try:
        data = os.pread(table, SLOT.size * (max(mirrors) + 1), 0) if table >= 0 and mirrors else b""
    finally:
        if table >= 0:
            os.close(table)
    for slot, fd in mirrors.items():
        at = slot * SLOT.size
        ino = SLOT.unpack_from(data, at)[0] if at + SLOT.size <= len(data) else 0
        if ino > 0:
            named[ino] = fd
        else:
            os.close(fd)
    return named
