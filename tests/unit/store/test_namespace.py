"""The SQLite namespace alone: entries, attributes, refcounts, persistence, recovery."""

from __future__ import annotations

import os
import stat

import pytest

from mithrilfs.store.namespace import ROOT_INODE, Namespace
from mithrilfs.store.open import StoreError, open_store
from mithrilfs.store.wal_checkpoints import WalCheckpoints


def _file(ns, parent, name):
    with ns.txn():
        ino = ns.create_inode(stat.S_IFREG | 0o644, 0, 0)
        ns.link(parent, name, ino.id)
    return ino


def test_root_exists_and_is_a_directory(ns):
    root = ns.get(ROOT_INODE)
    assert root is not None and root.is_dir and root.nlink == 2


def test_entries_and_readdir_offsets_are_stable(ns):
    names = [f"f{i}".encode() for i in range(10)]
    for n in names:
        _file(ns, ROOT_INODE, n)
    first = ns.readdir(ROOT_INODE, 0, limit=4)
    rest = ns.readdir(ROOT_INODE, first[-1].offset)
    assert [d.name for d in first + rest] == names
    # removing an entry already returned does not shift the others
    with ns.txn():
        ns.unlink(ROOT_INODE, b"f1")
    again = ns.readdir(ROOT_INODE, first[-1].offset)
    assert [d.name for d in again] == [d.name for d in rest]


def test_refcounts_follow_inodes(ns):
    a = _file(ns, ROOT_INODE, b"a")
    b = _file(ns, ROOT_INODE, b"b")
    h = b"\x01" * 32
    with ns.txn():
        ns.blob_intent(h, 5)
    assert ns.refcount(h) == 0
    with ns.txn():
        ns.set_content(a, h, 5, 1)
        ns.set_content(b, h, 5, 1)
    assert ns.refcount(h) == 2
    with ns.txn():
        ns.unlink(ROOT_INODE, b"a")
        ns.delete_inode(a.id)
    assert ns.refcount(h) == 1
    h2 = b"\x02" * 32
    with ns.txn():
        ns.blob_intent(h2, 7)
        ns.set_content(b, h2, 7, 2)
    assert ns.refcount(h) == 0 and ns.refcount(h2) == 1
    assert ns.garbage() == [h]
    with ns.txn():
        ns.forget_blob(h)
    assert ns.refcount(h) is None


def test_persistence_and_stable_inode_numbers(tmp_path):
    path = str(tmp_path / "index.sqlite3")
    ns = Namespace(path)
    f = _file(ns, ROOT_INODE, b"kept")
    with ns.txn():
        d = ns.create_inode(stat.S_IFDIR | 0o755, 0, 0, nlink=2)
        ns.link(ROOT_INODE, b"dir", d.id)
    ns.close()
    ns = Namespace(path)
    assert ns.lookup(ROOT_INODE, b"kept") == f.id
    assert ns.lookup(ROOT_INODE, b"dir") == d.id
    assert ns.get(d.id).is_dir
    ns.close()


def test_transaction_rolls_back_on_error(ns):
    with pytest.raises(RuntimeError):
        with ns.txn():
            _file(ns, ROOT_INODE, b"ghost")
            raise RuntimeError
    assert ns.lookup(ROOT_INODE, b"ghost") is None


def test_rollback_restores_inode_objects(ns):
    f = _file(ns, ROOT_INODE, b"f")
    h = b"\x09" * 32
    with ns.txn():
        ns.blob_intent(h, 3)
    with pytest.raises(RuntimeError):
        with ns.txn():
            ns.set_content(f, h, 3, 5)
            ns.add_link(f, +1)
            raise RuntimeError("disk full")
    assert (f.hash, f.size, f.nlink) == (None, 0, 1)
    assert ns.get(f.id).hash is None and ns.refcount(h) == 0


def test_recover_drops_unlinked_inodes_and_fixes_refcounts(ns):
    a = _file(ns, ROOT_INODE, b"a")
    h = b"\x03" * 32
    with ns.txn():
        ns.blob_intent(h, 1)
        ns.set_content(a, h, 1, 1)
        ns.unlink(ROOT_INODE, b"a")
        ns.add_link(a, -1)  # unlinked while open, then the daemon died
        ns.db.execute("UPDATE blobs SET refcount = 7")  # and the counts were off
    report = ns.recover()
    assert report["unlinked_inodes"] == 1
    assert ns.get(a.id) is None
    assert ns.refcount(h) == 0


