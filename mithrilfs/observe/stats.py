"""Counters and latency: what ``mithrilfs stats`` and Prometheus show.

Counters are kept per top-level directory of the mount (so ``inductor`` and
``triton`` are reported apart) and summed for the totals.  Latencies are the
last samples of each timed operation, enough for p50/p99 without keeping
history.  The event log is ``observe.events``.
"""

from __future__ import annotations

import json
import logging
import time
from collections import defaultdict, deque
from typing import Any, Protocol

from mithrilfs.store.namespace import Namespace
from mithrilfs.terminal import shown

log = logging.getLogger(__name__)

#: Counters per top-level directory; each also appears in the totals.
COUNTERS = (
    "hits", "misses", "reads", "read_bytes", "writes", "write_bytes", "commits", "dedup_hits",
    "evictions", "evicted_bytes", "corrupt_blobs",
    # the same output written again under a new cache entry: here, and by another node (``cache.recompiles``)
    "identical_recompiles", "identical_recompile_bytes", "fleet_identical_recompiles",
    # small blobs read and verified right after their file's lookup, and READs answered from them (``cache.readahead``)
    "read_ahead", "read_ahead_served",
)
#: What ``hit_rate`` counts, said wherever it is shown: only lookups reach the daemon (the kernel keeps a
#: found name for a minute and serves reads from its page cache), and frameworks look up many names that
#: are not there (lock files, entries they are about to write), so a warm run can show a low rate.
HIT_RATE_MEANS = "of the name lookups that reached the daemon found a file (hits / (hits + misses))"
TIMED_OPS = ("lookup", "getattr", "read")
ROOT_KEY = "/"
_SAMPLES = 1024


class RequestLog(Protocol):
    """Requests and the daemon's time on them by opcode (``kernel.RequestTimes``: only the session sees them all)."""

    def by_name(self) -> dict[str, dict[str, float]]: ...

    def clear(self) -> None: ...

    def transport(self) -> str: ...


class NoRequests:
    """No session behind these counters (a store opened without a mount)."""

    def by_name(self) -> dict[str, dict[str, float]]:
        return {}

    def clear(self) -> None:
        pass

    def transport(self) -> str:
        return "none"


def _zeroes() -> dict[str, int]:
    return dict.fromkeys(COUNTERS, 0)


