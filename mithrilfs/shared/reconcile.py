"""Reconciliation: a directory's remote names merged into the local namespace, newest (version, node) wins.

Part of ``remote_tier.RemoteTier`` (its ``reconciler``): names the node lacks
are created (content as a placeholder, fetched at the first read); a name
both sides have keeps the newer version, a newer local one is sent again, a
tombstone removes the local name (a directory only once nothing is left in
it), and two writers' different content for one path is reported as a
conflict.  Used by the tier's directory syncs, the prefetch, the startup
set's names, the uploader and the change feed.
"""

from __future__ import annotations

import logging
import stat
import time

from mithrilfs.cache.lifetime import Removed
from mithrilfs.shared.entries import RemoteEntry
from mithrilfs.shared.tier_state import ReconcileTier
from mithrilfs.shared.write_behind import version_of
from mithrilfs.store.cas import EMPTY_DIGEST
from mithrilfs.store.namespace import ROOT_INODE, Inode, NewFile, join_path, outside_mode

log = logging.getLogger("mithrilfs.shared.remote_tier")  # the name operators know from the logs

#: A merge of more names than this reads the directory's names in one query instead of one lookup each
#: (a Triton kernel's directory holds 8).
MANY_NAMES = 4


class Reconciler:
    """The tier's merging of remote names into the local namespace (see the module doc)."""

    def __init__(self, tier: ReconcileTier) -> None:
        self.tier = tier

    def merge(self, d: int, dir_path: str, entries: dict[bytes, RemoteEntry],
              only: set[bytes] | None = None) -> list[tuple[bytes, int, RemoteEntry]]:
        """Materialize a directory's remote names it lacks, in one transaction (*only*: just these).

        Returns (name, local inode, entry) for the names it already has, to reconcile.
        """
        parent = self.tier.ns.get(d)
        if parent is None or not parent.is_dir:
            return []
        existing = []
        files: list[tuple[bytes, RemoteEntry]] = []
        with self.tier.ns.txn():
            # many names: the directory's names in one query (a startup set's, a listing's), not one each
            here = dict(self.tier.ns.children(d)) if len(entries) > MANY_NAMES else None
            for name, entry in entries.items():
                if only is not None and name not in only:
                    continue
                local = here.get(name) if here is not None else self.tier.ns.lookup(d, name)
                if local is not None:
                    existing.append((name, local, entry))
                elif not entry.is_tombstone and join_path(dir_path, name) not in self.tier.pending_tombstones:
                    if entry.type == "f":  # created together, below
                        files.append((name, entry))
                    else:
                        self._create(parent, name, entry)
            self._create_files(parent, files)
        return existing

    async def reconcile(self, parent: int, name: bytes, ino_id: int, entry: RemoteEntry, path: str) -> None:
        """One name both sides have: the newer version wins here; ours, if newer, is sent again."""
        ino = self.tier.ns.get(ino_id)
        if ino is None or self.tier.lifetimes.is_written(ino_id):
            return  # a write in progress wins when it commits
        if not entry.newer_than(version_of(ino), self.tier.origin.get(ino_id, self.tier.node)):
            if not ino.is_dir and not self._same(ino, entry):
                self.tier.behind.queue_upload(ino_id)  # ours is newer: Redis holds an older (or replayed) version
            return
        if self._same(ino, entry):
            return
        if entry.is_tombstone and ino.is_dir:
            await self._purge_dir(ino)
            if self.tier.ns.has_children(ino.id):
                return  # it holds names nobody deleted: kept
        elif ino.is_dir or entry.type == "d":
            return  # a directory and a file under one name: keep the local one
        self._note_conflict(path, ino, entry)
        self.replace(parent, name, ino, None if entry.is_tombstone else entry)

    async def _purge_dir(self, d: Inode) -> None:
        """A directory deleted elsewhere: apply the tombstones of its names (a bounded walk)."""
        await self.tier.sync_dir(d.id, force=True)
        for _name, child in self.tier.ns.children(d.id):
            node = self.tier.ns.get(child)
            if node is not None and node.is_dir:
                await self._purge_dir(node)

    def _same(self, ino: Inode, e: RemoteEntry) -> bool:
        if e.is_tombstone:
            return False
        if e.type == "d":
            return ino.is_dir
        if e.type == "l":
            return stat.S_ISLNK(ino.mode) and (ino.target or b"") == (e.target or "").encode(errors="surrogateescape")
        return ino.is_reg and (ino.hash or EMPTY_DIGEST).hex() == e.hash

    def _note_conflict(self, path: str, ino: Inode, theirs: RemoteEntry) -> None:
        """A newer version from another writer replaces different local content."""
        ours = self.tier.origin.get(ino.id, self.tier.node)
        if theirs.type == "f" and ino.is_reg and ours != theirs.node:
            mine = RemoteEntry("f", version_of(ino), ours, (ino.hash or EMPTY_DIGEST).hex(), ino.size)
            self.conflict(path, mine, theirs, kept=theirs.node)

    def conflict(self, path: str, a: RemoteEntry, b: RemoteEntry, *, kept: str) -> None:
        """Two writers gave one path different content: a non-deterministic build or a cache-key collision."""
        self.tier.counters["remote_conflicts"] += 1
        log.warning("conflict at %s: %s wrote %s, %s wrote %s; keeping the newer (%s's)",
                    path, a.node, (a.hash or "")[:16], b.node, (b.hash or "")[:16], kept)
        self.tier.events.emit("conflict", path=path, **{a.node: a.hash, b.node: b.hash}, kept=kept)

    def replace(self, parent: int, name: bytes, old: Inode, entry: RemoteEntry | None) -> None:
        """Point a local name at a newer remote version (or remove it, for a tombstone)."""
        parent_ino = self.tier.ns.get(parent)
        if parent_ino is None:
            return
        with self.tier.ns.txn():
            self.tier.lifetimes.drop_name(parent_ino, name, old)
            if entry is not None:
                self._create(parent_ino, name, entry)
        self.tier.counters["remote_adopted"] += 1
        try:
            self.tier.lifetimes.delete_if_unused(old.id)
        except OSError as e:
            log.warning("cannot delete inode %d yet: %s", old.id, e)
            self.tier.lifetimes.doomed.add(old.id)
        removed: list[Removed] = [(parent, name, old.id)]
        self.tier.lifetimes.tell_kernel(removed)

    def _create_files(self, parent: Inode, files: list[tuple[bytes, RemoteEntry]]) -> None:
        """Local inodes and names for remote files, all at once (``Namespace.create_files``), inside a
        transaction; their content a placeholder, fetched at the first read.  An entry whose content this
        node holds with another size is refused (counted)."""
        if not files:
            return
        uid, gid = self._owner()
        digests = [bytes.fromhex(e.hash) for _, e in files]  # type: ignore[arg-type]
        known = self.tier.ns.sizes_known(digests)
        new: list[NewFile] = []
        origins: list[str] = []
        for (name, e), digest in zip(files, digests):
            if known.get(digest, e.size) != e.size:
                self._reject(name, e.size, known[digest])
                continue
            new.append(NewFile(name, stat.S_IFREG | outside_mode(stat.S_IFREG, e.mode), uid, gid, digest, e.size,
                               e.mtime_ns or time.time_ns(), e.version * 1000))
            origins.append(e.node)
        for node, origin in zip(self.tier.ns.create_files(parent.id, new), origins):
            self.tier.origin[node.id] = origin

    def _owner(self) -> tuple[int, int]:
        """Who owns what the tier creates: the mount's owner (``--owner``), else the root's."""
        if self.tier.owner is not None:
            return self.tier.owner
        root = self.tier.ns.get(ROOT_INODE)
        assert root is not None
        return root.uid, root.gid

    def _reject(self, name: bytes, size: int, known: int) -> None:
        # this node holds that content: its size is a fact, and the entry says another
        self.tier.counters["remote_rejected"] += 1
        log.warning("remote entry %r ignored: size %d, but its content is %d bytes", name, size, known)

    def _create(self, parent: Inode, name: bytes, e: RemoteEntry) -> None:
        """A local inode and name for a remote entry (inside a transaction), with its version as ctime; a
        file through ``_create_files``, which refuses one that contradicts what this node knows."""
        if e.type == "f":
            self._create_files(parent, [(name, e)])
            return
        uid, gid = self._owner()
        if e.type == "d":
            node = self.tier.ns.create_inode(stat.S_IFDIR | outside_mode(stat.S_IFDIR, e.mode), uid, gid, nlink=2)
            self.tier.ns.add_link(parent, +1)
        else:
            node = self.tier.ns.create_inode(stat.S_IFLNK | 0o777, uid, gid,
                                             target=(e.target or "").encode(errors="surrogateescape"))
        self.tier.ns.update_attrs(node, ctime_ns=e.version * 1000, mtime_ns=e.mtime_ns or node.mtime_ns)
        self.tier.ns.link(parent.id, name, node.id, published=True)
        self.tier.origin[node.id] = e.node