def test_store_format_stamp_and_lock(tmp_path):
    s = open_store(tmp_path / "st")
    assert (tmp_path / "st" / "FORMAT").exists()
    assert stat.S_IMODE((tmp_path / "st").stat().st_mode) == 0o700
    with pytest.raises(StoreError, match="in use"):
        open_store(tmp_path / "st")
    s.close()
    (tmp_path / "st" / "FORMAT").write_text('{"format": 99}')
    with pytest.raises(StoreError, match="format 99"):
        open_store(tmp_path / "st")
    other = tmp_path / "other"
    other.mkdir()
    (other / "something").write_text("x")
    with pytest.raises(StoreError, match="not a mithrilfs store"):
        open_store(other)


def test_index_from_before_device_numbers_gains_the_column(tmp_path):
    import sqlite3

    path = str(tmp_path / "old.sqlite3")
    db = sqlite3.connect(path)
    db.executescript("""
        CREATE TABLE inodes (id INTEGER PRIMARY KEY AUTOINCREMENT, mode INTEGER NOT NULL, uid INTEGER NOT NULL,
            gid INTEGER NOT NULL, nlink INTEGER NOT NULL, size INTEGER NOT NULL DEFAULT 0, atime_ns INTEGER NOT NULL,
            mtime_ns INTEGER NOT NULL, ctime_ns INTEGER NOT NULL, hash BLOB, target BLOB);
        INSERT INTO inodes VALUES (1, 16877, 0, 0, 2, 0, 1, 1, 1, NULL, NULL);
        INSERT INTO inodes VALUES (2, 33188, 0, 0, 1, 5, 1, 1, 1, NULL, NULL);
    """)
    db.commit()
    db.close()
    ns = Namespace(path)
    assert ns.get(2).rdev == 0 and ns.get(2).size == 5
    with ns.txn():
        dev = ns.create_inode(stat.S_IFCHR | 0o600, 0, 0, rdev=259)
    assert ns.get(dev.id).rdev == 259
    ns.close()


def test_names_kept_in_memory_follow_every_change(ns, tmp_path):
    """A repeated lookup is answered from memory (issue 17): unlink, rename, retarget, a rollback and a
    second connection's changes must all show in the next lookup."""
    a = _file(ns, ROOT_INODE, b"a")
    b = _file(ns, ROOT_INODE, b"b")
    assert ns.lookup(ROOT_INODE, b"a") == a.id  # now kept
    with ns.txn():
        ns.unlink(ROOT_INODE, b"a")
    assert ns.lookup(ROOT_INODE, b"a") is None
    with ns.txn():
        ns.link(ROOT_INODE, b"a", a.id)
    assert ns.lookup(ROOT_INODE, b"a") == a.id
    with ns.txn():
        ns.move(ROOT_INODE, b"a", ROOT_INODE, b"c")
    assert ns.lookup(ROOT_INODE, b"a") is None and ns.lookup(ROOT_INODE, b"c") == a.id
    with ns.txn():
        ns.retarget(ROOT_INODE, b"c", b.id)
    assert ns.lookup(ROOT_INODE, b"c") == b.id
    with pytest.raises(RuntimeError), ns.txn():  # a rolled-back unlink leaves the name
        ns.unlink(ROOT_INODE, b"c")
        assert ns.lookup(ROOT_INODE, b"c") is None
        raise RuntimeError
    assert ns.lookup(ROOT_INODE, b"c") == b.id
    with pytest.raises(RuntimeError), ns.txn():  # a rolled-back link leaves no name
        ns.link(ROOT_INODE, b"d", a.id)
        assert ns.lookup(ROOT_INODE, b"d") == a.id
        raise RuntimeError
    assert ns.lookup(ROOT_INODE, b"d") is None
    # a reader of an index the writer changes keeps nothing: it sees the writer's unlink
    reader = ns.reader()
    try:
        assert reader.lookup(ROOT_INODE, b"b") == b.id
        with ns.txn():
            ns.unlink(ROOT_INODE, b"b")
        assert reader.lookup(ROOT_INODE, b"b") is None
    finally:
        reader.close()


