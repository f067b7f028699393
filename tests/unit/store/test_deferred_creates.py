"""Creates whose transaction commits with the next one: what other connections see, a failure's redo from the
journal, a successor's replay, and inode ids never handed out twice."""

from __future__ import annotations

import sqlite3
import stat

import pytest

from mithrilfs.cache.create_journal import CreateJournal
from mithrilfs.store.namespace import ROOT_INODE, Namespace


def _deferred_create(ns: Namespace, journal: CreateJournal, name: bytes) -> int:
    with ns.txn(defer=True):
        ino = ns.create_inode(stat.S_IFREG | 0o644, 1000, 1000)
        ns.link(ROOT_INODE, name, ino.id)
    journal.record(ino, ROOT_INODE, name)
    return ino.id


def _names_seen_elsewhere(path: str) -> set[bytes]:
    db = sqlite3.connect(path)
    try:
        return {r[0] for r in db.execute("SELECT name FROM dentries WHERE parent = ?", (ROOT_INODE,))}
    finally:
        db.close()


@pytest.fixture
def index(tmp_path):
    path = str(tmp_path / "index.db")
    ns = Namespace(path)
    journal = CreateJournal()
    lost: list[int] = []

    def redo() -> None:
        lost.append(journal.replay(ns))

    ns.on_deferred(committed=journal.clear, lost=redo)
    yield path, ns, journal, lost
    ns.close()


def test_a_deferred_create_is_seen_by_its_connection_and_committed_with_the_next_transaction(index):
    path, ns, journal, _ = index
    ino = _deferred_create(ns, journal, b"a.tmp")
    assert ns.lookup(ROOT_INODE, b"a.tmp") == ino and ns.deferred
    assert b"a.tmp" not in _names_seen_elsewhere(path)
    with ns.txn():  # the rename that publishes it: one transaction for both
        ns.move(ROOT_INODE, b"a.tmp", ROOT_INODE, b"a")
    assert not ns.deferred and journal.entries() == []
    assert _names_seen_elsewhere(path) == {b"a"}


def test_a_failed_transaction_after_deferred_creates_redoes_them_from_the_journal(index):
    path, ns, journal, lost = index
    first = _deferred_create(ns, journal, b"x")
    second = _deferred_create(ns, journal, b"y")
    with pytest.raises(OSError), ns.txn():
        ns.move(ROOT_INODE, b"x", ROOT_INODE, b"z")
        raise OSError("a check that failed after a change")
    assert lost == [2]
    # the failed change is gone; the creates the kernel was answered are back, under their ids
    assert ns.lookup(ROOT_INODE, b"x") == first and ns.lookup(ROOT_INODE, b"y") == second
    assert ns.lookup(ROOT_INODE, b"z") is None
    assert ns.deferred and len(journal.entries()) == 2  # deferred again, until a transaction commits them
    ns.commit_deferred()
    assert _names_seen_elsewhere(path) == {b"x", b"y"} and journal.entries() == []
    with ns.txn():
        third = ns.create_inode(stat.S_IFREG | 0o644, 0, 0)
    assert third.id > second


def test_creates_that_cannot_be_put_back_at_once_come_back_with_the_next_transaction_under_their_ids(index):
    path, ns, journal, _ = index
    gone = _deferred_create(ns, journal, b"x")
    ns.on_deferred(committed=journal.clear, lost=lambda: ns.redo_first(lambda: journal.replay(ns)))  # a full disk
    with pytest.raises(OSError), ns.txn():
        raise OSError("full")
    assert not ns.has_row(gone) and ns.lookup(ROOT_INODE, b"x") is None
    with ns.txn():
        again = ns.create_inode(stat.S_IFREG | 0o644, 0, 0)
    assert again.id > gone  # never the id the kernel holds for x
    assert ns.lookup(ROOT_INODE, b"x") == gone and _names_seen_elsewhere(path) == {b"x"}
    assert journal.entries() == []


def test_a_successor_replays_the_creates_its_index_lacks(tmp_path):
    path = str(tmp_path / "index.db")
    ns = Namespace(path)
    journal = CreateJournal()
    ns.on_deferred(committed=journal.clear, lost=lambda: None)
    committed = _deferred_create(ns, journal, b"old")
    ns.commit_deferred()
    assert journal.entries() == []
    _deferred_create(ns, journal, b"one")
    journal.record(ns.get(committed), ROOT_INODE, b"old")  # a committed create the journal kept: skipped
    dead = _deferred_create(ns, journal, b"two")
    ns.db.close()  # the daemon dies: its open transaction is gone
    successor = Namespace(path)
    inherited = CreateJournal(journal.fd)  # the supervisor's memfd
    assert [c.name for c in inherited.entries()] == [b"one", b"old", b"two"]
    assert inherited.replay(successor) == 2
    successor.commit_deferred()  # as a successor does before it serves
    inherited.clear()
    assert successor.lookup(ROOT_INODE, b"two") == dead and successor.get(dead).mode == stat.S_IFREG | 0o644
    assert successor.get(dead).uid == 1000 and inherited.entries() == []
    with successor.txn():
        assert successor.create_inode(stat.S_IFREG | 0o644, 0, 0).id > dead
    successor.close()


def test_a_journal_no_successor_would_get_defers_nothing():
    """A successor started by a supervisor of older code inherits no journal and passes none on: its creates
    commit at once, so a crash of it never loses one the kernel holds."""
    assert CreateJournal().room()
    assert not CreateJournal(defers=False).room()


def test_after_a_redo_is_committed_the_next_id_follows_the_redone_ones(index):
    """Once the redone creates are committed, the sequence holds their ids: the next create takes the id
    after them, neither one of theirs nor a gap."""
    path, ns, journal, _ = index
    gone = _deferred_create(ns, journal, b"x")
    with pytest.raises(OSError), ns.txn():
        raise OSError("a check that failed after a change")
    assert ns.lookup(ROOT_INODE, b"x") == gone
    ns.commit_deferred()
    with ns.txn():
        after = ns.create_inode(stat.S_IFREG | 0o644, 0, 0)
    assert after.id == gone + 1
