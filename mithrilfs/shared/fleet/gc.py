"""``fleet gc``: a budget for the shared tier -- delete what has gone unused longest, then what nothing names.

A run, on any store (its ``collector.Collector``, built by ``connect.collector_for``):

1. list every directory's entries and the use records (``fleet.usage``);
   directories no node ever recorded are given "now" (they start aging);
   a store that pays a request per directory reads only those changed since
   the last run (``Collector.keep_listing``, written at the end of a run);
2. choose: the cache entries (directories holding files) unused longer than
   ``max_age``, then the least recently used until the bytes the remaining
   names reference fit ``max_size``;
3. delete their names: per name, only if it still holds what was listed (a
   name published meanwhile stays); a directory left empty leaves its
   parent, and is put back if a writer filled it meanwhile (writers publish
   a directory's names before its entry in its parent);
4. list again and re-link directories whose parent lacks them (a run killed
   between steps, a race the check above lost);
5. delete blob containers (a blob object or chunks; a bucket's pack) that
   no name references, and last written before the names were listed less
   the grace (``ages.min_grace``): a blob a writer relied on is never
   deleted before its name is published and listed.  A pack is one
   container, referenced by the entries that locate a blob in it (``pk``):
   deleted when none does; a partly dead pack stays (compaction is not
   built).  Writers trust a pack's place only while the pack is
   younger than ``ages.BLOB_TRUST_SECONDS`` (its time is in the place), so
   the grace covers packs as it covers blobs.

Everything read is hostile: entries are validated (``parse_entry``, without
their signature: an entry signed with another key still protects its blob).
What the report counts as names is what nodes serve (``served``): files and
symlinks whose entries nodes accept, signed with gc's key when it has one;
tombstones and refused entries are no names (refused ones are counted in
``rejected`` with the run's other refused data).
"""

from __future__ import annotations

import functools
import logging
import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

from mithrilfs.crash_points import crash_point
from mithrilfs.shared.stores.base import RemoteStore
from mithrilfs.shared.stores.collector import Collector, Container
from mithrilfs.shared.stores.entries import RemoteEntry, parse_entry
from mithrilfs.shared.stores.summary import make_summary
from mithrilfs.store.namespace import join_path, valid_name

log = logging.getLogger(__name__)

#: The node id of the directory entries gc puts back (re-linking an orphaned directory).
GC_NODE = "fleet-gc"


@dataclass
class Unit:
    """A cache entry: one directory's names (raw values, so a delete can check they did not change)."""

    path: str
    raw: dict[bytes, bytes]
    blobs: dict[str, int] = field(default_factory=dict)
    last_use: float = 0.0

    @property
    def files(self) -> dict[bytes, bytes]:
        """The names gc deletes with the unit: everything but subdirectories (their own units)."""
        return {n: v for n, v in self.raw.items() if not _is_dir(v)}


def _is_dir(raw: bytes) -> bool:
    e = _entry(raw)
    return e is not None and e.type == "d"


@functools.lru_cache(maxsize=1 << 18)
def _entry(raw: bytes) -> RemoteEntry | None:
    """The entry *raw* holds (parsed once however often a run looks at it, up to a bound on memory; emptied
    when a run ends), None when it is none."""
    try:
        return parse_entry(raw)[0]
    except ValueError:
        return None


@dataclass
class Plan:
    units: dict[str, Unit]
    victims: list[Unit]
    by_age: int
    referenced_bytes: int
    kept_bytes: int


@dataclass
class Report:
    dry_run: bool
    dirs: int = 0
    names: int = 0
    deleted_dirs: int = 0
    deleted_names: int = 0
    deleted_blobs: int = 0
    #: Packs deleted (a bucket's; their bytes are in ``freed_bytes`` with the blobs').
    deleted_packs: int = 0
    freed_bytes: int = 0
    kept_bytes: int = 0
    blobs: int = 0
    packs: int = 0
    bytes: int = 0
    relinked: int = 0
    #: Data refused as hostile during the run (entries, manifests, use records that are none).
    rejected: int = 0
    requests: int = 0
    seconds: float = 0.0
    deleted: list[str] = field(default_factory=list)

    def as_json(self) -> dict[str, Any]:
        return {k: v for k, v in vars(self).items()}


