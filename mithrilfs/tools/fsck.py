"""Offline check and repair of a store (not mounted): blobs, index and their agreement.

Checks every blob's blake3 against its name, finds orphan blobs (on disk,
unreferenced), dangling references (names to missing inodes, inodes to
missing blobs), wrong refcounts and link counts, leftover staging files and
unlinked inodes.  ``repair`` fixes them: corrupt blobs go to quarantine and
the names that pointed at them are removed (a cache miss, never wrong bytes);
everything derived (refcounts, link counts) is recomputed from the entries.
"""

from __future__ import annotations

import os
import stat
from collections.abc import Callable
from dataclasses import dataclass, field

from mithrilfs.store.cas import DIGEST_SIZE
from mithrilfs.store.namespace import ROOT_INODE, DirPaths, servable
from mithrilfs.store.open import Store

Progress = Callable[[int, int], None]


@dataclass
class FsckReport:
    blobs_checked: int = 0
    corrupt: list[bytes] = field(default_factory=list)
    missing: list[bytes] = field(default_factory=list)
    orphans: list[bytes] = field(default_factory=list)
    stray_files: list[str] = field(default_factory=list)
    bad_refcounts: int = 0
    dangling_entries: int = 0
    dangling_content: int = 0
    bad_nlinks: int = 0
    unlinked_inodes: int = 0
    bad_sizes: int = 0
    staging_files: int = 0
    #: Paths (from the mount root) of the files whose content is a corrupt blob: what a repair removes.
    corrupt_files: list[str] = field(default_factory=list)
    #: Paths of names the mount cannot serve (over 255 bytes, "/", NUL, "." or "..", the control directory's):
    #: no rm could remove them.
    bad_names: list[str] = field(default_factory=list)

    def problems(self) -> dict[str, int]:
        found = {
            "corrupt blobs": len(self.corrupt),
            "missing blobs": len(self.missing),
            "orphan blobs": len(self.orphans),
            "stray files": len(self.stray_files),
            "wrong refcounts": self.bad_refcounts,
            "dangling entries": self.dangling_entries,
            "inodes without content": self.dangling_content,
            "wrong link counts": self.bad_nlinks,
            "unlinked inodes": self.unlinked_inodes,
            "wrong sizes": self.bad_sizes,
            "staging files": self.staging_files,
            "names the mount cannot serve": len(self.bad_names),
        }
        return {k: v for k, v in found.items() if v}

    def summary(self) -> str:
        problems = self.problems()
        if not problems:
            return f"{self.blobs_checked} blobs verified, no problems"
        listed = ", ".join(f"{n} {what}" for what, n in problems.items())
        return f"{self.blobs_checked} blobs verified, {sum(problems.values())} problems: {listed}"


def check(store: Store, progress: Progress | None = None) -> FsckReport:
    report = FsckReport()
    db = store.ns.db
    report.staging_files = sum(1 for _ in os.scandir(store.cas.staging))

    on_disk: dict[bytes, int] = {}
    for sub in os.scandir(store.cas.objects):
        if not sub.is_dir():
            report.stray_files.append(sub.path)
            continue
        for entry in os.scandir(sub.path):
            name = entry.name
            if len(name) == 2 * DIGEST_SIZE and name.startswith(sub.name):
                try:
                    on_disk[bytes.fromhex(name)] = entry.stat().st_size
                    continue
                except ValueError:
                    pass
            report.stray_files.append(entry.path)

    total = len(on_disk)
    for i, digest in enumerate(sorted(on_disk), start=1):
        if not store.blobs.verify(digest):
            report.corrupt.append(digest)
        report.blobs_checked = i
        if progress:
            progress(i, total)

    report.corrupt_files = _names_of(store, report.corrupt)

    rows = {h: (size, rc) for h, size, rc in db.execute("SELECT hash, size, refcount FROM blobs")}
    actual_refs = dict(db.execute("SELECT hash, count(*) FROM inodes WHERE hash IS NOT NULL GROUP BY hash"))
    for digest in set(rows) | set(actual_refs):
        stored = rows.get(digest, (None, 0))[1]
        if stored != actual_refs.get(digest, 0):
            report.bad_refcounts += 1
    for digest, (size, _) in rows.items():
        if digest in on_disk and on_disk[digest] != size:
            report.bad_sizes += 1
    # a row of size 0 without a file is a placeholder: content still in the shared tier
    placeholders = {d for d, (size, _) in rows.items() if size == 0 and d not in on_disk}
    report.missing = sorted(d for d in actual_refs if d not in on_disk and d not in placeholders)
    report.orphans = sorted(d for d in on_disk if actual_refs.get(d, 0) == 0)
    report.bad_sizes += sum(
        1 for (digest,) in db.execute(
            "SELECT i.hash FROM inodes i JOIN blobs b ON b.hash = i.hash WHERE i.size != b.size"
        ) if digest not in placeholders
    )
    report.dangling_content = db.execute(
        "SELECT count(*) FROM inodes WHERE hash IS NOT NULL AND hash NOT IN (SELECT hash FROM blobs)"
    ).fetchone()[0]
    report.dangling_entries = db.execute(
        "SELECT count(*) FROM dentries d LEFT JOIN inodes i ON i.id = d.inode LEFT JOIN inodes p ON p.id = d.parent"
        " WHERE i.id IS NULL OR p.id IS NULL OR (p.mode & ?) != ?",
        (0o170000, stat.S_IFDIR),
    ).fetchone()[0]
    report.unlinked_inodes = db.execute("SELECT count(*) FROM inodes WHERE nlink <= 0").fetchone()[0]
    report.bad_nlinks = sum(1 for _ in _wrong_nlinks(store))
    paths = DirPaths(store.ns)
    report.bad_names = sorted(paths.of_name(parent, bytes(name))
                              for parent, name in db.execute("SELECT parent, name FROM dentries")
                              if not servable(parent, bytes(name)))
    return report


