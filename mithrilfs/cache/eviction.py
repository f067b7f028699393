"""Budget, watermarks, LRU order, pinning and Triton groups: which files go, and when.

Policy only: deciding *that* a unit goes lives here, removing its names
(and telling the kernel) lives in ``budget.Budget.evict_unit``, and the
settings it applies (budget, watermarks, ages) are ``policy.EvictionPolicy``.

Recency is the daemon's own clock, set on ``lookup`` and ``getattr`` (the
kernel's revalidations, at most one a minute per file in use) in memory
and written to ``inodes.atime_ns`` in batches, never the backing
filesystem's atime.  A unit is a file, or a whole Triton kernel directory
(one holding a ``__grp__*`` file): Triton's ``get_group`` trusts that every
child listed in the group file exists, so a half-evicted group would be
worse than a miss.  A group is placed in LRU order by its most recently used
member.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import trio
import trio.lowlevel

from mithrilfs.cache.policy import EvictionPolicy
from mithrilfs.cache.recency import Recency
from mithrilfs.store import reports
from mithrilfs.store.namespace import Namespace

log = logging.getLogger(__name__)

GROUP_PREFIX = b"__grp__"


@dataclass
class Unit:
    """What is evicted together: one file, or every file of a Triton group directory."""

    inodes: list[int]
    recency_ns: int
    group_dir: int | None = None


@dataclass
class EvictionResult:
    reason: str
    units: int = 0
    files: int = 0
    bytes: int = 0
    #: Part of ``bytes`` still held by the kernel (open or mapped files): freed at FORGET.
    deferred_bytes: int = 0
    skipped_pinned: int = 0

    def as_dict(self) -> dict[str, object]:
        return {"reason": self.reason, "units": self.units, "files": self.files, "bytes": self.bytes,
                "deferred_bytes": self.deferred_bytes, "skipped_pinned": self.skipped_pinned}


def lru_units(ns: Namespace) -> Iterator[Unit]:
    """Every unit, least recently used first (reads the namespace lazily, in pages)."""
    group_of_dir: dict[int, bool] = {}
    done_groups: set[int] = set()
    after = (-(1 << 63), 0)
    while True:
        page = ns.lru_files(after)
        if not page:
            return
        for atime, ino in page:
            after = (atime, ino)
            parent = ns.parent_of(ino)
            is_group = False
            if parent is not None:
                is_group = group_of_dir.get(parent)  # type: ignore[assignment]
                if is_group is None:
                    is_group = group_of_dir[parent] = ns.has_child_with_prefix(parent, GROUP_PREFIX)
            if not is_group:
                yield Unit([ino], atime)
                continue
            if parent is None or parent in done_groups:
                continue
            members = [child for _, child in ns.children(parent)]
            rows = [ns.get(m) for m in members]
            files = [r for r in rows if r is not None and not r.is_dir]
            newest = max(((r.atime_ns, r.id) for r in files if r.hash is not None), default=(atime, ino))
            if newest != (atime, ino):
                continue  # the group's place in LRU order is its newest member's
            done_groups.add(parent)
            yield Unit([r.id for r in files], atime, group_dir=parent)


def count_units(ns: Namespace) -> int:
    groups = ns.dirs_with_child_prefix(GROUP_PREFIX)
    in_groups = 0
    for g in groups:
        in_groups += sum(1 for _, child in ns.children(g) if (r := ns.get(child)) and r.hash is not None)
    return reports.count_content_files(ns) - in_groups + len(groups)


@dataclass
class Evictor:
    """Runs eviction passes: in the background on pressure or idleness, or on demand."""

    policy: EvictionPolicy
    ns: Namespace
    recency: Recency
    physical: Callable[[], int]
    #: Removes a unit; returns (bytes freed now, bytes freed when the kernel forgets
    #: the inodes), or None when the unit is pinned.
    evict_unit: Callable[[Unit, int], tuple[int, int] | None]
    on_result: Callable[[EvictionResult], None] = lambda r: None
    _wake: trio.Event = field(default_factory=trio.Event)
    _lock: trio.Lock = field(default_factory=trio.Lock)
    #: The pass under way (``stats`` shows it: the progress bar of ``gc`` and ``clear``).
    current: EvictionResult | None = None

    def over_high(self) -> bool:
        return self.physical() > self.policy.high_bytes

    def notify_growth(self) -> None:
        if self.over_high():
            self._wake.set()

    async def run(self, target_bytes: int | None, *, reason: str, idle_before_ns: int | None = None,
                  everything: bool = False) -> EvictionResult:
        """Evict LRU units until physical bytes <= target and no unit is idle past *idle_before_ns*.

        *everything* (``clear``): every unit not being written goes, however
        young, and ``min_entries`` does not hold it back.
        """
        async with self._lock:
            result = self.current = EvictionResult(reason)
            try:
                return await self._run(result, target_bytes, idle_before_ns, everything)
            finally:
                self.current = None

    async def _run(self, result: EvictionResult, target_bytes: int | None, idle_before_ns: int | None,
                   everything: bool) -> EvictionResult:
        self.recency.flush()
        young_cutoff = time.time_ns() - (0 if everything else int(self.policy.min_age * 1e9))
        min_entries = 0 if everything else self.policy.min_entries
        units_left = count_units(self.ns) if min_entries else 0
        for unit in lru_units(self.ns):
            # content of evicted files the kernel still holds goes at FORGET: count it as
            # freed, or one pass would evict everything while the notifications travel
            need_bytes = target_bytes is not None and self.physical() - result.deferred_bytes > target_bytes
            idle = idle_before_ns is not None and unit.recency_ns < idle_before_ns
            if not (need_bytes or idle):
                break
            if min_entries and units_left <= min_entries:
                break
            freed = self.evict_unit(unit, young_cutoff)
            if freed is None:
                result.skipped_pinned += 1
                continue
            result.units += 1
            result.files += len(unit.inodes)
            result.bytes += freed[0] + freed[1]
            result.deferred_bytes += freed[1]
            units_left -= 1
            if result.units % 64 == 0:
                await trio.lowlevel.checkpoint()  # let requests in between batches
        if result.units or result.reason != "pressure":
            self.on_result(result)
        return result

    async def make_room(self, needed: int) -> EvictionResult:
        """The backing disk is full before the budget is: free *needed* bytes now."""
        return await self.run(max(0, self.physical() - needed), reason="enospc")

    async def background(self) -> None:
        """Evict on pressure (woken by commits) and, with an idle TTL, periodically.

        A pass that stopped above the high watermark because the files left
        were too young runs again once they have aged (without it, a budget
        lowered by ``config`` or a burst of young files would stay exceeded
        until the next commit).  Periods are read from the policy each time:
        ``config`` may change it under a live mount.
        """
        young_left = False
        while True:
            period = min(max(self.policy.idle_ttl / 4, 0.5), 60.0) if self.policy.idle_ttl else float("inf")
            if young_left:
                period = min(period, max(self.policy.min_age, 0.5))
            with trio.move_on_after(period):
                await self._wake.wait()
            self._wake = trio.Event()
            idle_before = None
            if self.policy.idle_ttl:
                idle_before = time.time_ns() - int(self.policy.idle_ttl * 1e9)
            target = self.policy.low_bytes if self.over_high() else None
            young_left = False
            if target is None and idle_before is None:
                continue
            try:
                result = await self.run(target, reason="pressure" if target is not None else "idle-ttl",
                                        idle_before_ns=idle_before)
                young_left = result.skipped_pinned > 0 and self.over_high()
            except Exception:
                log.exception("eviction pass failed")
