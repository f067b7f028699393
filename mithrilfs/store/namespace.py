"""The SQLite index: inodes, directory entries, attributes, content hashes, blob refcounts.

It is the one source of truth for what the mount shows; blobs on disk are
only reachable through it.  Every mutating call runs inside ``txn()`` so a
crash leaves either the old or the new state.  The tables and the
connection's settings are in ``schema``, the transactions in
``transactions`` and the blob rows' refcounts in ``blob_rows`` (a
``Namespace`` is a ``Transactions`` and a ``BlobRows``), the repair at
each mount in ``recovery``.
"""

from __future__ import annotations

import logging
import operator
import os
import sqlite3
import stat
import time
import weakref
from collections import Counter, deque
from dataclasses import dataclass, fields

from mithrilfs.store import recovery, schema
from mithrilfs.store.blob_rows import BlobRows
from mithrilfs.store.kept_names import KeptNames
from mithrilfs.store.name_queries import NameQueries
from mithrilfs.store.transactions import Transactions

log = logging.getLogger(__name__)

ROOT_INODE = 1

#: Inodes loaded most recently are kept in memory (beyond those still in use elsewhere).
INODE_CACHE_SIZE = 65536
#: A directory of at most this many names is read whole when it is entered (``preload_dir``).
PRELOAD_MAX = 64

_INODE_COLS = "id, mode, uid, gid, nlink, size, atime_ns, mtime_ns, ctime_ns, hash, target, rdev"
_INODE_COLS_OF_I = ", ".join(f"i.{c}" for c in _INODE_COLS.split(", "))


@dataclass(slots=True, weakref_slot=True)
class Inode:
    id: int
    mode: int
    uid: int
    gid: int
    nlink: int
    size: int
    atime_ns: int
    mtime_ns: int
    ctime_ns: int
    hash: bytes | None
    target: bytes | None
    #: Device number of a character or block device node (0 for everything else).
    rdev: int = 0

    @property
    def is_dir(self) -> bool:
        return stat.S_ISDIR(self.mode)

    @property
    def is_reg(self) -> bool:
        return stat.S_ISREG(self.mode)


_INODE_FIELDS = tuple(f.name for f in fields(Inode))
#: Every field of an Inode, as a tuple (what a rollback restores).
_inode_fields = operator.attrgetter(*_INODE_FIELDS)


@dataclass(slots=True)
class NewName:
    """A name ``Namespace.create_names`` creates with its inode: a regular file whose content is a blob known
    by its hash (*digest*), a directory (*digest* None) or a symbolic link (*target*).

    *parent*: a directory's id, or ``~i`` for the i-th name of the same call (a directory created with
    it: a startup set's kernel directory and its files, in one batch)."""

    parent: int
    name: bytes
    mode: int
    uid: int
    gid: int
    digest: bytes | None
    size: int
    mtime_ns: int
    ctime_ns: int
    target: bytes | None = None


@dataclass(slots=True)
class Dentry:
    offset: int
    name: bytes
    inode: int


