"""The index's write-ahead log copied back into its database file from a thread, not at the event loop's commits.

SQLite checkpoints a WAL database in whichever connection commits once the
WAL passes 1,000 pages: in the daemon, its one connection on its event loop,
where a checkpoint copies about 4 MiB into the database file and syncs it
(``synchronous=NORMAL`` syncs at checkpoints, not commits) while every request
waits (a commit that checkpoints takes several times as long as the others:
see docs/benchmarks.md, "H10, the daemon's own share of the prefetch").  A live mount turns
that off for its connection (``WalCheckpoints.take_over``) and its
duties run ``WalCheckpoints.run`` in a thread on a connection of its own
whenever the WAL changed (``daemon.duties``).  PASSIVE: it copies what is
committed without waiting for the writer or blocking it; the next commit
after a whole copy starts the WAL again from its beginning (truncated to the
index's ``journal_size_limit``), so the WAL stays about the size of what is
written between two checkpoints.
"""

from __future__ import annotations

import os
import sqlite3

from mithrilfs.store import schema


class WalCheckpoints:
    """Checkpoints of the index at *path* (its ``-wal`` beside it), on a connection opened at the first."""

    def __init__(self, path: str) -> None:
        self.path = path
        self._wal = path + "-wal"
        self._db: sqlite3.Connection | None = None
        self._seen: tuple[int, int] | None = None
        #: Checkpoints run, and the WAL frames they copied into the database file (``stats.json``).
        self.runs = 0
        self.frames = 0

    @classmethod
    def take_over(cls, db: sqlite3.Connection) -> WalCheckpoints:
        """The commits of *db* stop checkpointing its WAL: the caller runs the returned checkpoints in a
        thread.  ``give_back`` undoes it."""
        db.execute("PRAGMA wal_autocheckpoint=0")
        return cls(db.execute("PRAGMA database_list").fetchone()[2])

    @staticmethod
    def give_back(db: sqlite3.Connection) -> None:
        """The commits of *db* checkpoint the WAL again (SQLite's default: past 1,000 pages)."""
        db.execute("PRAGMA wal_autocheckpoint=1000")

    @classmethod
    def none(cls) -> WalCheckpoints:
        """Checkpoints not taken over (a read-only mount, or before its duties start): counts of zero."""
        return cls("")

    def changed(self) -> bool:
        """Whether a commit wrote the WAL since the last checkpoint (a ``stat``: cheap on the event loop)."""
        return self._stat() != self._seen

    def run(self) -> None:
        """One PASSIVE checkpoint (for a worker thread; sqlite3 lets the interpreter's lock go meanwhile)."""
        seen = self._stat()
        if self._db is None:
            self._db = schema.connect(self.path)
        _busy, _frames, copied = self._db.execute("PRAGMA wal_checkpoint(PASSIVE)").fetchone()
        self._seen = seen
        self.runs += 1
        self.frames += max(copied, 0)

    def close(self) -> None:
        if self._db is not None:
            self._db.close()
            self._db = None

    def _stat(self) -> tuple[int, int] | None:
        try:
            st = os.stat(self._wal)
        except FileNotFoundError:
            return None
        return st.st_size, st.st_mtime_ns
