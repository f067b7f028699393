"""The index's transactions: one open at a time, nested uses joining it, and commits deferred to the next one.

``namespace.Namespace`` is a ``Transactions``: what a rollback must undo
besides the rows (the inode objects it keeps) is its own
(``_rolled_back``).  A deferred transaction (``txn(defer=True)``, a
create's: ``cache.create_journal``) is left open for the next transaction
to continue and commit; its changes are redone by whoever deferred them
should a later failure roll them back, and the inode ids they handed out
are never handed out again (``reserve_ids``), since the kernel may hold
them.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Callable, Iterator
from contextlib import contextmanager


def _nothing() -> None:
    pass


class Transactions:
    """Transactions on ``db`` (see the module doc)."""

    db: sqlite3.Connection

    def __init__(self) -> None:
        self._depth = 0
        #: Inode ids the open transaction created (the id of a rolled back one is handed out again).
        self._created: list[int] = []
        #: A deferred transaction's changes are pending (``txn(defer=True)``), and who is told of their end.
        self._deferred = False
        self._deferred_committed: Callable[[], None] = _nothing
        self._deferred_lost: Callable[[], None] = _nothing
        #: The highest id a deferred transaction pending now created, and the highest id that must never be
        #: handed out again although the index may lack it (deferred creates a failure lost).
        self._deferred_last = 0
        self._id_floor = 0
        self._redo: Callable[[], object] | None = None

    @contextmanager
    def txn(self, *, defer: bool = False) -> Iterator[None]:
        """One atomic transaction; nested uses join the outer one.

        *defer*: its COMMIT waits for the next transaction's, or for
        ``commit_deferred``: the caller makes sure one comes, and keeps
        what redoes the deferred changes (``on_deferred``: a journal of
        creates, ``cache.create_journal``).  Meanwhile this connection sees
        them and others do not.  A transaction begun while changes are
        deferred continues theirs: should it fail, everything since the
        last commit rolls back and the caller redoes the deferred changes
        (told ``lost``), which costs the failure what a savepoint would
        cost every transaction.
        """
        if self._depth:
            self._depth += 1
            try:
                yield
            finally:
                self._depth -= 1
            return
        if not self._deferred:
            self.db.execute("BEGIN IMMEDIATE")
        self._depth = 1
        lost = False
        try:
            if self._redo is not None:  # deferred changes a failure lost, which could not be redone then
                self._redo()
                self._deferred = True
            yield
            if defer:
                self._deferred = True
                self._deferred_last = max(self._deferred_last, *self._created, 0)
            else:
                self._commit()
        except BaseException:
            lost = self._roll_back()
            raise
        finally:
            self._depth = 0
            self._ended()
            if lost:  # redone in a transaction of its own, this one over
                self._deferred_lost()

    @property
    def deferred(self) -> bool:
        """Whether changes of a deferred transaction are not committed yet (``txn(defer=True)``)."""
        return self._deferred

    def commit_deferred(self) -> None:
        """Commit what deferred transactions left pending, if anything (not inside a transaction).  A
        commit that fails leaves them pending, or, when SQLite rolled them back, tells ``lost``."""
        if self._redo is not None and not self._depth:
            with self.txn():
                return
        if self._deferred and not self._depth:
            try:
                self._commit()
            except BaseException:
                if not self.db.in_transaction and self._roll_back():
                    self._deferred_lost()
                raise

    def on_deferred(self, *, committed: Callable[[], None], lost: Callable[[], None]) -> None:
        """Tell *committed* after each commit that took deferred changes with it, and *lost* when a failed
        transaction rolled them back (the caller redoes them at once, or ``redo_first``)."""
        self._deferred_committed, self._deferred_lost = committed, lost

    def redo_first(self, redo: Callable[[], object]) -> None:
        """Deferred changes a failure lost could not be redone at once (a full disk): *redo* runs first in
        every transaction from now on, until one commits."""
        self._redo = redo

    def _commit(self) -> None:
        self.db.execute("COMMIT")
        # the sequence now holds every id the floor kept out of use: lost creates are redone, their ids
        # reserved, before anything else in a transaction that commits (``_deferred_lost``, ``redo_first``)
        self._redo, self._id_floor = None, 0
        if self._deferred:
            self._deferred, self._deferred_last = False, 0
            self._deferred_committed()

    def _roll_back(self) -> bool:
        """Undo everything since the last commit, in the index and in the objects; whether deferred changes
        went with it (their ids stay out of use: ``reserve_ids``)."""
        if self.db.in_transaction:
            self.db.execute("ROLLBACK")
        self._rolled_back()
        if not self._deferred:
            return False
        self._id_floor = max(self._id_floor, self._deferred_last)
        self._deferred, self._deferred_last = False, 0
        return True

    def _rolled_back(self) -> None:
        """What a rollback undoes besides the rows (the objects a ``Namespace`` keeps)."""

    def _ended(self) -> None:
        """The outermost transaction is over, committed or not: what it recorded goes."""
        self._created.clear()

    def reserve_ids(self, last: int) -> None:
        """No inode id up to *last* is handed out again (ids the kernel may hold that the index lost): in the
        sequence, and, until this transaction commits, in the ids ``create_inode`` picks itself."""
        self.db.execute("INSERT INTO sqlite_sequence (name, seq) SELECT 'inodes', 0"
                        " WHERE NOT EXISTS (SELECT 1 FROM sqlite_sequence WHERE name = 'inodes')")
        self.db.execute("UPDATE sqlite_sequence SET seq = max(seq, ?) WHERE name = 'inodes'", (last,))
        self._id_floor = max(self._id_floor, last)

    def _last_id(self) -> int:
        """The highest inode id ever handed out (``AUTOINCREMENT`` hands out the next one)."""
        last = self.db.execute("SELECT max(coalesce((SELECT seq FROM sqlite_sequence WHERE name = 'inodes'), 0),"
                               " coalesce((SELECT max(id) FROM inodes), 0))").fetchone()[0]
        return max(last, self._id_floor)

