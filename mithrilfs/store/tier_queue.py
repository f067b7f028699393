"""What this node owes the shared tier, kept in the index so that nothing queued is lost.

``upload_queue`` holds (inode, queued_ns) of names to publish (an inode
queued again keeps only its newest row, so a row sent meanwhile does not
take the newer one with it); ``tombstone_queue`` holds (path, version) of
names users removed.  Both survive unmount and kill -9; after an unclean
stop the tier queues everything again anyway.
"""

from __future__ import annotations

from mithrilfs.store.namespace import Namespace


class TierQueue:
    def __init__(self, ns: Namespace) -> None:
        self.ns = ns

    def add(self, inodes: list[int], queued_ns: int) -> None:
        self.ns.db.executemany("INSERT OR REPLACE INTO upload_queue (inode, queued_ns) VALUES (?, ?)",
                            [(i, queued_ns) for i in inodes])

    def add_all(self, now_ns: int, delay_ns: int, *, unpublished_only: bool = False) -> int:
        """Queue every named file and symlink (*unpublished_only*: those with a name never published nor
        taken from the tier), each due *delay_ns* after its last change (ctime), at once when that is past;
        how many.

        Not all due at once: a name changed a moment ago waits the delay as one its commit queued does (a
        temporary name renamed away meanwhile is never sent).  A ctime ahead of this clock (another
        node's) counts as now.
        """
        only = " AND id IN (SELECT inode FROM dentries WHERE published = 0)" if unpublished_only else ""
        return self.ns.db.execute(
            "INSERT OR REPLACE INTO upload_queue (inode, queued_ns) SELECT id, MAX(?, MIN(ctime_ns, ?)) FROM inodes"
            " WHERE nlink > 0 AND ((mode & 61440) = 32768 OR (mode & 61440) = 40960)" + only,
            (now_ns - delay_ns, now_ns)).rowcount

    def holds(self, inode: int) -> bool:
        """Whether *inode* waits to be published (or is being sent: a row goes once its batch is sent)."""
        return self.ns.db.execute("SELECT 1 FROM upload_queue WHERE inode = ?", (inode,)).fetchone() is not None

    def due(self, before_ns: int, limit: int) -> list[tuple[int, int]]:
        """(inode, queued_ns) queued at or before *before_ns*, oldest first."""
        return self.ns.db.execute(
            "SELECT inode, queued_ns FROM upload_queue WHERE queued_ns <= ? ORDER BY queued_ns LIMIT ?",
            (before_ns, limit)).fetchall()

    def queued_after(self, after_ns: int, limit: int) -> list[int]:
        """Inodes queued after *after_ns* (not due yet): which directories are still being written."""
        return [row[0] for row in self.ns.db.execute(
            "SELECT inode FROM upload_queue WHERE queued_ns > ? LIMIT ?", (after_ns, limit))]

    def sent(self, done: list[tuple[int, int]]) -> None:
        """Drop sent (inode, queued_ns) rows; one queued again since keeps its newer row."""
        self.ns.db.executemany("DELETE FROM upload_queue WHERE inode = ? AND queued_ns = ?", done)

    def add_tombstone(self, path: str, version: int) -> None:
        self.ns.db.execute("INSERT OR REPLACE INTO tombstone_queue (path, version) VALUES (?, ?)", (path, version))

    def tombstones(self, limit: int = -1) -> list[tuple[str, int]]:
        """(path, version) of queued tombstones; at most *limit* (-1: all)."""
        return self.ns.db.execute("SELECT path, version FROM tombstone_queue LIMIT ?", (limit,)).fetchall()

    def tombstones_sent(self, done: list[tuple[str, int]]) -> None:
        self.ns.db.executemany("DELETE FROM tombstone_queue WHERE path = ? AND version = ?", done)

    def length(self) -> int:
        return (self.ns.db.execute("SELECT count(*) FROM upload_queue").fetchone()[0]
                + self.ns.db.execute("SELECT count(*) FROM tombstone_queue").fetchone()[0])
