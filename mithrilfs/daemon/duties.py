"""What a live mount does besides answering requests: background loops, the stats snapshot, the end.

- ``background``: the evictor's passes, idle commits, the shared tier's
  work, recency and the kept counters written to the index in batches,
  deferred deletes retried, the index's reserve taken back once a full disk
  has room again, and the snapshot Prometheus serves refreshed.
- ``snapshot``: what ``stats.json`` (``fresh_snapshot``) and Prometheus show.
- ``unmounting`` (a clean unmount is a commit point) and ``shutdown`` (tidy
  the index, mark the store clean), or ``hand_over`` (a restart: the
  successor serves what the kernel still holds, so nothing is tidied away).
"""

from __future__ import annotations

import functools
import logging
import os
import sqlite3
import time
from typing import Any

import trio

from mithrilfs import __version__
from mithrilfs.cache.budget import Budget
from mithrilfs.cache.lifetime import Lifetimes
from mithrilfs.cache.recency import Recency
from mithrilfs.cache.recompiles import Recompiles
from mithrilfs.cache.writepath import IDLE_COMMIT_SECONDS, WritePath
from mithrilfs.daemon.channel import Restarts, Supervisor
from mithrilfs.observe.events import EventLog
from mithrilfs.observe.stats import KeptCounters
from mithrilfs.shared.tier import Tier
from mithrilfs.store import reports
from mithrilfs.store.namespace import Namespace
from mithrilfs.store.open import Store
from mithrilfs.store.wal_checkpoints import WalCheckpoints

log = logging.getLogger(__name__)

RECENCY_FLUSH_SECONDS = 5.0
SNAPSHOT_SECONDS = 1.0
SUMMARY_SECONDS = 60.0
#: How often the WAL is looked at (a ``stat``) and, when a commit wrote it, checkpointed in a thread.
CHECKPOINT_SECONDS = 0.5


