"""Questions on the index answered by SQL alone: no inode objects, nothing changed.

Asked by eviction (least recently used files, Triton's group files), the
shared tier (a directory's names, an inode's names, the inodes holding a
content) and repair.  ``namespace.Namespace`` is a ``NameQueries`` (as it is
a ``blob_rows.BlobRows``): the changes, and the inode objects they keep
right, are its own.
"""

from __future__ import annotations

import sqlite3
from collections.abc import Iterable

from mithrilfs.store.schema import select_in


class NameQueries:
    """Read-only questions on ``db`` (see the module doc)."""

    db: sqlite3.Connection

    def has_children(self, ino: int) -> bool:
        return self.db.execute("SELECT 1 FROM dentries WHERE parent = ? LIMIT 1", (ino,)).fetchone() is not None

    def parent_of(self, ino: int) -> int | None:
        """The directory holding *ino* (directories have exactly one name)."""
        row = self.db.execute("SELECT parent FROM dentries WHERE inode = ? LIMIT 1", (ino,)).fetchone()
        return row[0] if row else None

    def inodes_with_hash(self, digest: bytes, limit: int = -1) -> list[int]:
        return [r[0] for r in self.db.execute("SELECT id FROM inodes WHERE hash = ? LIMIT ?", (digest, limit))]

    def names_of(self, ino: int) -> list[tuple[int, bytes]]:
        return self.db.execute("SELECT parent, name FROM dentries WHERE inode = ?", (ino,)).fetchall()

    def children(self, parent: int) -> list[tuple[bytes, int]]:
        return self.db.execute("SELECT name, inode FROM dentries WHERE parent = ?", (parent,)).fetchall()

    def has_child_with_prefix(self, parent: int, prefix: bytes) -> bool:
        upper = prefix[:-1] + bytes([prefix[-1] + 1])
        row = self.db.execute(
            "SELECT 1 FROM dentries WHERE parent = ? AND name >= ? AND name < ? LIMIT 1", (parent, prefix, upper)
        ).fetchone()
        return row is not None

    def dirs_with_child_prefix(self, prefix: bytes) -> list[int]:
        upper = prefix[:-1] + bytes([prefix[-1] + 1])
        rows = self.db.execute(
            "SELECT DISTINCT parent FROM dentries WHERE name >= ? AND name < ?", (prefix, upper)
        ).fetchall()
        return [r[0] for r in rows]

    def inodes_with_hashes(self, digests: Iterable[bytes]) -> list[tuple[int, bytes, int]]:
        """(inode, hash, size) of every inode whose content is one of *digests*: one query per 500."""
        return select_in(self.db, "SELECT id, hash, size FROM inodes WHERE hash IN ({})", digests)

    def lru_files(self, after: tuple[int, int], limit: int = 512) -> list[tuple[int, int]]:
        """(atime_ns, id) of named files with content, least recently used first, after *after*."""
        return self.db.execute(
            "SELECT atime_ns, id FROM inodes WHERE hash IS NOT NULL AND nlink > 0"
            " AND (atime_ns, id) > (?, ?) ORDER BY atime_ns, id LIMIT ?",
            (*after, limit),
        ).fetchall()

    def unlinked_inodes(self) -> list[int]:
        """Inodes with no name left (kept while the kernel holds them)."""
        return [r[0] for r in self.db.execute("SELECT id FROM inodes WHERE nlink <= 0")]