class Stats:
    """This mount's counters, plus those of earlier mounts of the store (kept in its index).

    ccache users expect counters that outlive a restart and a way to zero
    them: ``kept`` holds what earlier mounts counted since the last zero,
    ``persisted()`` is what the index stores (kept plus this mount's), and
    ``zero()`` starts both over.
    """

    def __init__(self, persisted: str | None = None) -> None:
        self.by_dir: dict[str, dict[str, int]] = defaultdict(_zeroes)
        self.latency_ns: dict[str, deque[int]] = {op: deque(maxlen=_SAMPLES) for op in TIMED_OPS}
        self.kept: dict[str, dict[str, int]] = defaultdict(_zeroes)
        self.since = time.time()
        #: The session's requests by opcode (``daemon.wiring`` hands it the session's).
        self.requests: RequestLog = NoRequests()
        self._restore(persisted)

    def _restore(self, persisted: str | None) -> None:
        """Earlier mounts' counters; a damaged record starts them over rather than failing the mount."""
        if not persisted:
            return
        try:
            doc = json.loads(persisted)
            since = float(doc["since"])
            kept = {str(top): {k: int(c.get(k, 0)) for k in COUNTERS} for top, c in doc["by_dir"].items()}
        except (ValueError, TypeError, KeyError, AttributeError):
            log.warning("the stored counters are unreadable; starting them over")
            return
        self.since = since
        self.kept.update(kept)

    def add(self, top: str, counter: str, n: int = 1) -> None:
        self.by_dir[top][counter] += n

    def zero(self) -> None:
        """``stats --zero``: this mount's counters, earlier mounts' and the latency samples start over."""
        self.by_dir.clear()
        self.kept.clear()
        for samples in self.latency_ns.values():
            samples.clear()
        self.requests.clear()
        self.since = time.time()

    def all_mounts(self) -> dict[str, dict[str, int]]:
        """Counters since the last zero, this mount's included, per top-level directory."""
        out: dict[str, dict[str, int]] = defaultdict(_zeroes)
        for source in (self.kept, self.by_dir):
            for top, counters in source.items():
                for k, v in counters.items():
                    out[top][k] += v
        return dict(out)

    def persisted(self) -> str:
        return json.dumps({"since": self.since, "by_dir": self.all_mounts()}, sort_keys=True)

    def record_latency(self, op: str, ns: int) -> None:
        self.latency_ns[op].append(ns)

    def totals(self, by_dir: dict[str, dict[str, int]] | None = None) -> dict[str, int]:
        out = _zeroes()
        for counters in (self.by_dir if by_dir is None else by_dir).values():
            for k, v in counters.items():
                out[k] += v
        return out

    def latency_us(self) -> dict[str, dict[str, float]]:
        out = {}
        for op, samples in self.latency_ns.items():
            ordered = sorted(samples)
            out[op] = {
                "p50": round(_percentile(ordered, 0.50) / 1000, 1),
                "p99": round(_percentile(ordered, 0.99) / 1000, 1),
                "samples": len(ordered),
            }
        return out

    def snapshot(self, gauges: dict[str, Any]) -> dict[str, Any]:
        """The document behind ``stats.json``: gauges, totals, rates, latency, by_dir."""
        totals = self.totals()
        physical = gauges.get("physical_bytes", 0)
        logical = gauges.get("logical_bytes", 0)
        every = self.all_mounts()
        every_totals = self.totals(every)
        return {
            **gauges,
            **totals,
            "hit_rate": _hit_rate(totals),
            "dedup_ratio": round(logical / physical, 4) if physical else 1.0,
            "latency_us": self.latency_us(),
            # every request this mount answered, by opcode, with the daemon's time on it (most first)
            "requests": self.requests.by_name(),
            # how the kernel's requests reach the daemon: /dev/fuse read/write, or io_uring
            "transport": self.requests.transport(),
            "by_dir": {top: dict(c, hit_rate=_hit_rate(c)) for top, c in sorted(self.by_dir.items())},
            # the same counters over every mount since the last ``stats --zero``
            "all_mounts": dict(every_totals, since=round(self.since, 3), hit_rate=_hit_rate(every_totals),
                               by_dir={top: dict(c, hit_rate=_hit_rate(c)) for top, c in sorted(every.items())}),
        }


def _hit_rate(c: dict[str, int]) -> float:
    lookups = c["hits"] + c["misses"]
    return round(c["hits"] / lookups, 4) if lookups else 0.0


def _percentile(ordered: list[int], q: float) -> float:
    if not ordered:
        return 0.0
    return float(ordered[min(len(ordered) - 1, int(q * len(ordered)))])


def format_table(snap: dict[str, Any]) -> str:
    """The human view of a stats snapshot (``mithrilfs stats`` without --json)."""
    from mithrilfs.units import format_size

    lines = [
        f"files        {snap['files']:>12}    blobs        {snap['blobs']:>12}    being written {snap['written_files']:>5}",
        f"logical      {format_size(snap['logical_bytes']):>12}    physical     {format_size(snap['physical_bytes']):>12}"
        f"    budget       {format_size(snap['max_bytes'])}",
        f"dedup ratio  {snap['dedup_ratio']:>12.2f}    corrupt      {snap['corrupt_blobs']:>12}",
        f"hit rate     {snap['hit_rate'] * 100:>11.1f}% {HIT_RATE_MEANS}",
        "",
        f"{'directory':<16}{'hits':>9}{'misses':>9}{'hit%':>7}{'reads':>9}{'read':>11}{'writes':>9}{'written':>11}"
        f"{'commits':>9}{'dedup':>7}{'evicted':>9}",
    ]
    this_mount = {k: snap[k] for k in COUNTERS} | {"hit_rate": snap["hit_rate"]}
    rows = [(top, c, "") for top, c in snap["by_dir"].items()] + [("this mount", this_mount, "")]
    every = snap.get("all_mounts")
    if every:
        since = time.strftime("%Y-%m-%d %H:%M", time.localtime(every["since"]))
        rows.append(("all mounts", every, f"   since {since}"))
    for top, c, note in rows:
        lines.append(
            f"{shown(top)[:15]:<16}{c['hits']:>9}{c['misses']:>9}{c['hit_rate'] * 100:>6.1f}%{c['reads']:>9}"
            f"{format_size(c['read_bytes']):>11}{c['writes']:>9}{format_size(c['write_bytes']):>11}"
            f"{c['commits']:>9}{c['dedup_hits']:>7}{c['evictions']:>9}{note}"
        )
    if snap.get("identical_recompiles") or snap.get("fleet_identical_recompiles"):
        lines.append(recompiles_line(snap["identical_recompiles"], snap["identical_recompile_bytes"],
                                     snap["fleet_identical_recompiles"]) + ": mithrilfs why MOUNT")
    lat = snap["latency_us"]
    lines.append("")
    lines.append("latency (us)  " + "   ".join(f"{op} p50 {q['p50']:.0f} p99 {q['p99']:.0f}" for op, q in lat.items()))
    lines += format_levels(snap)
    if snap.get("restarts"):
        at = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(snap["last_restart_at"]))
        lines.append(f"daemon       pid {snap['pid']}, mithrilfs {snap.get('version', '?')}, replaced "
                     f"{snap['restarts']} times on the live mount (last: {snap['last_restart_cause']}, {at})")
    return "\n".join(lines)