class Namespace(Transactions, BlobRows, NameQueries):
    """The index.  ``get`` answers from an identity map of inodes before asking SQLite.

    Every Inode object in use (a file being written holds one) is the one object
    for its id, so a change made through any caller is seen by all, and the
    same cached rows answer repeated lookups without a query (s3ql's inode
    cache is the model).  The map holds inodes weakly; a ring of the most
    recently loaded keeps the hot ones alive.  Changes go through the
    methods below, which update the object and the row together; a rolled
    back transaction restores the objects it changed and forgets the ones
    it created.
    """

    #: Inode objects changed in the open transaction, with their old field values, restored if it
    #: rolls back: callers keep Inode objects (files being written) across requests, and they must
    #: never say what the index does not.
    _undo: dict[int, tuple[Inode, tuple]]
    #: Inodes whose content awaits confirmation (the ``unconfirmed`` table, mirrored).
    unconfirmed: set[int]

    def __init__(self, path: str, *, read_only: bool = False, immutable: bool = True) -> None:
        self.read_only = read_only
        self._inodes: weakref.WeakValueDictionary[int, Inode] = weakref.WeakValueDictionary()
        self._recent: deque[Inode] = deque(maxlen=INODE_CACHE_SIZE)
        #: Names kept in memory: a repeated LOOKUP, and one of a name a directory kept whole lacks, is answered
        #: without SQLite.  Every change of a name goes through ``link``, ``unlink`` and ``retarget``, which
        #: keep them right; a rollback or a change by SQL alone (``recover``) empties them.  Not kept by a
        #: reader of an index another connection changes (``reader``).
        self._kept = KeptNames(not read_only or immutable)
        self.db = schema.connect(path, read_only=read_only, immutable=immutable)
        Transactions.__init__(self)
        self._undo = {}
        if read_only:
            self.unconfirmed = set()
            return
        with self.txn():
            schema.create(self.db)
        self.unconfirmed = self._load_unconfirmed()
        if self.get(ROOT_INODE) is None:
            now = time.time_ns()
            with self.txn():
                # the mount root belongs to whoever made the store (a non-root user's own cache)
                self.db.execute(
                    "INSERT INTO inodes (id, mode, uid, gid, nlink, size, atime_ns, mtime_ns, ctime_ns)"
                    " VALUES (?, ?, ?, ?, 2, 0, ?, ?, ?)",
                    (ROOT_INODE, stat.S_IFDIR | 0o755, os.getuid(), os.getgid(), now, now, now),
                )

    def close(self) -> None:
        """Commit what deferred transactions left (whoever deferred them still holds what redoes them, should
        that fail: a successor replays the journal of creates), and close the connection."""
        if not self.read_only:
            try:
                self.commit_deferred()
            except sqlite3.Error as e:
                log.warning("could not commit the last creates before closing the index: %s", e)
        self.db.close()

    def reader(self) -> Namespace:
        """A second, read-only connection for queries run in a worker thread (WAL lets it read alongside).
        Of a read-only store it is immutable too: nothing changes that index, and its files may be on a
        read-only file system, where a connection that watches for changes cannot open."""
        path = self.db.execute("PRAGMA database_list").fetchone()[2]
        return Namespace(path, read_only=True, immutable=self.read_only)

    def shrink_wal(self) -> None:
        """Checkpoint and truncate the WAL (when the disk is full, it may be most of the space)."""
        if not self._depth:
            self.commit_deferred()
            self.db.execute("PRAGMA wal_checkpoint(TRUNCATE)")

    def _rolled_back(self) -> None:
        """A transaction rolled back (``Transactions``): the objects it changed say what the index does again,
        those it created are forgotten, and the names kept in memory are read afresh."""
        for ino, old in self._undo.values():
            for name, value in zip(_INODE_FIELDS, old):
                setattr(ino, name, value)
        for ino_id in self._created:  # the id will be handed out again
            self._inodes.pop(ino_id, None)
        self._kept.clear()
        self.unconfirmed = self._load_unconfirmed()

    def _ended(self) -> None:
        self._undo.clear()
        super()._ended()

    def _load_unconfirmed(self) -> set[int]:
        return {r[0] for r in self.db.execute("SELECT inode FROM unconfirmed")}

    def _changing(self, ino: Inode) -> None:
        if self._depth and id(ino) not in self._undo:
            self._undo[id(ino)] = (ino, _inode_fields(ino))

    # -- meta ------------------------------------------------------------
    def get_meta(self, key: str) -> str | None:
        row = self.db.execute("SELECT value FROM meta WHERE key = ?", (key,)).fetchone()
        return row[0] if row else None

    def has_meta_prefix(self, prefix: str) -> bool:
        """Whether any meta key starts with *prefix*."""
        return self.db.execute("SELECT 1 FROM meta WHERE substr(key, 1, ?) = ? LIMIT 1",
                               (len(prefix), prefix)).fetchone() is not None

    def set_meta(self, key: str, value: str) -> None:
        self.db.execute("INSERT OR REPLACE INTO meta (key, value) VALUES (?, ?)", (key, value))

    # -- inodes ----------------------------------------------------------
    def get(self, ino: int) -> Inode | None:
        node = self._inodes.get(ino)
        if node is not None:
            return node
        row = self.db.execute(f"SELECT {_INODE_COLS} FROM inodes WHERE id = ?", (ino,)).fetchone()
        return self._remember(Inode(*row)) if row else None

    def _remember(self, node: Inode) -> Inode:
        self._inodes[node.id] = node
        self._recent.append(node)
        return node

    def forget_cached(self) -> None:
        """Drop the in-memory inodes (after changes made by SQL alone, such as ``recover``)."""
        self._inodes = weakref.WeakValueDictionary()
        self._recent.clear()
        self._kept.clear()

    def create_inode(
        self, mode: int, uid: int, gid: int, *, target: bytes | None = None, nlink: int = 1, rdev: int = 0
    ) -> Inode:
        now = time.time_ns()
        size = len(target) if target is not None else 0
        # ids of deferred creates that a failed transaction lost stay out of use (``reserve_ids``): until the
        # next commit an id is chosen here, not by SQLite, whose sequence went back with the rollback
        cur = self.db.execute(
            "INSERT INTO inodes (id, mode, uid, gid, nlink, size, atime_ns, mtime_ns, ctime_ns, target, rdev)"
            " VALUES (?, ?, ?, ?, ?, ?, ?, ?, ?, ?, ?)",
            (self._last_id() + 1 if self._id_floor else None, mode, uid, gid, nlink, size, now, now, now, target,
             rdev),
        )
        new_id = cur.lastrowid
        assert new_id is not None  # an INSERT always has one
        if self._depth:
            self._created.append(new_id)
        if stat.S_ISDIR(mode):
            self._kept.made_empty(new_id)  # (a rollback empties the names, and this with them)
        return self._remember(Inode(new_id, mode, uid, gid, nlink, size, now, now, now, None, target, rdev))

    def has_row(self, ino: int) -> bool:
        """Whether the index holds inode *ino* (not only an object of this connection's: ``restore_inode``)."""
        return self.db.execute("SELECT 1 FROM inodes WHERE id = ?", (ino,)).fetchone() is not None

    def restore_inode(self, ino: int, mode: int, uid: int, gid: int, time_ns: int) -> Inode:
        """A created file put back under the id *ino* the kernel holds, with no content yet: a create whose
        transaction a failure rolled back, or whose daemon died before it committed
        (``cache.create_journal``).  The object in use for that id, if any, stays the one object for it
        and says what the row says."""
        node = self._inodes.get(ino)
        if node is None:
            node = self._remember(Inode(ino, mode, uid, gid, 1, 0, time_ns, time_ns, time_ns, None, None, 0))
        self.db.execute(f"INSERT INTO inodes ({_INODE_COLS}) VALUES ({', '.join('?' * 12)})",
                        (node.id, node.mode, node.uid, node.gid, node.nlink, node.size, node.atime_ns,
                         node.mtime_ns, node.ctime_ns, node.hash, node.target, node.rdev))
        if self._depth:
            self._created.append(ino)
        return node

    def create_names(self, names: list[NewName]) -> list[Inode]:
        """Names and their inodes in bulk, whatever is in them elsewhere (a file's content is the shared
        tier's, fetched at the first read): a startup set's thousands of names in a few statements a
        batch, not about ten a name (docs/benchmarks.md, "H2" and "H10").  Inside a transaction;
        each name is new in its directory, and a ``~i`` parent is a directory earlier in *names*.  Ids are
        handed out as SQLite would (after the highest ever used: ``AUTOINCREMENT``), so the rows and the
        objects agree; a directory counts the directories made in it (``nlink``), one already here once
        per call."""
        if not names:
            return []
        last = self._last_id()
        now = time.time_ns()
        parents = [n.parent if n.parent >= 0 else last + 1 + ~n.parent for n in names]
        subdirs = Counter(p for p, n in zip(parents, names) if stat.S_ISDIR(n.mode))
        nodes: list[Inode] = []
        for i, n in enumerate(names):
            ino = last + 1 + i
            nlink = 2 + subdirs.pop(ino, 0) if stat.S_ISDIR(n.mode) else 1
            nodes.append(Inode(ino, n.mode, n.uid, n.gid, nlink, n.size, now, n.mtime_ns, n.ctime_ns, n.digest,
                               n.target, 0))
        self.db.executemany(f"INSERT INTO inodes ({_INODE_COLS}) VALUES ({', '.join('?' * 12)})",
                            [(o.id, o.mode, o.uid, o.gid, o.nlink, o.size, now, o.mtime_ns, o.ctime_ns, o.hash,
                              o.target, 0) for o in nodes])
        self.add_references([n.digest for n in names if n.digest is not None])
        self.db.executemany("INSERT INTO dentries (parent, name, inode, published) VALUES (?, ?, ?, 1)",
                            [(p, n.name, o.id) for p, n, o in zip(parents, names, nodes)])
        if self._depth:
            self._created += [o.id for o in nodes]
        for p, n, node in zip(parents, names, nodes):  # the set's reader looks them up next (a rollback forgets them)
            self._remember(node)
            self._kept.keep((p, n.name), node.id)
        for p, count in subdirs.items():  # directories that were here before this call
            parent = self.get(p)
            assert parent is not None  # the caller names into a directory it holds
            self.add_link(parent, count, touch=False)
        return nodes

    def update_attrs(self, ino: Inode, **fields: int) -> None:
        """Write changed attribute columns of *ino* (and set them on the object)."""
        self._changing(ino)
        for k, v in fields.items():
            setattr(ino, k, v)
        cols = ", ".join(f"{k} = ?" for k in fields)
        self.db.execute(f"UPDATE inodes SET {cols} WHERE id = ?", (*fields.values(), ino.id))

    def add_link(self, ino: Inode, delta: int, *, touch: bool = True) -> None:
        """Change *ino*'s link count by *delta*; with *touch* (a change made here: the default) its ctime
        becomes now.  The shared tier's names a directory gets or loses here touch nothing: its ctime
        carries the version it was named with (a reader's startup record dates it so)."""
        self._changing(ino)
        ino.nlink += delta
        if touch:
            ino.ctime_ns = time.time_ns()
        self.db.execute(
            "UPDATE inodes SET nlink = ?, ctime_ns = ? WHERE id = ?", (ino.nlink, ino.ctime_ns, ino.id)
        )

    def delete_inode(self, ino: int) -> None:
        """Drop an inode that has no names left; its blob reference goes too."""
        row = self.db.execute("SELECT hash FROM inodes WHERE id = ?", (ino,)).fetchone()
        if row is None:
            return
        self.db.execute("DELETE FROM inodes WHERE id = ?", (ino,))
        self._inodes.pop(ino, None)
        self.confirm(ino)
        if row[0] is not None:
            self._decref(row[0])

    # -- content ---------------------------------------------------------
    def set_content(self, ino: Inode, digest: bytes, size: int, mtime_ns: int, *, confirmed: bool = True) -> None:
        """Point *ino* at blob *digest* (which must already have a row).

        Not *confirmed*: an idle-timer commit, recorded in ``unconfirmed``
        until ``confirm`` (see the table's comment).
        """
        if confirmed:
            self.confirm(ino.id)
        elif ino.id not in self.unconfirmed:
            self.db.execute("INSERT OR IGNORE INTO unconfirmed (inode) VALUES (?)", (ino.id,))
            self.unconfirmed.add(ino.id)
        old = ino.hash
        if old == digest:
            self.update_attrs(ino, size=size, mtime_ns=mtime_ns, ctime_ns=mtime_ns)
            return
        self.db.execute("UPDATE blobs SET refcount = refcount + 1 WHERE hash = ?", (digest,))
        self._changing(ino)
        ino.hash, ino.size, ino.mtime_ns, ino.ctime_ns = digest, size, mtime_ns, mtime_ns
        self.db.execute(
            "UPDATE inodes SET hash = ?, size = ?, mtime_ns = ?, ctime_ns = ? WHERE id = ?",
            (digest, size, mtime_ns, mtime_ns, ino.id),
        )
        if old is not None:
            self._decref(old)

    def confirm(self, ino: int) -> None:
        """The inode's committed content is whole (a rename, fsync, chmod, link or forget said so)."""
        if ino in self.unconfirmed:
            self.db.execute("DELETE FROM unconfirmed WHERE inode = ?", (ino,))
            self.unconfirmed.discard(ino)

    def drop_content(self, ino: Inode) -> None:
        """Forget an inode's content (its blob reference goes; the inode row stays)."""
        old = ino.hash
        self._changing(ino)
        ino.hash, ino.size = None, 0
        self.db.execute("UPDATE inodes SET hash = NULL, size = 0 WHERE id = ?", (ino.id,))
        if old is not None:
            self._decref(old)

    # -- directory entries -----------------------------------------------
    def lookup(self, parent: int, name: bytes) -> int | None:
        key = (parent, name)
        ino = self._kept.names.get(key)
        if ino is not None or parent in self._kept.whole:
            return ino
        row = self.db.execute(
            "SELECT inode FROM dentries WHERE parent = ? AND name = ?", key
        ).fetchone()
        if row is None:
            return None
        self._kept.keep(key, row[0])
        return row[0]

    def lookup_inode(self, parent: int, name: bytes) -> Inode | None:
        """``lookup`` and ``get`` in one: a name not kept in memory costs one query, not two."""
        key = (parent, name)
        ino = self._kept.names.get(key)
        if ino is not None:
            return self.get(ino)
        if parent in self._kept.whole:
            return None
        row = self.db.execute(
            f"SELECT {_INODE_COLS_OF_I} FROM dentries d JOIN inodes i ON i.id = d.inode"
            " WHERE d.parent = ? AND d.name = ?", key).fetchone()
        if row is None:
            return None
        self._kept.keep(key, row[0])
        return self._held_or_new(row)

    def _held_or_new(self, row: tuple | list) -> Inode:
        """The Inode of an index row: the object callers hold when there is one (one object per id)."""
        node = self._inodes.get(row[0])
        return node if node is not None else self._remember(Inode(*row))

    def preload_dir(self, parent: int) -> None:
        """Keep every name of a small directory in memory, with its inode, from one query.

        For after the LOOKUP of the directory is answered (``kernel.AfterReply``):
        a program entering a compiled kernel's directory opens its files next, and
        their LOOKUPs then find them here instead of in SQLite (docs/benchmarks.md,
        "K").  A directory of more than ``PRELOAD_MAX`` names
        is left to its lookups: most of it would be names nobody asks for.  Names
        are kept exactly as ``lookup_inode`` keeps them, so the rules that keep
        those right (every change goes through ``link``, ``unlink``, ``retarget``)
        keep these right too.  A directory read whole is kept whole (as is one
        made empty): ``link`` and ``retarget`` keep its new names, and a name it
        does not keep is absent without a query.
        """
        if not self._kept.enabled or self._depth or parent in self._kept.preloaded:
            return
        self._kept.preloaded.add(parent)
        rows = self.db.execute(
            f"SELECT d.name, {_INODE_COLS_OF_I} FROM dentries d JOIN inodes i ON i.id = d.inode"
            " WHERE d.parent = ? LIMIT ?", (parent, PRELOAD_MAX + 1)).fetchall()
        if len(rows) > PRELOAD_MAX:
            return
        for name, *cols in rows:
            self._kept.keep((parent, name), cols[0])
            self._held_or_new(cols)
        self._kept.loaded(parent)

    def link(self, parent: int, name: bytes, ino: int, *, published: bool = False) -> None:
        self.db.execute("INSERT INTO dentries (parent, name, inode, published) VALUES (?, ?, ?, ?)",
                        (parent, name, ino, int(published)))
        self._kept.changed((parent, name), ino)

    def is_published(self, parent: int, name: bytes) -> bool:
        row = self.db.execute(
            "SELECT published FROM dentries WHERE parent = ? AND name = ?", (parent, name)).fetchone()
        return bool(row and row[0])

    def mark_published(self, names: list[tuple[int, bytes]]) -> None:
        self.db.executemany("UPDATE dentries SET published = 1 WHERE parent = ? AND name = ?", names)

    def unlink(self, parent: int, name: bytes) -> None:
        self.db.execute("DELETE FROM dentries WHERE parent = ? AND name = ?", (parent, name))
        self._kept.gone((parent, name))

    def move(self, parent: int, name: bytes, new_parent: int, new_name: bytes) -> None:
        """Re-point one entry; gets a new readdir offset like a fresh entry."""
        ino = self.lookup(parent, name)
        if ino is None:
            raise KeyError(f"no entry {name!r} in directory {parent}")
        self.unlink(parent, name)
        self.link(new_parent, new_name, ino)

    def retarget(self, parent: int, name: bytes, ino: int) -> None:
        self.db.execute("UPDATE dentries SET inode = ? WHERE parent = ? AND name = ?", (ino, parent, name))
        self._kept.changed((parent, name), ino)

    def readdir(self, parent: int, after: int, limit: int = 256) -> list[Dentry]:
        rows = self.db.execute(
            "SELECT id, name, inode FROM dentries WHERE parent = ? AND id > ? ORDER BY id LIMIT ?",
            (parent, after, limit),
        ).fetchall()
        return [Dentry(*r) for r in rows]

    # -- recency ---------------------------------------------------------
    def set_atimes(self, items: list[tuple[int, int]]) -> None:
        """Write a batch of (atime_ns, inode) recency updates."""
        self.db.executemany("UPDATE inodes SET atime_ns = ? WHERE id = ?", items)
        for atime, ino in items:
            node = self._inodes.get(ino)
            if node is not None:
                node.atime_ns = atime

    # -- recovery --------------------------------------------------------
    def recover(self, *, after_crash: bool | None = None, live: bool = False) -> dict[str, int]:
        """Repair what an unclean stop can leave (``recovery.repair``): run at every mount, before serving.

        *after_crash*: by default what the clean mark says (the unmount's
        own tidy-up passes False).  *live*: a daemon taking over a mount the
        kernel still holds: only the refcounts are repaired.
        """
        with self.txn():
            clean = self.get_meta("clean") == "1" if after_crash is None else not after_crash
            counts = recovery.repair(self.db, clean=clean, live=live)
            self.set_meta("clean", "0")
        self.forget_cached()
        self.unconfirmed = self._load_unconfirmed()
        return counts

    def mark_clean(self) -> None:
        with self.txn():
            self.set_meta("clean", "1")