def test_a_small_directory_preloaded_answers_its_lookups_from_memory_and_follows_changes(ns):
    """``preload_dir`` (run after a directory's LOOKUP is answered): one query keeps every name of a
    directory of at most PRELOAD_MAX; its lookups then run no SQL, and changes show as for any kept name.
    A larger directory is left to its lookups."""
    from mithrilfs.store.namespace import PRELOAD_MAX

    with ns.txn():
        small = ns.create_inode(stat.S_IFDIR | 0o755, 0, 0, nlink=2)
        ns.link(ROOT_INODE, b"small", small.id)
        big = ns.create_inode(stat.S_IFDIR | 0o755, 0, 0, nlink=2)
        ns.link(ROOT_INODE, b"big", big.id)
    files = {f"k{i}".encode(): _file(ns, small.id, f"k{i}".encode()).id for i in range(8)}
    for i in range(PRELOAD_MAX + 1):
        _file(ns, big.id, f"f{i}".encode())
    ns.forget_cached()  # as after a remount: nothing kept
    queries: list[str] = []
    ns.db.set_trace_callback(queries.append)
    ns.preload_dir(small.id)
    assert len(queries) == 1
    for name, ino in files.items():
        found = ns.lookup_inode(small.id, name)
        assert found is not None and found.id == ino
    assert ns.lookup_inode(small.id, b"absent") is None and ns.lookup(small.id, b"absent") is None
    assert len(queries) == 1  # every lookup answered from memory, a name not there too (it is read whole)
    ns.preload_dir(small.id)  # once is enough
    assert len(queries) == 1
    # changes made afterwards show
    with ns.txn():
        ns.unlink(small.id, b"k0")
    assert ns.lookup_inode(small.id, b"k0") is None
    with ns.txn():
        ns.move(small.id, b"k1", small.id, b"renamed")
    assert ns.lookup_inode(small.id, b"k1") is None and ns.lookup_inode(small.id, b"renamed").id == files[b"k1"]
    # a large directory keeps nothing: each of its lookups asks the index
    ns.preload_dir(big.id)
    before = len(queries)
    assert ns.lookup_inode(big.id, b"f1") is not None and len(queries) > before
    # an inode object someone holds stays the one object for its id (callers keep them across requests)
    ns.forget_cached()
    held = ns.get(files[b"k2"])
    ns.preload_dir(small.id)
    assert ns.lookup_inode(small.id, b"k2") is held
    # never inside a transaction (its rollback restores the objects it changed and forgets what it made)
    ns.forget_cached()
    before = len(queries)
    with ns.txn():
        ns.preload_dir(small.id)
        assert not any("d.parent = ?" in q for q in queries[before:])
    # emptied names (a rollback, recover) may be preloaded again
    ns.forget_cached()
    before = len(queries)
    ns.preload_dir(small.id)
    assert len(queries) == before + 1 and ns.lookup_inode(small.id, b"k2").id == files[b"k2"]
    assert len(queries) == before + 1
    ns.db.set_trace_callback(None)


def test_a_directory_made_in_this_mount_answers_names_it_lacks_without_a_query_and_follows_changes(ns):
    """A directory made empty keeps all its names: a lookup of a name it lacks (a file's tmp name, then its
    final name, before they exist) asks the index nothing, and its new names, renames, exchanges, removals
    and a rollback all show in the next lookup; once the names are emptied it asks the index again."""
    with ns.txn():
        d = ns.create_inode(stat.S_IFDIR | 0o755, 0, 0, nlink=2)
        ns.link(ROOT_INODE, b"d", d.id)
    queries: list[str] = []
    ns.db.set_trace_callback(queries.append)
    assert ns.lookup(d.id, b"tmp") is None and ns.lookup_inode(d.id, b"final") is None
    assert queries == []
    tmp = _file(ns, d.id, b"tmp")
    other = _file(ns, d.id, b"other")
    before = len(queries)
    assert ns.lookup(d.id, b"tmp") == tmp.id and ns.lookup(d.id, b"final") is None
    with ns.txn():
        ns.move(d.id, b"tmp", d.id, b"final")
    assert ns.lookup(d.id, b"tmp") is None and ns.lookup_inode(d.id, b"final") is tmp
    with ns.txn():
        ns.retarget(d.id, b"final", other.id)
        ns.retarget(d.id, b"other", tmp.id)
    assert ns.lookup(d.id, b"final") == other.id and ns.lookup(d.id, b"other") == tmp.id
    with ns.txn():
        ns.unlink(d.id, b"other")
    assert ns.lookup(d.id, b"other") is None
    assert not any("FROM dentries" in q and "SELECT" in q for q in queries[before:])
    with pytest.raises(RuntimeError), ns.txn():  # a rolled-back link leaves no name, and nothing kept whole
        ns.link(d.id, b"ghost", tmp.id)
        raise RuntimeError
    before = len(queries)
    assert ns.lookup(d.id, b"ghost") is None and ns.lookup(d.id, b"final") == other.id
    assert len(queries) == before + 2  # asked the index
    ns.db.set_trace_callback(None)