def recompiles_line(here: int, here_bytes: int, fleet: int) -> str:
    """The identical recompiles in one sentence (``stats`` and ``why``): those of bytes this store held, and
    those of bytes another node had uploaded (counted apart: a fleet one had no copy here)."""
    from mithrilfs.units import format_size

    return (f"{here} identical recompile{'s' if here != 1 else ''} here ({format_size(here_bytes)}); "
            f"{fleet} recompile{'s' if fleet != 1 else ''} of bytes another node had already made")


def format_levels(snap: dict[str, Any]) -> list[str]:
    """One line per level of the shared tier (Redis, the bucket): reachable, traffic, last error."""
    from mithrilfs.units import format_size

    levels = snap.get("remote_levels") or []
    lines = [f"shared tier  {len(levels)} level{'s' if len(levels) > 1 else ''}, {snap.get('upload_queue', 0)} queued"
             " for upload"] if levels else []
    if "remote_tier_gc_at" in snap:
        at = time.strftime("%Y-%m-%d %H:%M", time.localtime(snap["remote_tier_gc_at"]))
        lines.append(f"  tier size  {snap['remote_tier_names']} names, {format_size(snap['remote_tier_bytes'])} in "
                     f"{snap['remote_tier_blobs']} blobs (fleet gc at {at}, "
                     f"{format_size(snap['remote_tier_gc_freed_bytes'])} freed)")
    for lv in levels:
        state = "reachable" if lv["reachable"] else f"unreachable: {lv['last_error']}"
        if lv["reachable"] and lv.get("refuses_writes"):
            state = f"reachable, refuses writes: {lv['last_error']}"
        slowed = f", {lv['slowdowns']} asked to slow down" if lv.get("slowdowns") else ""
        lines.append(f"  {lv['kind']:<6} {lv['url']}: {state}; {lv['requests']} requests, {lv['errors']} errors{slowed},"
                     f" {format_size(lv['bytes_in'])} in, {format_size(lv['bytes_out'])} out")
    return lines


def format_usage(usage: dict[str, Any], *, top: bool) -> str:
    """What takes the space: files and bytes per top-level directory, then the largest files."""
    from mithrilfs.units import format_size

    lines = [f"{'stored in':<16}{'files':>9}{'bytes':>11}{'on disk':>11}"]
    for row in usage["by_top"]:
        lines.append(f"{shown(row['name'])[:15]:<16}{row['files']:>9}{format_size(row['bytes']):>11}"
                     f"{format_size(row['stored_bytes']):>11}")
    if top:
        lines += ["", f"largest {len(usage['largest'])} files"]
        lines += [f"{format_size(row['bytes']):>11}  {shown(row['path'])}" for row in usage["largest"]]
    return "\n".join(lines)


#: Index meta key of the counters that outlive a mount (``stats``'s "all mounts").
COUNTERS_META = "counters"


class KeptCounters:
    """The counters of every mount since a zero, kept in the index, where the store's next mount finds them."""

    def __init__(self, ns: Namespace, *, read_only: bool) -> None:
        self.ns = ns
        self.read_only = read_only
        self._saved = ns.get_meta(COUNTERS_META)
        #: The counters, starting from what the last mount kept.
        self.stats = Stats(self._saved)

    def save(self) -> None:
        record = self.stats.persisted()
        if self.read_only or record == self._saved:
            return
        with self.ns.txn():
            self.ns.set_meta(COUNTERS_META, record)
        self._saved = record