def _names_of(store: Store, digests: list[bytes]) -> list[str]:
    paths = DirPaths(store.ns)
    found = []
    for digest in digests:
        for ino in store.ns.inodes_with_hash(digest):
            found += [paths.of_name(parent, name) for parent, name in store.ns.names_of(ino)]
    return sorted(found)


def as_json(report: FsckReport) -> dict:
    """The report for ``fsck --json``: counts by problem, and the corrupt files by name."""
    return {"blobs_checked": report.blobs_checked, "problems": report.problems(),
            "corrupt_files": report.corrupt_files, "bad_names": report.bad_names}


def _wrong_nlinks(store: Store):
    """(inode, stored, actual) for every inode whose link count disagrees with the entries."""
    db = store.ns.db
    names = dict(db.execute("SELECT inode, count(*) FROM dentries GROUP BY inode"))
    subdirs = dict(
        db.execute(
            "SELECT d.parent, count(*) FROM dentries d JOIN inodes i ON i.id = d.inode"
            " WHERE (i.mode & ?) = ? GROUP BY d.parent",
            (0o170000, stat.S_IFDIR),
        )
    )
    for ino, mode, nlink in db.execute("SELECT id, mode, nlink FROM inodes WHERE nlink > 0").fetchall():
        if stat.S_ISDIR(mode):
            named = ino == ROOT_INODE or names.get(ino, 0) > 0
            actual = 2 + subdirs.get(ino, 0) if named else 0
        else:
            actual = names.get(ino, 0)
        if actual != nlink:
            yield ino, nlink, actual


def repair(store: Store, report: FsckReport) -> None:
    """Fix what ``check`` found; afterwards ``check`` reports nothing."""
    db = store.ns.db
    ns = store.ns
    bad = set(report.corrupt) | set(report.missing)
    for digest in report.corrupt:
        store.blobs.quarantine(digest)
    with ns.txn():
        for digest in bad:
            for ino in ns.inodes_with_hash(digest):
                db.execute("DELETE FROM dentries WHERE inode = ?", (ino,))
                db.execute("DELETE FROM inodes WHERE id = ?", (ino,))
            db.execute("DELETE FROM blobs WHERE hash = ?", (digest,))
        # names of inodes whose content row is gone
        for (ino,) in db.execute(
            "SELECT id FROM inodes WHERE hash IS NOT NULL AND hash NOT IN (SELECT hash FROM blobs)"
        ).fetchall():
            db.execute("DELETE FROM dentries WHERE inode = ?", (ino,))
            db.execute("DELETE FROM inodes WHERE id = ?", (ino,))
        # names the mount cannot serve go with what is under them (the cascade below)
        for dentry_id, parent, name in db.execute("SELECT id, parent, name FROM dentries").fetchall():
            if not servable(parent, bytes(name)):
                db.execute("DELETE FROM dentries WHERE id = ?", (dentry_id,))
        # entries to nothing, or under something that is not a directory, and inodes no name reaches:
        # repeated until neither changes (each removal can orphan the next level down)
        while True:
            gone = db.execute(
                "DELETE FROM inodes WHERE id != ? AND id NOT IN (SELECT inode FROM dentries)", (ROOT_INODE,)
            ).rowcount
            gone += db.execute(
                "DELETE FROM dentries WHERE id IN (SELECT d.id FROM dentries d LEFT JOIN inodes i ON i.id = d.inode"
                " LEFT JOIN inodes p ON p.id = d.parent WHERE i.id IS NULL OR p.id IS NULL OR (p.mode & ?) != ?)",
                (0o170000, stat.S_IFDIR),
            ).rowcount
            if not gone:
                break
        for ino, _, actual in list(_wrong_nlinks(store)):
            db.execute("UPDATE inodes SET nlink = ? WHERE id = ?", (actual, ino))
        db.execute("DELETE FROM inodes WHERE nlink <= 0 AND id != ?", (ROOT_INODE,))
        # blob rows follow the files, inode sizes the blob rows, refcounts the inodes
        for digest, in db.execute("SELECT hash FROM blobs").fetchall():
            size = _file_size(store, digest)
            if size is not None:
                db.execute("UPDATE blobs SET size = ? WHERE hash = ? AND size != ?", (size, digest, size))
        db.execute(
            "UPDATE inodes SET size = (SELECT size FROM blobs WHERE blobs.hash = inodes.hash)"
            " WHERE hash IS NOT NULL AND size != (SELECT size FROM blobs WHERE blobs.hash = inodes.hash)"
            " AND (SELECT size FROM blobs WHERE blobs.hash = inodes.hash) > 0"
        )
        db.execute(
            "UPDATE blobs SET refcount = (SELECT count(*) FROM inodes WHERE inodes.hash = blobs.hash)"
        )
    for digest in report.orphans:
        if digest not in bad:
            store.cas.delete(digest)
    store.collect_garbage()
    for path in report.stray_files:
        try:
            os.unlink(path)
        except (FileNotFoundError, IsADirectoryError):
            pass
    store.cas.clear_staging()
    store.ns.forget_cached()  # rows changed by SQL alone above
    store.ns.mark_clean()


def _file_size(store: Store, digest: bytes) -> int | None:
    try:
        return os.stat(store.cas.path(digest)).st_size
    except FileNotFoundError:
        return None
