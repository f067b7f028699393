"""What a daemon puts right before it serves: the leftovers of an unclean stop, and what a successor inherits.

A new mount undoes what a crash can leave in the store (``repair_at_startup``);
a successor also adopts the files its predecessor was writing and drops the
names of those it cannot continue (``take_over``).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Collection

from mithrilfs.cache.lifetime import Removed
from mithrilfs.daemon import wiring
from mithrilfs.daemon.channel import Handover
from mithrilfs.store.open import RESERVE_BYTES, Store

log = logging.getLogger(__name__)


def repair_at_startup(store: Store, *, live: bool = False, keep: Collection[str] = ()) -> bool:
    """Undo what an unclean stop can leave: staging files, unlinked inodes, unreferenced blobs.

    True when the last stop was unclean.  *live*: a takeover, where the
    kernel still holds inodes (``Namespace.recover``) and the staging files
    in *keep* are adopted.
    """
    after_crash = store.ns.get_meta("clean") != "1"
    stale = store.cas.clear_staging(keep)
    repaired = store.ns.recover(live=live)
    freed = store.collect_garbage()
    if not store.ensure_reserve():
        log.warning("could not reserve %d bytes on the store's disk", RESERVE_BYTES)
    if stale or any(repaired.values()) or freed:
        log.info("startup repair: %d staging files, %s, %d unreferenced blobs", stale, repaired, freed)
    return after_crash


def take_over(store: Store, mounted: wiring.Mounted, handover: Handover) -> list[Removed]:
    """What a successor inherits from the kernel and from the daemon before it (see the module doc).

    Returns the names it removed, for the kernel once the session can tell it (after the resend).
    """
    ops = mounted.ops
    if not store.read_only:
        for ino_id in store.ns.unlinked_inodes():  # those the kernel no longer holds go now
            ops.lifetimes.delete_if_unused(ino_id)
    adopted = 0
    for ino_id, fd, path in handover.staged:
        ino = store.ns.get(ino_id)
        if ino is None or not ino.is_reg or store.read_only:
            os.close(fd)
            continue
        ops.writes.adopt(ino, ops.tops.of_file(ino_id), fd, path)
        adopted += 1
    torn = set(handover.torn)
    removed: list[Removed] = []
    if torn and not store.read_only:
        # a snapshot the idle timer took of a file that was written further since is no whole file:
        # its names go, as after any crash (the writer learns it from its next write)
        with store.ns.txn():
            for ino_id in torn & store.ns.unconfirmed:
                ino = store.ns.get(ino_id)
                if ino is not None:
                    ops.lifetimes.remove_all_names([ino], removed, keep_content=True)
    ops.writes.torn(torn)
    log.info("took over the live mount after a %s: %d files being written go on, %d lost their uncommitted "
             "writes", handover.restarts.cause, adopted, len(torn))
    return removed
