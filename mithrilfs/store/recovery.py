"""What an unclean stop can leave in the index, repaired: run by ``Namespace.recover`` at every mount.

Inodes with no names were only kept alive by kernel references, which
do not survive a remount.  Refcounts are recomputed from the inodes
so a crash between steps can never leak or double-free a blob.  After
an unclean stop the names of unconfirmed commits are dropped; after a
clean one every unconfirmed mark is settled: kept for good.

Kept apart from ``namespace`` because it is SQL over whole tables, run
once per mount, and reasons about every table at once, where the
namespace changes one row and the objects that mirror it.
"""

from __future__ import annotations

import sqlite3


def repair(db: sqlite3.Connection, *, clean: bool, live: bool) -> dict[str, int]:
    """Repair the index on *db* in the caller's transaction; what was dropped, counted.

    *clean*: the last stop was clean (or this is the unmount's own
    tidy-up).  *live*: a daemon taking over a mount the kernel still holds.
    Inodes with no names may be open or mapped, and unconfirmed content may
    belong to a writer that is still running, so both stay; only the
    refcounts are repaired.
    """
    unconfirmed = unlinked = 0
    if live:
        pass
    elif not clean:
        # idle-timer commits nothing confirmed may be snapshots of a paused writer:
        # their names go, and the framework sees a miss and recompiles
        unconfirmed = db.execute(
            "DELETE FROM dentries WHERE inode IN (SELECT inode FROM unconfirmed)").rowcount
        db.execute("UPDATE inodes SET nlink = 0 WHERE id IN (SELECT inode FROM unconfirmed)")
        db.execute("DELETE FROM unconfirmed")
    else:
        # a clean stop keeps what it committed (as it always has), so the mark has done its
        # work; kept, it would drop at some later unclean stop a name every mount since served
        db.execute("DELETE FROM unconfirmed")
    if not live:
        unlinked = db.execute("DELETE FROM inodes WHERE nlink <= 0").rowcount
    dangling = 0
    if not clean or unlinked:
        # full scans: only after an unclean stop (or when inodes were dropped)
        dangling = db.execute(
            "DELETE FROM dentries WHERE inode NOT IN (SELECT id FROM inodes)"
        ).rowcount
        db.execute(
            "UPDATE blobs SET refcount = (SELECT count(*) FROM inodes WHERE inodes.hash = blobs.hash)"
        )
        db.execute(
            "INSERT OR IGNORE INTO blobs (hash, size, refcount)"
            " SELECT hash, size, count(*) FROM inodes WHERE hash IS NOT NULL GROUP BY hash"
        )
    return {"dangling_entries": dangling, "unlinked_inodes": unlinked, "unconfirmed_names_dropped": unconfirmed}
