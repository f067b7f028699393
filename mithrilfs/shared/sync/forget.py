"""``forget --fleet``: take names out of every node of the fleet, a whole cache entry at a time.

A bad entry (a stale or poisoned kernel) must go from every node, including
from processes that open its files by path.  The mount that is asked:

1. finds every name under each PATH, in the tier (its directories, listed:
   ``RemoteStore.dirs_under``; a node need not hold a name to purge it)
   and in its own index (names not uploaded yet);
2. publishes a tombstone for each, all with one version (this microsecond on
   the tier's clock, ``stores.clock``), written where newer, like any
   tombstone: a name written anywhere after the purge began is newer and
   stays; so a remount, a new node, or a node's queued upload of an older
   version never brings a purged name back (the tombstone wins at
   reconciliation, and the upload loses to it and takes it); an entry a
   writer dated past the tier's time holds nothing back;
3. keeps the purge's record beside the startup sets (``RemoteStore.keep_purge``): a new node, which
   never read the feed, creates a set's names without listing their directories, and checks them
   against it (``StartupOrder``);
4. announces the PATHs on the change feed (``sync.changes``), whole trees;
5. removes them here the same way every follower does (the kernel told);
6. lists the tier again: a live name left under a PATH (written after the purge began, or a tier that
   kept it) is named, and the command fails: it never says "forgot" of what every node still serves.

Steps 2 and 3 fail whole (nothing announced, nothing removed here) when the tier
does not answer: the command says so in one line and can be run again.
"""

from __future__ import annotations

import dataclasses
import logging
from collections.abc import Awaitable, Callable
from typing import Any

from mithrilfs.observe.events import EventLog
from mithrilfs.shared.stores.base import RemoteStore
from mithrilfs.shared.stores.clock import TierClock
from mithrilfs.shared.stores.entries import RemoteEntry, RemoteError
from mithrilfs.shared.sync.changes import Change, Changes, path_parts
from mithrilfs.store.namespace import ROOT_INODE, Namespace, join_path, servable

log = logging.getLogger(__name__)

#: Tombstones per publish request.
PUBLISH_BATCH = 512
#: Paths one command may name.
MAX_PATHS = 1000


@dataclasses.dataclass(frozen=True)
class PurgeTier:
    """What a purge works with, built by ``remote_tier``: the index, the store, the change feed, the events and
    counters, this node's name and the tier's worker threads."""

    ns: Namespace
    remote: RemoteStore
    changes: Changes
    events: EventLog
    counters: dict[str, int]
    node: str
    thread: Callable[..., Awaitable[Any]]

    @property
    def clock(self) -> TierClock:
        """The tier's time here (the store's clock): what the purge's version is dated by."""
        return self.remote.clock


def _under(path: str, d: str) -> bool:
    return d == path or d.startswith(path + "/")


def mount_path(path: str) -> bool:
    """A path a purge may name: every component a name, the first not the control directory (``servable``,
    the check the CLI makes too)."""
    parts = path_parts(path)
    return parts is not None and servable(ROOT_INODE, parts[0])


def remote_names(tier: PurgeTier, paths: list[str]) -> set[str]:
    """Every live name at or under *paths* in the tier (blocking: run in a thread)."""
    remote = tier.remote
    dirs = remote.dirs_under(paths)
    parents = sorted({p.rpartition("/")[0] for p in paths})
    listed = remote.list_dirs(sorted(set(dirs) | set(parents)))
    found: set[str] = set()
    for d, entries in listed.items():
        for name, entry in entries.items():
            path = join_path(d, name)
            if not entry.is_tombstone and any(_under(p, path) for p in paths):
                found.add(path)
    return found


def local_names(tier: PurgeTier, path: str) -> set[str]:
    """Every name at or under *path* in this node's index."""
    parts = path_parts(path)
    if parts is None:
        return set()
    ino: int | None = ROOT_INODE
    for part in parts:
        ino = tier.ns.lookup(ino, part) if ino is not None else None
    if ino is None:
        return set()
    found = {path}
    stack = [(ino, path)]
    while stack:
        d, d_path = stack.pop()
        for name, child in tier.ns.children(d):
            child_path = join_path(d_path, name)
            found.add(child_path)
            node = tier.ns.get(child)
            if node is not None and node.is_dir:
                stack.append((child, child_path))
    return found


async def forget_fleet(tier: PurgeTier, paths: list[str]) -> dict[str, Any]:
    """Purge *paths* (relative to the mount root) from the fleet; ``{"error": ...}`` in one line on failure."""
    if not paths or len(paths) > MAX_PATHS or not all(mount_path(p) for p in paths):
        return {"error": f"give 1 to {MAX_PATHS} paths inside the mount, outside its control directory"}
    try:
        await tier.thread(tier.clock.measure_if_due)
        version = tier.clock.now_us()
        names = await tier.thread(remote_names, tier, paths)
    except RemoteError as e:
        return {"error": f"{tier.remote.url}: {e}; nothing was forgotten"}
    for p in paths:
        names |= local_names(tier, p)
    names |= set(paths)  # the roots themselves, whether or not anyone holds them yet
    tombs = [(path, RemoteEntry("x", version, tier.node)) for path in sorted(names)]
    try:
        for start in range(0, len(tombs), PUBLISH_BATCH):
            await tier.thread(tier.remote.publish_entries, tombs[start:start + PUBLISH_BATCH])
    except RemoteError as e:
        return {"error": f"{tier.remote.url}: {e}; some tombstones may be published, run it again"}
    changes: list[Change] = [(p, version, True) for p in paths]
    try:
        await tier.changes.keep(changes)
    except RemoteError as e:
        return {"error": f"{tier.remote.url}: {e}; the tombstones are published, run it again"}
    announced = True
    try:
        await tier.changes.announce(changes)
    except RemoteError as e:
        announced = False
        log.warning("forget: tombstones published, the change feed not written: %s", e)
    removed = 0
    for p in paths:
        removed += await tier.changes.apply(p, version, True, tier.node)
    tier.counters["remote_tombstones"] += len(tombs)
    tier.events.emit("forget_fleet", paths=paths, tombstones=len(tombs), version=version)
    try:
        left = sorted(await tier.thread(remote_names, tier, paths))
    except RemoteError as e:
        return {"error": f"{len(tombs)} name(s) tombstoned, but the tier could not be listed again to check: {e}"}
    if left:
        shown = ", ".join(left[:5]) + (f" and {len(left) - 5} more" if len(left) > 5 else "")
        return {"error": f"{len(tombs)} name(s) tombstoned, but {len(left)} still live in the tier "
                         f"(written after the purge began, or kept by the tier): {shown}"}
    return {"tombstones": len(tombs), "removed_here": removed, "announced": announced, "version": version}