def units_of(names: dict[str, dict[bytes, bytes]]) -> dict[str, Unit]:
    """The cache entries: directories holding at least one name that is not a subdirectory."""
    out = {}
    for d, raw in names.items():
        unit = Unit(d, raw)
        if not unit.files:
            continue
        for v in unit.files.values():
            e = _entry(v)
            if e is not None and e.type == "f" and e.hash:
                unit.blobs[e.hash] = e.size
        out[d] = unit
    return out


def served(collector: Collector, units: dict[str, Unit]) -> tuple[int, int]:
    """(names, directories holding one) as nodes see them: files and symlinks whose entries nodes accept
    (signed with gc's key, when it has one); the refused ones are counted in ``remote_rejected``."""
    names, dirs, refused = 0, 0, 0
    for d, u in units.items():
        here = 0
        for name, raw in u.files.items():
            e = collector.codec.check(join_path(d, name), raw)[0] if valid_name(name) else None
            refused += e is None
            here += e is not None and e.type in ("f", "l")
        names += here
        dirs += here > 0
    collector.store.counters["remote_rejected"] += refused
    return names, dirs


def referenced(names: dict[str, dict[bytes, bytes]]) -> dict[str, int]:
    refs: dict[str, int] = {}
    for raw in names.values():
        for v in raw.values():
            e = _entry(v)
            if e is not None and e.type == "f" and e.hash:
                refs[e.hash] = e.size
    return refs


def live(names: dict[str, dict[bytes, bytes]]) -> set[str]:
    """What the names keep: every file's blob hash and the pack each locates its blob in (``Container.hashes``)."""
    out: set[str] = set()
    for raw in names.values():
        for v in raw.values():
            e = _entry(v)
            if e is not None and e.type == "f" and e.hash:
                out.add(e.hash)
                if e.pack is not None:
                    out.add(e.pack)
    return out


def plan(units: dict[str, Unit], now: float, max_size: int | None, max_age: float | None) -> Plan:
    """Which units go: unused past *max_age*, then least recently used until the rest fits *max_size*."""
    victims = [u for u in units.values() if max_age is not None and u.last_use < now - max_age]
    by_age = len(victims)
    gone = {u.path for u in victims}
    counts: dict[str, int] = {}
    sizes: dict[str, int] = {}
    for u in units.values():
        if u.path in gone:
            continue
        for h, s in u.blobs.items():
            counts[h] = counts.get(h, 0) + 1
            sizes[h] = s
    total = sum(sizes.values())
    referenced_bytes = sum(s for u in units.values() for s in u.blobs.values())
    if max_size is not None:
        for u in sorted((u for u in units.values() if u.path not in gone), key=lambda u: (u.last_use, u.path)):
            if total <= max_size:
                break
            victims.append(u)
            for h in u.blobs:
                counts[h] -= 1
                if not counts[h]:
                    total -= sizes[h]
    return Plan(units, victims, by_age, referenced_bytes, total)


def run(collector: Collector, *, max_size: int | None, max_age: float | None, grace: float, dry_run: bool,
        key_store: RemoteStore | None = None) -> Report:
    """One gc run (see the module doc); RemoteError when the tier fails (what was done stays done)."""
    started = time.monotonic()
    requests0, rejected0 = collector.requests(), collector.rejected()
    clock = collector.store.clock
    clock.measure()  # every age is the tier's: use records, blob and pack times are dated by its clock
    now = clock.now()
    report = Report(dry_run)
    names = collector.list_names()
    uses = collector.use_times()
    ahead = [d for d, t in uses.items() if t > clock.horizon()]
    if ahead:  # dated past the tier's time (a writer's clock): used now, aging from now on, never pinned
        log.warning("%d use records dated past the tier's time: taken as used now", len(ahead))
        uses.update(dict.fromkeys(ahead, now))
        if not dry_run:
            collector.adopt(ahead, now, replace=True)
    units = units_of(names)
    unrecorded = [d for d in units if d not in uses]
    if unrecorded and not dry_run:
        collector.adopt(unrecorded, now)
    for d, u in units.items():
        u.last_use = uses.get(d, now)
    p = plan(units, now, max_size, max_age)
    report.deleted = [u.path for u in p.victims]
    if dry_run:
        victims = {u.path for u in p.victims}
        left = {d: raw for d, raw in names.items() if d not in victims}
        keep = live(left)
        for c in collector.containers(adopt=False):
            if not any(h in keep for h in c.hashes) and c.written < now - grace:
                _count_deleted(report, c, c.size)
        report.deleted_dirs = len(p.victims)
        report.deleted_names = sum(len(u.files) for u in p.victims)
        report.names, report.dirs = served(collector, {d: u for d, u in units.items() if d not in victims})
        report.bytes = p.kept_bytes
    else:
        _delete_names(collector, p.victims, report)
        collector.forget_use([u.path for u in p.victims])
        _sweep(collector, now, grace, report, key_store)
        collector.keep_listing()
    _entry.cache_clear()
    report.requests = collector.requests() - requests0
    report.rejected = collector.rejected() - rejected0
    report.seconds = round(time.monotonic() - started, 3)
    if not dry_run:
        collector.write_summary(make_summary(
            at=clock.now(), names=report.names, dirs=report.dirs, blobs=report.blobs, bytes=report.bytes,
            deleted_dirs=report.deleted_dirs, deleted_names=report.deleted_names, deleted_blobs=report.deleted_blobs,
            packs=report.packs, deleted_packs=report.deleted_packs, freed_bytes=report.freed_bytes,
            requests=report.requests, seconds=report.seconds))
    return report


