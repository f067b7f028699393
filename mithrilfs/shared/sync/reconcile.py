"""Reconciliation: a directory's remote names merged into the local namespace, newest (version, node) wins.

Names the node lacks are created (content as a placeholder, fetched at the
first read); a name both sides have keeps the newer version, a newer local
one is sent again (*resend*), a tombstone removes the local name (a
directory only once nothing is left in it, after a sync of it: *resync*),
and two writers' different content for one path is reported as a conflict.
A blob's arrival removes the names that claim another size for it
(``arrived``).  Used by the tier's directory syncs, the fetches, the
prefetch, the startup set's names, the uploader and the change feed.
"""

from __future__ import annotations

import logging
import stat
import time
from collections.abc import Awaitable, Callable, Container

from mithrilfs.cache.lifetime import Lifetimes, Removed
from mithrilfs.observe.events import EventLog
from mithrilfs.shared.stores.clock import TierClock
from mithrilfs.shared.stores.entries import RemoteEntry
from mithrilfs.store.cas import EMPTY_DIGEST
from mithrilfs.store.namespace import ROOT_INODE, DirPaths, Inode, Namespace, NewName, join_path, outside_mode

log = logging.getLogger("mithrilfs.shared.remote_tier")  # the name operators know from the logs

#: A merge of more names than this reads the directory's names in one query instead of one lookup each
#: (a Triton kernel's directory holds 8).
MANY_NAMES = 4


