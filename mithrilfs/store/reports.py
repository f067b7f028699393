"""Whole-index questions for ``stats``: full scans, so asked on a reader connection in a thread."""

from __future__ import annotations

from mithrilfs.store.namespace import ROOT_INODE, Namespace


def totals(ns: Namespace) -> tuple[int, int, int]:
    """(named regular files, sum of their sizes, blobs in use): full scans, so keep them off hot paths."""
    files, logical = ns.db.execute(
        "SELECT count(*), coalesce(sum(size), 0) FROM inodes WHERE nlink > 0 AND (mode & 61440) = 32768"
    ).fetchone()
    return files, logical, ns.blob_count()


def usage_by_top(ns: Namespace) -> list[tuple[str, int, int, int]]:
    """(top-level name, files, their bytes, bytes of their distinct blobs) per entry of the root.

    What takes the space, as ``stats`` shows it: inductor, triton, ...
    A recursive walk of the entries, so a full scan: run it on a reader
    in a thread.  Files at the root count under their own name.
    """
    rows = ns.db.execute(
        """WITH RECURSIVE tree(ino, top) AS (
               SELECT inode, name FROM dentries WHERE parent = ?
               UNION ALL
               SELECT d.inode, tree.top FROM dentries d JOIN tree ON d.parent = tree.ino
           ), files AS (
               SELECT tree.top AS top, i.hash AS hash, i.size AS size
               FROM tree JOIN inodes i ON i.id = tree.ino WHERE (i.mode & 61440) = 32768
           )
           SELECT f.top, f.n, f.bytes, coalesce(u.stored, 0) FROM
               (SELECT top, count(*) AS n, coalesce(sum(size), 0) AS bytes FROM files GROUP BY top) f
               LEFT JOIN (SELECT top, sum(b.size) AS stored FROM (SELECT DISTINCT top, hash FROM files) h
                          JOIN blobs b ON b.hash = h.hash GROUP BY top) u ON u.top = f.top
           ORDER BY 4 DESC, 3 DESC""",
        (ROOT_INODE,),
    ).fetchall()
    return [(bytes(top).decode(errors="surrogateescape"), n, size, stored) for top, n, size, stored in rows]


def largest_files(ns: Namespace, limit: int) -> list[tuple[int, bytes, int]]:
    """(parent, name, size) of the *limit* largest named regular files."""
    return ns.db.execute(
        "SELECT d.parent, d.name, i.size FROM inodes i JOIN dentries d ON d.inode = i.id"
        " WHERE (i.mode & 61440) = 32768 ORDER BY i.size DESC LIMIT ?",
        (limit,),
    ).fetchall()


def count_content_files(ns: Namespace) -> int:
    """Named files with content: what eviction's ``min_entries`` counts."""
    return ns.db.execute("SELECT count(*) FROM inodes WHERE hash IS NOT NULL AND nlink > 0").fetchone()[0]
