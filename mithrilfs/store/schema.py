"""The index's SQLite file: its tables, the connection settings, and the upgrade of an older index.

Kept apart from ``namespace`` (what the tables mean and how they change)
so the layout reads in one place: every table and index, with why each
column is there, and what opening an index made by an earlier version adds.
"""

from __future__ import annotations

import sqlite3
import urllib.parse
from collections.abc import Iterable

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS blobs (
    hash BLOB PRIMARY KEY,
    size INTEGER NOT NULL,
    refcount INTEGER NOT NULL
) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS blobs_garbage ON blobs(refcount) WHERE refcount = 0;
CREATE TABLE IF NOT EXISTS inodes (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    mode INTEGER NOT NULL,
    uid INTEGER NOT NULL,
    gid INTEGER NOT NULL,
    nlink INTEGER NOT NULL,
    size INTEGER NOT NULL DEFAULT 0,
    atime_ns INTEGER NOT NULL,
    mtime_ns INTEGER NOT NULL,
    ctime_ns INTEGER NOT NULL,
    hash BLOB,
    target BLOB,
    rdev INTEGER NOT NULL DEFAULT 0
);
CREATE INDEX IF NOT EXISTS inodes_unlinked ON inodes(id) WHERE nlink = 0;
CREATE INDEX IF NOT EXISTS inodes_hash ON inodes(hash) WHERE hash IS NOT NULL;
CREATE INDEX IF NOT EXISTS inodes_lru ON inodes(atime_ns, id) WHERE hash IS NOT NULL AND nlink > 0;
CREATE TABLE IF NOT EXISTS dentries (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    parent INTEGER NOT NULL,
    name BLOB NOT NULL,
    inode INTEGER NOT NULL,
    -- 1 once the name may be in the shared tier (uploaded, or materialized from it):
    -- removing it then publishes a tombstone
    published INTEGER NOT NULL DEFAULT 0,
    UNIQUE (parent, name)
);
CREATE INDEX IF NOT EXISTS dentries_readdir ON dentries(parent, id);
CREATE INDEX IF NOT EXISTS dentries_inode ON dentries(inode);
-- content committed by the idle timer that no rename, fsync, chmod, link or
-- forget has confirmed yet: it may be a snapshot of a paused writer, so an
-- unclean stop drops these names
CREATE TABLE IF NOT EXISTS unconfirmed (inode INTEGER PRIMARY KEY);
-- the shared tier's write-behind queue, kept here so it survives unmounts and crashes:
-- inodes whose names are to be published, and removed paths whose tombstones are
CREATE TABLE IF NOT EXISTS upload_queue (inode INTEGER PRIMARY KEY, queued_ns INTEGER NOT NULL);
CREATE TABLE IF NOT EXISTS tombstone_queue (path TEXT PRIMARY KEY, version INTEGER NOT NULL);
"""


def connect(path: str, *, read_only: bool = False, immutable: bool = True) -> sqlite3.Connection:
    """A connection to the index at *path*, in autocommit mode (``Namespace.txn`` opens transactions).

    WAL mode with ``synchronous=NORMAL`` makes a commit survive a crash of
    the daemon (the WAL is in the page cache) without an fsync per commit.
    A read-only connection that is also *immutable* (a read-only
    filesystem: nothing can change it under us) needs neither locks nor a
    writable -shm.
    """
    if read_only:
        uri = "file:" + urllib.parse.quote(path) + "?mode=ro" + ("&immutable=1" if immutable else "")
        return sqlite3.connect(uri, uri=True, isolation_level=None, check_same_thread=False)
    db = sqlite3.connect(path, isolation_level=None, check_same_thread=False)
    db.execute("PRAGMA journal_mode=WAL")
    db.execute("PRAGMA synchronous=NORMAL")
    # after each automatic checkpoint the WAL shrinks back to this size
    db.execute("PRAGMA journal_size_limit=4194304")
    db.execute("PRAGMA foreign_keys=OFF")
    return db


def create(db: sqlite3.Connection) -> None:
    """Make the tables an index lacks, and add the columns an older index lacks (in the caller's transaction)."""
    for stmt in _SCHEMA.split(";"):
        if stmt.strip():
            db.execute(stmt)
    columns = {row[1] for row in db.execute("PRAGMA table_info(inodes)")}
    if "rdev" not in columns:  # an index made before device nodes were stored
        db.execute("ALTER TABLE inodes ADD COLUMN rdev INTEGER NOT NULL DEFAULT 0")
    columns = {row[1] for row in db.execute("PRAGMA table_info(dentries)")}
    if "published" not in columns:  # an index made before tombstones
        db.execute("ALTER TABLE dentries ADD COLUMN published INTEGER NOT NULL DEFAULT 0")


#: Values one ``select_in`` statement binds at most (SQLite's default limit is 32,766: well under it).
IN_CHUNK = 500


def select_in(db: sqlite3.Connection, query: str, values: Iterable[object]) -> list[tuple]:
    """The rows of *query*, whose ``IN ({})`` is filled with *values*, one statement per ``IN_CHUNK``."""
    wanted = list(values)
    out: list[tuple] = []
    for i in range(0, len(wanted), IN_CHUNK):
        part = wanted[i:i + IN_CHUNK]
        out += db.execute(query.format(",".join("?" * len(part))), part).fetchall()
    return out