class Reconciler:
    """The tier's merging of remote names into the local namespace (see the module doc)."""

    def __init__(self, *, ns: Namespace, paths: DirPaths, lifetimes: Lifetimes, events: EventLog,
                 counters: dict[str, int], clock: TierClock, node: str, owner: tuple[int, int] | None,
                 origin: dict[int, str], pending_tombstones: Container[str], resend: Callable[[int], None],
                 resync: Callable[[int], Awaitable[None]]) -> None:
        self.ns = ns
        self.paths = paths
        self.lifetimes = lifetimes
        self.events = events
        self.counters = counters
        #: The tier's time here: what versions are compared and dated by.
        self.clock = clock
        self.node = node
        #: Owner of materialized entries (``--remote-owner``); None: the mount root's at the time.
        self.owner = owner
        #: Writer of content materialized this mount (conflict detection), by inode: written here.
        self.origin = origin
        #: Removed paths whose tombstones are not sent yet (``Outbox``): never materialized meanwhile.
        self.pending_tombstones = pending_tombstones
        #: Queue a local version to be sent again (``Outbox.queue_upload``).
        self.resend = resend
        #: Merge a directory's remote names now, waited for (the tier's ``sync_dir``, forced).
        self.resync = resync

    def merge(self, d: int, dir_path: str, entries: dict[bytes, RemoteEntry],
              only: set[bytes] | None = None) -> list[tuple[bytes, int, RemoteEntry]]:
        """Materialize a directory's remote names it lacks, in one transaction (*only*: just these).

        Returns (name, local inode, entry) for the names it already has, to reconcile.
        """
        parent = self.ns.get(d)
        if parent is None or not parent.is_dir:
            return []
        existing = []
        wanted: list[tuple[int, bytes, RemoteEntry]] = []
        with self.ns.txn():
            listed: dict[int, dict[bytes, int]] = {}
            for name, entry in entries.items():
                if only is not None and name not in only:
                    continue
                local = self._here(d, name, len(entries) > MANY_NAMES, listed)
                if local is not None:
                    existing.append((name, local, entry))
                elif self._wanted(join_path(dir_path, name), entry):
                    wanted.append((d, name, entry))
            self.create(wanted)
        return existing

    def merge_paths(self, items: list[tuple[str, RemoteEntry]], made_here: set[int]) -> list[str]:
        """Materialize the names of *items* this node lacks, as ``merge`` does, in one batch inside the open
        transaction: paths from the mount's root, each directory before what it holds (a startup set's
        order), its kernel directories and their files named together in a few statements (``create``).
        *made_here*: the directories this transaction made, kept up to date: nothing else names into
        them, so what they hold is not looked up.  Returns the paths whose directory this node lacks."""
        made: dict[str, int] = {}  # a directory this batch makes: its index in wanted
        dirs: dict[str, int | None] = {}
        wanted: list[tuple[int, bytes, RemoteEntry]] = []
        unresolved: list[str] = []
        for path, entry in items:
            d, _, text = path.rpartition("/")
            name = text.encode(errors="surrogateescape")
            if d in made:
                parent = ~made[d]
            else:
                found = dirs[d] if d in dirs else dirs.setdefault(d, self.paths.dir_at(d))
                if found is None:
                    unresolved.append(path)
                    continue
                parent = found
                if parent not in made_here and self.ns.lookup(parent, name) is not None:
                    continue  # a name this node has: its own (what ``merge`` hands back to reconcile)
            if not self._wanted(path, entry):
                continue
            if entry.type == "d":
                made[path] = len(wanted)
            wanted.append((parent, name, entry))
        nodes = self.create(wanted)
        made_here.update(nodes[i].id for i in made.values())  # type: ignore[union-attr]  # never refused
        return unresolved

    def _here(self, d: int, name: bytes, many: bool, listed: dict[int, dict[bytes, int]]) -> int | None:
        """The local inode of *name* in *d*, if any; *many*: of many names asked there, so the directory's
        names are read in one query (into *listed*) instead of one lookup each."""
        if not many:
            return self.ns.lookup(d, name)
        if d not in listed:
            listed[d] = dict(self.ns.children(d))
        return listed[d].get(name)

    def _wanted(self, path: str, entry: RemoteEntry) -> bool:
        """Whether a name this node lacks is created: not a tombstone, not one this node deleted and has
        not yet told the tier."""
        return not entry.is_tombstone and path not in self.pending_tombstones

    async def reconcile(self, parent: int, name: bytes, ino_id: int, entry: RemoteEntry, path: str) -> None:
        """One name both sides have: the newer version wins here; ours, if newer, is sent again."""
        ino = self.ns.get(ino_id)
        if ino is None or self.lifetimes.is_written(ino_id):
            return  # a write in progress wins when it commits
        if not entry.newer_than(self.clock.version_of(ino.ctime_ns), self.origin.get(ino_id, self.node)):
            if not ino.is_dir and not self._same(ino, entry):
                self.resend(ino_id)  # ours is newer: the tier holds an older (or replayed) version
            return
        if self._same(ino, entry):
            return
        if entry.is_tombstone and ino.is_dir:
            await self._purge_dir(ino)
            if self.ns.has_children(ino.id):
                return  # it holds names nobody deleted: kept
        elif ino.is_dir or entry.type == "d":
            return  # a directory and a file under one name: keep the local one
        self._note_conflict(path, ino, entry)
        self.replace(parent, name, ino, None if entry.is_tombstone else entry)

    async def _purge_dir(self, d: Inode) -> None:
        """A directory deleted elsewhere: apply the tombstones of its names (a bounded walk)."""
        await self.resync(d.id)
        for _name, child in self.ns.children(d.id):
            node = self.ns.get(child)
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
        ours = self.origin.get(ino.id, self.node)
        if theirs.type == "f" and ino.is_reg and ours != theirs.node:
            mine = RemoteEntry("f", self.clock.version_of(ino.ctime_ns), ours, (ino.hash or EMPTY_DIGEST).hex(), ino.size)
            self.conflict(path, mine, theirs, kept=theirs.node)

    def conflict(self, path: str, a: RemoteEntry, b: RemoteEntry, *, kept: str) -> None:
        """Two writers gave one path different content: a non-deterministic build or a cache-key collision."""
        self.counters["remote_conflicts"] += 1
        log.warning("conflict at %s: %s wrote %s, %s wrote %s; keeping the newer (%s's)",
                    path, a.node, (a.hash or "")[:16], b.node, (b.hash or "")[:16], kept)
        self.events.emit("conflict", path=path, **{a.node: a.hash, b.node: b.hash}, kept=kept)

    def replace(self, parent: int, name: bytes, old: Inode, entry: RemoteEntry | None) -> None:
        """Point a local name at a newer remote version (or remove it, for a tombstone)."""
        parent_ino = self.ns.get(parent)
        if parent_ino is None:
            return
        with self.ns.txn():
            self.lifetimes.drop_name(parent_ino, name, old, touch=False)  # the tier's change
            if entry is not None:
                self._create(parent_ino, name, entry)
        self.counters["remote_adopted"] += 1
        try:
            self.lifetimes.delete_if_unused(old.id)
        except OSError as e:
            log.warning("cannot delete inode %d yet: %s", old.id, e)
            self.lifetimes.doomed.add(old.id)
        removed: list[Removed] = [(parent, name, old.id)]
        self.lifetimes.tell_kernel(removed)

    def create(self, wanted: list[tuple[int, bytes, RemoteEntry]]) -> list[Inode | None]:
        """Local inodes and names for remote entries (parent, name, entry), all at once
        (``Namespace.create_names``), inside a transaction; a file's content a placeholder, fetched at the
        first read.  A parent may be ``~i``, the i-th of *wanted* (a directory).  A file whose content this
        node holds with another size is refused (counted; None in the answer)."""
        if not wanted:
            return []
        uid, gid = self._owner()
        digests = {e.hash: bytes.fromhex(e.hash) for _, _, e in wanted if e.type == "f"}  # type: ignore[arg-type]
        known = self.ns.sizes_known(list(digests.values()))
        new: list[NewName] = []
        at: list[int | None] = []  # each wanted's place in new
        now = time.time_ns()
        for parent, name, e in wanted:
            if parent < 0:
                parent = ~at[~parent]  # type: ignore[operator]  # a directory: never refused
            mtime_ns = e.mtime_ns or now
            if e.type == "f":
                digest = digests[e.hash or ""]
                if known.get(digest, e.size) != e.size:
                    self._reject(name, e.size, known[digest])
                    at.append(None)
                    continue
                new.append(NewName(parent, name, stat.S_IFREG | outside_mode(stat.S_IFREG, e.mode), uid, gid, digest,
                                   e.size, mtime_ns, self.clock.local_ns(e.version)))
            elif e.type == "d":
                new.append(NewName(parent, name, stat.S_IFDIR | outside_mode(stat.S_IFDIR, e.mode), uid, gid, None,
                                   0, mtime_ns, self.clock.local_ns(e.version)))
            else:
                target = (e.target or "").encode(errors="surrogateescape")
                new.append(NewName(parent, name, stat.S_IFLNK | 0o777, uid, gid, None, len(target), mtime_ns,
                                   self.clock.local_ns(e.version), target))
            at.append(len(new) - 1)
        nodes = self.ns.create_names(new)
        for node, (_, _, e) in zip(nodes, (w for w, i in zip(wanted, at) if i is not None)):
            self.origin[node.id] = e.node
        return [None if i is None else nodes[i] for i in at]

    def _owner(self) -> tuple[int, int]:
        """Who owns what the tier creates: the mount's owner (``--owner``), else the root's."""
        if self.owner is not None:
            return self.owner
        root = self.ns.get(ROOT_INODE)
        assert root is not None
        return root.uid, root.gid

    def _reject(self, name: bytes, size: int, known: int) -> None:
        # this node holds that content: its size is a fact, and the entry says another
        self.counters["remote_rejected"] += 1
        log.warning("remote entry %r ignored: size %d, but its content is %d bytes", name, size, known)

    def _create(self, parent: Inode, name: bytes, e: RemoteEntry) -> None:
        """A local inode and name for a remote entry (``create``, inside a transaction)."""
        self.create([(parent.id, name, e)])

    def arrived(self, blobs: list[tuple[bytes, int]]) -> None:
        """Contents (digest, size) now in the store: names that claim another size for one go.

        An entry's size is the tier's word and the hash is the content's
        name, so an entry naming that content with another size lies (hostile
        or broken).  ``create`` refuses such entries when the content is
        here first; this catches those that came first, before a read can
        serve them the content cut or padded.  A file being written is left
        alone (its size is its writer's).  One query for a batch (a prefetch's).
        """
        sizes = dict(blobs)
        liars: dict[bytes, list[Inode]] = {}
        for ino_id, digest, size in self.ns.inodes_with_hashes(sizes):
            if size != sizes[digest] and not self.lifetimes.is_written(ino_id):
                node = self.ns.get(ino_id)
                if node is not None and node.is_reg and node.size != sizes[digest]:
                    liars.setdefault(digest, []).append(node)
        for digest, nodes in liars.items():
            self.counters["remote_rejected"] += len(nodes)
            log.warning("%d name(s) claim %d bytes for blob %s of %d: removed", len(nodes), nodes[0].size,
                        digest.hex(), sizes[digest])
            self.lifetimes.forget_content(digest, nodes)
