"""The ``blobs`` table: one row per content hash, with its size and the count of inodes pointing at it.

Blob refcounts count *inodes* that point at a hash (hard links share one
inode, hence one reference).  A blob row with refcount 0 is garbage: its file
may or may not exist and is removed by ``collect_garbage``.  A row is written
with refcount 0 *before* a staging file is renamed into ``objects/``, so a
crash between the rename and the pointing transaction leaves a row that
startup collects, never an untracked file.

SQL on this one table only, no inode objects: ``namespace.Namespace`` is a
``BlobRows`` that also holds the inodes and names pointing at the rows
(``set_content`` and ``drop_content`` move a reference), in the same
transactions.
"""

from __future__ import annotations

import sqlite3

from mithrilfs.store.schema import select_in


class BlobRows:
    """Blob rows of the index on ``db`` (the caller opens the transactions)."""

    db: sqlite3.Connection

    def blob_intent(self, digest: bytes, size: int) -> None:
        """Record a blob about to appear on disk (refcount 0 until pointed at).

        A row that exists keeps its refcount; a placeholder's size 0 (content
        still remote) becomes the real size.
        """
        self.db.execute(
            "INSERT INTO blobs (hash, size, refcount) VALUES (?, ?, 0)"
            " ON CONFLICT (hash) DO UPDATE SET size = excluded.size WHERE size != excluded.size",
            (digest, size),
        )

    def add_references(self, digests: list[bytes]) -> None:
        """One more inode points at each of *digests* (a digest twice: two more); a digest without a row
        gets one as a placeholder: a blob known by name only (its content elsewhere, fetched on first
        use), size 0."""
        self.db.executemany("INSERT INTO blobs (hash, size, refcount) VALUES (?, 0, 1)"
                            " ON CONFLICT (hash) DO UPDATE SET refcount = refcount + 1", [(d,) for d in digests])

    def blob_intents(self, items: list[tuple[bytes, int]]) -> None:
        """``blob_intent`` for many (digest, size)."""
        self.db.executemany(
            "INSERT INTO blobs (hash, size, refcount) VALUES (?, ?, 0)"
            " ON CONFLICT (hash) DO UPDATE SET size = excluded.size WHERE size != excluded.size", items)

    def sizes_known(self, digests: list[bytes]) -> dict[bytes, int]:
        """The size of each of *digests* this store holds the content of (a row with a size): one query
        per 500."""
        return dict(select_in(self.db, "SELECT hash, size FROM blobs WHERE size > 0 AND hash IN ({})", digests))

    def _decref(self, digest: bytes) -> None:
        self.db.execute("UPDATE blobs SET refcount = refcount - 1 WHERE hash = ?", (digest,))

    def refcount(self, digest: bytes) -> int | None:
        row = self.db.execute("SELECT refcount FROM blobs WHERE hash = ?", (digest,)).fetchone()
        return row[0] if row else None

    def blob_info(self, digest: bytes) -> tuple[int, int] | None:
        """(refcount, size) of a blob row."""
        row = self.db.execute("SELECT refcount, size FROM blobs WHERE hash = ?", (digest,)).fetchone()
        return (row[0], row[1]) if row else None

    def garbage(self) -> list[bytes]:
        """Blobs no inode points at any more (their files are to be deleted)."""
        return [r[0] for r in self.db.execute("SELECT hash FROM blobs WHERE refcount <= 0")]

    def blob_never_came(self, digest: bytes) -> None:
        """Undo ``blob_intent`` for content fetched from the shared tier whose file could not be written.

        A name still pointing at it is a placeholder again (size 0: its
        content is in the tier, fetched at the first read), not a local blob
        gone missing; a row nothing points at goes.
        """
        self.db.execute("UPDATE blobs SET size = 0 WHERE hash = ? AND refcount > 0", (digest,))
        self.db.execute("DELETE FROM blobs WHERE hash = ? AND refcount <= 0", (digest,))

    def forget_blob(self, digest: bytes) -> None:
        self.db.execute("DELETE FROM blobs WHERE hash = ? AND refcount <= 0", (digest,))

    def blob_count(self) -> int:
        return self.db.execute("SELECT count(*) FROM blobs WHERE refcount > 0").fetchone()[0]

    def physical_bytes(self) -> int:
        return self.db.execute("SELECT coalesce(sum(size), 0) FROM blobs").fetchone()[0]

    def blob_sizes(self) -> dict[bytes, int]:
        """Every blob row's size, by digest (the recount after an unclean stop checks them against the disk)."""
        return dict(self.db.execute("SELECT hash, size FROM blobs"))