#: Longest name in a directory, as on ext4 (statfs reports it; longer ones get ENAMETOOLONG).
NAME_MAX = 255
#: The mount's control directory: a name of the root no stored entry may take.
CONTROL_NAME = b".mithrilfs"


def valid_name(name: bytes) -> bool:
    """A name a directory may hold and the mount can serve (what the kernel would accept from a user).

    Every way a name enters the index from outside the kernel (the shared
    tier, an archive import) checks it; fsck reports any that got in.
    """
    return 0 < len(name) <= NAME_MAX and b"/" not in name and b"\0" not in name and name not in (b".", b"..")


def servable(parent: int, name: bytes) -> bool:
    """``valid_name``, and not the control directory's place at the root."""
    return valid_name(name) and not (parent == ROOT_INODE and name == CONTROL_NAME)


def outside_mode(fmt: int, mode: int) -> int:
    """Permission bits for an entry that comes from outside the kernel (an archive, the shared tier).

    No set-user/group-id file: the importer would own it, and a copy taken
    off the (nosuid) mount would keep the bits.  A symlink is 0777, as the
    kernel makes them.  A directory keeps set-group-id and sticky.
    """
    if fmt == stat.S_IFLNK:
        return 0o777
    perm = stat.S_IMODE(mode)
    return perm & 0o777 if fmt == stat.S_IFREG else perm & ~stat.S_ISUID