class Duties:
    def __init__(self, store: Store, budget: Budget, writes: WritePath, lifetimes: Lifetimes, recency: Recency,
                 tier: Tier, kept: KeptCounters, events: EventLog,
                 restarts: Restarts, recompiles: Recompiles, supervisor: Supervisor) -> None:
        self.store = store
        self.recompiles = recompiles
        #: Asked at every snapshot whether it still lives (``status`` says when it does not).
        self.supervisor = supervisor
        self.ns = store.ns
        self.budget = budget
        self.policy = budget.policy
        self.writes = writes
        self.lifetimes = lifetimes
        self.recency = recency
        self.tier = tier
        self.kept = kept
        self.events = events
        self.restarts = restarts
        #: What the last background refresh saw; served to Prometheus from its own thread.
        self.cached_snapshot: dict[str, Any] = {}
        #: The index's checkpoints, off the event loop while ``background`` runs (``_checkpoints``); none
        #: before (``stats.json`` counts them).
        self.wal = WalCheckpoints.none()
        #: A second connection for the totals' full scans, in a thread, one at a time (``totals``).
        self._reader: Namespace | None = None
        self._reading = trio.Lock()

    async def background(self) -> None:
        """Long-running duties of a live, writable mount (see the module doc)."""
        if self.store.read_only:
            return
        async with trio.open_nursery() as nursery:
            nursery.start_soon(self.budget.evictor.background)
            nursery.start_soon(self._summaries)
            nursery.start_soon(self._idle_commits)
            nursery.start_soon(self._checkpoints)
            nursery.start_soon(self.tier.run)
            while True:
                await trio.sleep(RECENCY_FLUSH_SECONDS)
                try:
                    self.recency.flush()
                    self.kept.save()
                except (sqlite3.Error, OSError) as e:
                    log.warning("could not write recency and counters to the index: %s", e)
                self.lifetimes.retry_doomed()
                self.recompiles.tick()
                self.supervisor.state()  # its death is logged when noticed, not only when someone asks
                self.store.ensure_reserve()  # taken back once a full disk has room again

    async def _checkpoints(self) -> None:
        """The index's WAL checkpointed in a thread whenever a commit wrote it, never at the event loop's
        commits (``wal_checkpoints``); at the end (an unmount, a handoff) the commits do it again."""
        wal = self.wal = WalCheckpoints.take_over(self.ns.db)
        try:
            while True:
                await trio.sleep(CHECKPOINT_SECONDS)
                if wal.changed():
                    try:
                        await trio.to_thread.run_sync(wal.run)
                    except sqlite3.Error as e:  # a busy or full disk: the WAL grows until the next one
                        log.warning("could not checkpoint the index: %s", e)
        finally:
            WalCheckpoints.give_back(self.ns.db)
            wal.close()

    async def _idle_commits(self) -> None:
        """Commit files nobody wrote for ``IDLE_COMMIT_SECONDS``, unconfirmed (see ``writepath``).

        Files written in place and never renamed are then deduplicated,
        counted in the budget as blobs and published like any other.
        """
        while True:
            await trio.sleep(IDLE_COMMIT_SECONDS / 2)
            idle = self.writes.idle(time.monotonic() - IDLE_COMMIT_SECONDS)
            try:
                # files staged in memory in batches; the rest (or everything, after an error) one by one
                left = await self.writes.commit_idle(idle)
            except (sqlite3.Error, OSError) as e:
                log.warning("idle commit of %d files failed (%s); committing them one by one", len(idle), e)
                left = idle
            for of in left:
                try:
                    await self.budget.retry_when_full(functools.partial(self.writes.commit, of, confirmed=False))
                except (sqlite3.Error, OSError) as e:
                    log.warning("idle commit of inode %d failed: %s", of.inode.id, e)

    async def _summaries(self) -> None:
        """Refresh the snapshot Prometheus serves; write a summary event now and then."""
        last_summary = time.monotonic()
        while True:
            snap = await self.fresh_snapshot()
            if time.monotonic() - last_summary >= SUMMARY_SECONDS:
                last_summary = time.monotonic()
                self.events.emit("summary", **{k: snap[k] for k in (
                    "hits", "misses", "hit_rate", "files", "physical_bytes", "logical_bytes", "evictions",
                    "commits", "corrupt_blobs")})
            await trio.sleep(SNAPSHOT_SECONDS)

    async def fresh_snapshot(self) -> dict[str, Any]:
        """``snapshot``, its totals counted in a thread on a second connection: they scan every file (a
        few milliseconds per 5,000), and ``stats.json`` is read ten times a second by whoever follows a
        prefetch; on the event loop that was 4% of a prefetch's time."""
        try:
            self.ns.commit_deferred()  # what a second connection counts: the creates left to commit too
            async with self._reading:
                if self._reader is None:
                    self._reader = self.ns.reader()
                # not the mount's limiter: threads waiting on a stalled tier must not hold stats (``status``)
                totals = await trio.to_thread.run_sync(reports.totals, self._reader)
        except sqlite3.Error as e:  # a second connection that cannot open or read: counted here, as before
            log.warning("stats counted on the event loop: the index's reader failed: %s", e)
            totals = reports.totals(self.ns)
        return self.snapshot(totals)

    def snapshot(self, totals: tuple[int, int, int] | None = None) -> dict[str, Any]:
        """Current stats; *totals* (files, logical bytes, blobs) when the caller already counted them."""
        files, logical, blobs = totals if totals is not None else reports.totals(self.ns)
        evictor = self.budget.evictor
        snap = self.kept.stats.snapshot({
            "logical_bytes": logical,
            "physical_bytes": self.budget.physical(),
            "max_bytes": self.policy.max_bytes,
            "low_bytes": self.policy.low_bytes,
            "files": files,
            "blobs": blobs,
            "index_checkpoints": self.wal.runs,
            "index_checkpointed_frames": self.wal.frames,
            "written_files": len(self.writes.staged),
            "evicted_files": self.budget.evicted_files,
            "full_disk_waits": self.budget.room_waits,
            "pid": os.getpid(),
            "version": __version__,
            "store": str(self.store.root),
            "read_only": self.store.read_only,
            "eviction": evictor.current.as_dict() if evictor.current is not None else None,
            **self.tier.snapshot(),
            **self.restarts.as_stats(),
            "supervisor": self.supervisor.state(),
        })
        self.cached_snapshot = snap
        return snap

    async def unmounting(self) -> None:
        """A clean unmount is a commit point: everything written is committed (unconfirmed, see ``writepath``)."""
        if self.store.read_only:
            return
        try:
            await self.writes.commit_all()
        except (sqlite3.Error, OSError) as e:
            log.error("could not commit every written file at unmount: %s", e)
        await self.tier.unmounting()

    def hand_over(self) -> None:
        """A restart: keep what the successor needs (no recovery, no clean mark: the mount lives on).

        A file whose writes failed stays in the supervisor's set of written
        files, so the successor fails its writer too instead of writing on
        from its last committed content.
        """
        self.close_reader()
        if self.store.read_only:
            return
        try:
            self.recency.flush()
            self.kept.save()
        except (sqlite3.Error, OSError) as e:
            log.error("could not save recency and counters before the handoff: %s", e)

    def close_reader(self) -> None:
        if self._reader is not None:
            self._reader.close()
            self._reader = None

    def shutdown(self) -> None:
        """Drop what could not be committed, tidy the index and mark the store clean."""
        self.close_reader()
        self.writes.shutdown()
        self.lifetimes.clear()
        if self.store.read_only:
            return
        try:
            self.recency.flush()
            self.kept.save()
            self.ns.recover(after_crash=False)
            self.store.collect_garbage()
            self.ns.mark_clean()
        except (sqlite3.Error, OSError) as e:
            # e.g. the store went read-only: the next mount repairs what this could not
            log.error("could not tidy the store at unmount: %s", e)