def test_names_created_in_bulk_are_what_one_at_a_time_makes(ns):
    """``create_names`` (a startup set's thousands of names in a few statements): ids after the highest
    ever handed out (a deleted last one is not reused), rows and objects that agree, names found, one
    reference per file (a content named twice: two), a directory made in the same call as what it holds
    (``~i``) with the links a directory counts, a symbolic link, and a rollback leaves nothing."""
    from mithrilfs.store.namespace import NewName

    gone = _file(ns, ROOT_INODE, b"gone")
    with ns.txn():
        ns.unlink(ROOT_INODE, b"gone")
        ns.delete_inode(gone.id)
    root_links = ns.get(ROOT_INODE).nlink
    h1, h2 = b"\x01" * 32, b"\x02" * 32
    dir_mode, link_mode = stat.S_IFDIR | 0o755, stat.S_IFLNK | 0o777
    names = [NewName(ROOT_INODE, b"a", stat.S_IFREG | 0o644, 7, 8, h1, 10, 111, 222),
             NewName(ROOT_INODE, b"k", dir_mode, 7, 8, None, 0, 333, 444),
             NewName(~1, b"b", stat.S_IFREG | 0o600, 7, 8, h2, 20, 555, 666),
             NewName(~1, b"sub", dir_mode, 7, 8, None, 0, 777, 888),
             NewName(~3, b"c", stat.S_IFREG | 0o644, 7, 8, h1, 10, 999, 1000),
             NewName(~1, b"l", link_mode, 7, 8, None, 3, 1, 2, b"../a")]
    with ns.txn():
        made = ns.create_names(names)
    assert [n.id for n in made] == [gone.id + i for i in range(1, 7)]
    after = _file(ns, ROOT_INODE, b"after")  # SQLite's own next id follows them
    assert after.id == gone.id + 7
    ns.forget_cached()
    parents = [ROOT_INODE, ROOT_INODE, made[1].id, made[1].id, made[3].id, made[1].id]
    nlinks = [1, 3, 1, 2, 1, 1]  # k holds sub; sub holds no directory
    for f, n, parent, nlink in zip(names, made, parents, nlinks):
        assert ns.lookup(parent, f.name) == n.id
        row = ns.get(n.id)
        assert row is not None and row is not n  # read back from SQLite, not the cached object
        assert (row.mode, row.uid, row.gid, row.nlink, row.hash, row.size, row.mtime_ns, row.ctime_ns, row.target) == (
            f.mode, 7, 8, nlink, f.digest, f.size, f.mtime_ns, f.ctime_ns, f.target)
        assert ns.is_published(parent, f.name)
    assert ns.get(ROOT_INODE).nlink == root_links + 1  # k, made in a directory that was here
    assert ns.refcount(h1) == 2 and ns.refcount(h2) == 1
    assert ns.blob_info(h1) == (2, 0)  # a placeholder: the content is elsewhere
    with pytest.raises(RuntimeError), ns.txn():
        ns.create_names([NewName(ROOT_INODE, b"d", stat.S_IFREG | 0o644, 0, 0, b"\x03" * 32, 5, 1, 1),
                         NewName(ROOT_INODE, b"e", dir_mode, 0, 0, None, 0, 1, 1)])
        raise RuntimeError("rolled back")
    assert ns.lookup(ROOT_INODE, b"d") is None and ns.refcount(b"\x03" * 32) is None
    assert ns.lookup(ROOT_INODE, b"e") is None and ns.get(ROOT_INODE).nlink == root_links + 1


def _wal_pages(ns: Namespace) -> int:
    return os.path.getsize(ns.db.execute("PRAGMA database_list").fetchone()[2] + "-wal") // 4096


def test_a_connection_checkpointing_elsewhere_never_checkpoints_at_its_commits(ns):
    """``WalCheckpoints.take_over``: the daemon's commits (on its event loop) stop copying the WAL into the
    database file, which SQLite does at the commit that passes 1,000 pages (6-10 ms with a sync); the
    checkpoints it hands back do it, on a connection of their own, and the next commit starts the WAL
    again; ``give_back`` gives the commits their checkpoints back."""
    def write(n: int, tag: bytes) -> None:
        for i in range(n):
            with ns.txn():
                ns.set_meta(f"{tag.decode()}{i}", "x" * 20_000)  # about 6 pages a commit

    wal = WalCheckpoints.take_over(ns.db)
    try:
        write(400, b"a")
        assert _wal_pages(ns) > 2_000  # no commit checkpointed (at 1,000 pages SQLite starts again)
        assert wal.changed()
        wal.run()
        assert wal.runs == 1 and wal.frames > 2_000 and not wal.changed()
        write(1, b"b")  # the WAL starts again from its beginning: cut back to the journal_size_limit
        assert _wal_pages(ns) <= 1_024 + 16 and wal.changed()
        assert ns.get_meta("a399") == "x" * 20_000
    finally:
        wal.close()
    WalCheckpoints.give_back(ns.db)
    write(600, b"c")
    assert _wal_pages(ns) < 1_300  # the commits checkpoint again