def pause_for_tests(point: str) -> None:
    """The race tests' hook: with ``MITHRILFS_TEST_GC_PAUSE=POINT:FILE``, gc creates FILE at POINT and waits
    until the test removes it (a writer acts in between, deterministically)."""
    spec = os.environ.get("MITHRILFS_TEST_GC_PAUSE", "")
    name, _, path = spec.partition(":")
    if name != point or not path:
        return
    open(path, "w").close()
    deadline = time.monotonic() + 120
    while os.path.exists(path) and time.monotonic() < deadline:
        time.sleep(0.05)


def _delete_names(collector: Collector, victims: list[Unit], report: Report) -> None:
    """Every unit's names (concurrently: one directory each), then the directories left empty leave their
    parents, deepest first, one compare-and-swap per parent (its parent next, if it empties too)."""
    pause_for_tests("names")
    for n in _parallel(lambda u: collector.remove_names(u.path, u.files), victims):
        report.deleted_names += n
        report.deleted_dirs += 1
        crash_point("gc_names_removed")  # the tests': a gc killed between a directory's names and its entry
    level = {u.path for u in victims if u.path}
    while level:
        depth = max(d.count("/") for d in level)
        here = {d for d in level if d.count("/") == depth}
        level -= here
        by_parent: dict[str, list[str]] = {}
        for d in here:
            by_parent.setdefault(d.rpartition("/")[0], []).append(d)
        groups = list(by_parent.items())
        for (parent, _), gone in zip(groups, _parallel(lambda g: _unlink_children(collector, *g), groups)):
            if gone and parent:
                level.add(parent)


def _unlink_children(collector: Collector, parent: str, children: list[str]) -> bool:
    """Remove the entries of *parent*'s empty *children* in one compare-and-swap, put back any a writer
    filled meanwhile (writers publish a directory's names before its entry in its parent); whether any
    went."""
    empty = [c for c, e in zip(children, map(collector.is_empty, children)) if e]
    if not empty:
        return False
    held = collector.names_of(parent)
    doomed = {}
    for c in empty:
        name = c.rpartition("/")[2].encode(errors="surrogateescape")
        raw = held.get(name)
        if raw is not None and _is_dir(raw):
            doomed[c] = (name, raw)
    if not doomed or not collector.remove_names(parent, dict(doomed.values())):
        return False
    for c, (name, raw) in doomed.items():
        if not collector.is_empty(c):
            collector.put_back(parent, name, raw)
    return True


def _parallel(fn: Any, items: list[Any]) -> list[Any]:
    """*fn* over *items* in up to 16 threads (each request is a round trip; stores are thread-safe)."""
    if len(items) < 2:
        return [fn(i) for i in items]
    with ThreadPoolExecutor(16) as pool:
        return list(pool.map(fn, items))


