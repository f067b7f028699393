"""Files created and answered before their index transaction commits, in shared memory that outlives the daemon.

A CREATE's transaction (the inode, its name, the directory's times) is
deferred (``Namespace.txn(defer=True)``): it commits with the next
transaction, which for a file written to a temporary name is the RENAME
that publishes it, or when the event loop next finds nothing to do
(``Names.commit_deferred``).  A file written and renamed then costs one
index transaction instead of two.  The kernel holds the new inode from
the CREATE's reply on, so a daemon that dies before the commit must leave
its successor the inode and its name: each deferred create is written
here before the reply, into a memfd the supervisor holds (as the lookup
counts, ``cache.lookups``), and a successor puts back what its index
lacks (``replay``) before it serves.  A transaction that fails while
creates are deferred rolls them back with it (``Namespace.txn``): the
daemon redoes them from here at once.  A commit empties the journal; a
full journal makes the next CREATE commit at once.

The journal's layout: the number of records (8 bytes), then the records
(``_RECORD``: inode, parent, mode, uid, gid, time, name length; the
name).  A record is written whole before the count that makes it part of
the journal, and the successor reads only after the daemon is dead.
"""

from __future__ import annotations

import logging
import mmap
import os
import sqlite3
import struct
from dataclasses import dataclass

from mithrilfs.store.namespace import Inode, Namespace

log = logging.getLogger(__name__)

_COUNT = struct.Struct("<Q")
_RECORD = struct.Struct("<QQIIIqH")
#: Creates kept at most: the next one commits at once, with them (what other connections see lags no further).
MAX_KEPT = 256
#: The longest record (a name is at most 255 bytes, ``operations._check_name_length``).
_MAX_RECORD = _RECORD.size + 255
#: The journal's size: ``MAX_KEPT`` records of the longest names.
SIZE = _COUNT.size + MAX_KEPT * _MAX_RECORD


@dataclass(frozen=True, slots=True)
class Created:
    """One deferred create: the inode the kernel was given and the name it was given under."""

    inode: int
    parent: int
    name: bytes
    mode: int
    uid: int
    gid: int
    time_ns: int


class CreateJournal:
    """The journal, in a memfd (``fd``) the daemon shares with its supervisor when it has one; with *fd*, the
    one a dead daemon left.  Without a supervisor nobody else reads it: a failed transaction's redo does
    (``Names``).  *defers*: False where a successor could come and would not get it (a supervisor of
    older code, which passes on no journal): then every create commits at once."""

    def __init__(self, fd: int | None = None, *, defers: bool = True) -> None:
        self.defers = defers
        self.fd = fd if fd is not None else os.memfd_create("mithrilfs-creates", os.MFD_CLOEXEC)
        os.set_inheritable(self.fd, False)
        if os.fstat(self.fd).st_size != SIZE:
            os.ftruncate(self.fd, SIZE)
        self._map = mmap.mmap(self.fd, SIZE)
        kept, self._end = self._read()  # a successor keeps what it inherited until it replays it
        self._count = len(kept)

    def room(self) -> bool:
        """Whether one more create can be kept (else the caller commits it at once)."""
        return self.defers and self._count < MAX_KEPT

    def record(self, ino: Inode, parent: int, name: bytes) -> None:
        """Keep a create whose transaction is deferred (before its reply)."""
        _RECORD.pack_into(self._map, self._end, ino.id, parent, ino.mode, ino.uid, ino.gid, ino.ctime_ns, len(name))
        start = self._end + _RECORD.size
        self._map[start:start + len(name)] = name
        self._end = start + len(name)
        self._count += 1
        _COUNT.pack_into(self._map, 0, self._count)  # the record is whole: now it counts

    def clear(self) -> None:
        """The deferred creates are committed: nothing to keep."""
        if self._count:
            _COUNT.pack_into(self._map, 0, 0)
            self._count, self._end = 0, _COUNT.size

    def entries(self) -> list[Created]:
        """The creates kept (read from the shared memory: a dead daemon's, when inherited)."""
        return self._read()[0]

    def _read(self) -> tuple[list[Created], int]:
        """The records, and where the next one goes; a count past what the memory holds is cut short."""
        (count,) = _COUNT.unpack_from(self._map, 0)
        kept: list[Created] = []
        at = _COUNT.size
        while len(kept) < min(count, MAX_KEPT) and at + _RECORD.size <= SIZE:
            ino, parent, mode, uid, gid, time_ns, length = _RECORD.unpack_from(self._map, at)
            if at + _RECORD.size + length > SIZE:
                break
            at += _RECORD.size
            kept.append(Created(ino, parent, bytes(self._map[at:at + length]), mode, uid, gid, time_ns))
            at += length
        return kept, at

    def replay(self, ns: Namespace) -> int:
        """Put back the kept creates *ns* lacks, in a deferred transaction (``Namespace.txn``: the journal
        keeps them until it commits); how many.  A create whose inode the index has was committed
        already; one whose directory is gone, or whose name another file took since, cannot be put back
        (the kernel's requests for it then fail, as for a file removed meanwhile)."""
        kept = self.entries()
        if not kept:
            return 0
        done = 0
        with ns.txn(defer=True):
            ns.reserve_ids(max(c.inode for c in kept))  # none is handed out again, put back or not
            for c in kept:
                if ns.has_row(c.inode):
                    continue
                parent = ns.get(c.parent)
                if parent is None or not parent.is_dir or ns.lookup(c.parent, c.name) is not None:
                    log.warning("cannot put back inode %d created as %r in directory %d", c.inode, c.name, c.parent)
                    continue
                ns.restore_inode(c.inode, c.mode, c.uid, c.gid, c.time_ns)
                ns.link(c.parent, c.name, c.inode)
                # the directory's times as the create left them (as this daemon's object has them)
                ns.update_attrs(parent, mtime_ns=max(parent.mtime_ns, c.time_ns),
                                ctime_ns=max(parent.ctime_ns, c.time_ns))
                done += 1
        return done

    def put_back(self, ns: Namespace, *, commit: bool = False) -> int:
        """``replay``, and with *commit* commit what it put back at once (the journal emptied: a successor's,
        before it serves); failing that (a full disk), the replay runs first in *ns*'s next transactions,
        until one commits (``Transactions.redo_first``: their ids stay out of use meanwhile).  How many
        files were put back now."""
        try:
            done = self.replay(ns)
            if commit:
                ns.commit_deferred()
                self.clear()
        except (sqlite3.Error, OSError) as e:
            log.warning("created files not put back yet, the next transaction puts them back: %s", e)
            ns.redo_first(lambda: self.replay(ns))
            return 0
        return done