def join_path(dir_path: str, name: bytes) -> str:
    """A name's path below *dir_path* ("" for the root), as stats, the shared tier and fsck spell it."""
    text = name.decode(errors="surrogateescape")
    return f"{dir_path}/{text}" if dir_path else text


class DirPaths:
    """Each directory's path from the mount root ("" for the root), cached.

    A directory has exactly one name, so the path is a walk up its parents;
    a directory rename clears the cache (``clear``).  Used for per-directory
    stats and as the shared tier's key.
    """

    def __init__(self, ns: Namespace) -> None:
        self.ns = ns
        self._paths: dict[int, str] = {ROOT_INODE: ""}

    def clear(self) -> None:
        self._paths = {ROOT_INODE: ""}

    def of_dir(self, d: int) -> str | None:
        """The directory's path; None once it has no name."""
        chain: list[tuple[int, bytes]] = []
        while (path := self._paths.get(d)) is None:
            names = self.ns.names_of(d)
            if not names:
                return None
            parent, name = names[0]
            chain.append((d, name))
            d = parent
        for child, name in reversed(chain):
            path = self._paths[child] = join_path(path, name)
        return path

    def dir_at(self, path: str) -> int | None:
        """The directory at *path* (the inverse of ``of_dir``); None when a part is missing or no directory."""
        d = ROOT_INODE
        for part in path.split("/") if path else []:
            child = self.ns.lookup(d, part.encode(errors="surrogateescape"))
            node = self.ns.get(child) if child is not None else None
            if node is None or not node.is_dir:
                return None
            d = node.id
        return d

    def of_name(self, parent: int, name: bytes) -> str:
        """A name's path ('?/name' when its directory has no name any more)."""
        base = self.of_dir(parent)
        return join_path("?" if base is None else base, name)