def _unlink(collector: Collector, d: str) -> bool:
    """Remove an empty directory's entry from its parent; put it back if a writer filled it meanwhile
    (writers publish a directory's names before its entry in its parent).  Whether it went."""
    if not collector.is_empty(d):
        return False
    parent, _, name = d.rpartition("/")
    raw = collector.names_of(parent).get(name.encode(errors="surrogateescape"))
    if raw is None:
        return True
    e = _entry(raw)
    if e is None or e.type != "d" or not collector.remove_entry_if(parent, name.encode(errors="surrogateescape"), raw):
        return False
    if not collector.is_empty(d):
        collector.put_back(parent, name.encode(errors="surrogateescape"), raw)
        return False
    return True


def _sweep(collector: Collector, now: float, grace: float, report: Report, key_store: RemoteStore | None) -> None:
    """Re-link orphans, then delete containers nothing references and older than the grace."""
    collector.begin_sweep()
    try:
        containers = collector.containers()  # before the names: a blob written after this is young
        listed_at = collector.store.clock.now()
        names = collector.list_names()
        report.relinked = _relink(collector, names, key_store)
        _unlink_empty(collector, names)
        refs = referenced(names)
        keep = live(names)
        report.names, report.dirs = served(collector, units_of(names))
        report.bytes = sum(refs.values())
        # relative to the listing: a name published after it was checked at most UPLOAD_LAG before, on a blob
        # written at most BLOB_TRUST before that (``ages``), so never before this, however long the run
        cutoff = listed_at - grace
        report.blobs = sum(1 for c in containers if c.kind != "pack")
        report.packs = len(containers) - report.blobs
        pause_for_tests("sweep")
        doomed = []
        for c in containers:
            if any(h in keep for h in c.hashes) or c.written >= cutoff:
                report.kept_bytes += c.size if not any(h in keep for h in c.hashes) else 0
            else:
                doomed.append(c)

        def delete(c: Container) -> int | None:
            crash_point("gc_sweep")  # the tests': a gc killed while it deletes blobs
            return collector.delete_container(c, cutoff)

        for c, freed in zip(doomed, _parallel(delete, doomed)):
            if freed is not None:
                _count_deleted(report, c, freed)
                if c.kind == "pack":
                    report.packs -= 1
                else:
                    report.blobs -= 1
    finally:
        collector.end_sweep()


def _count_deleted(report: Report, c: Container, freed: int) -> None:
    """One container gone (or, in a dry run, that would go): counted by kind, its bytes freed."""
    if c.kind == "pack":
        report.deleted_packs += 1
    else:
        report.deleted_blobs += 1
    report.freed_bytes += freed


def _unlink_empty(collector: Collector, names: dict[str, dict[bytes, bytes]]) -> None:
    """Directory entries naming a directory that holds nothing (a run killed between a directory's names
    and its entry): removed, as ``_delete_names`` would have.  Writers never publish an empty directory
    (a directory's names go before its entry), so none of these is a writer's."""
    for d, raw in list(names.items()):
        for name, value in raw.items():
            child = f"{d}/{name.decode(errors='surrogateescape')}" if d else name.decode(errors="surrogateescape")
            if _is_dir(value) and child not in names:
                while child and _unlink(collector, child):
                    child = child.rpartition("/")[0]


def _relink(collector: Collector, names: dict[str, dict[bytes, bytes]], key_store: RemoteStore | None) -> int:
    """Directories holding entries nodes accept whose parent has no entry for them (a killed run, a lost race):
    linked.  Entries nodes refuse (planted, unsigned in signed mode) never make gc link, and sign, a directory."""
    def linked(d: str) -> bool:
        parent, _, name = d.rpartition("/")
        return names.get(parent, {}).get(name.encode(errors="surrogateescape")) is not None

    missing: set[str] = set()
    for d, raw in names.items():
        held = any(collector.codec.check(join_path(d, n), v)[0] is not None for n, v in raw.items())
        while d and held and not linked(d) and d not in missing:
            missing.add(d)  # and its parent, if that one is not linked either (or holds nothing)
            d = d.rpartition("/")[0]
    if not missing:
        return 0
    store = key_store or collector.store
    version = collector.store.clock.now_us()  # the clock this run measured (a key store's never is)
    items = [(d, RemoteEntry("d", version, GC_NODE, mode=0o755, mtime_ns=version * 1000)) for d in missing]
    # ancestors too, shallowest last (a directory's names before its entry in its parent)
    store.publish_entries(sorted(items, key=lambda it: -it[0].count("/")))
    log.info("re-linked %d directories whose parent lacked them", len(missing))
    return len(missing)
