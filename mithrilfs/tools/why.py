"""``mithrilfs why``: the identical recompiles a store recorded, grouped by cache entry, explained.

The daemon logs each identical recompile (``cache.recompiles``) in the
store's event log; this reads them back, newest entry first, with the bytes
and the compile time they cost.  For two Triton entries it compares their
kernel metadata files (``<kernel>.json``: target, debug flags, versions,
options), whose differing fields usually name the input that changed the
key.  Without a mount the events alone say the same, without the metadata.

What it reads may be hostile (an entry, a metadata file or a whole event
from the shared tier, or planted by anyone who may write to the cache):
numbers out of bounds make an event malformed (skipped), a file is read
only if it is a regular file of bounded size (a FIFO or device under a
``.json`` name would block or act: ``read_regular``), and every path or
value is escaped for the terminal.
"""

from __future__ import annotations

import json
import os
import stat
from pathlib import Path
from typing import Any

from mithrilfs.observe.stats import recompiles_line
from mithrilfs.terminal import shown
from mithrilfs.units import format_size

EVENTS = ("identical_recompile", "fleet_identical_recompile")
#: Entries shown (the newest); the counters have the totals.
MAX_ENTRIES = 50
#: A metadata file larger than this is not a kernel's metadata.
_MAX_METADATA_BYTES = 1 << 20
#: An event log file larger than this is not the daemon's (it rotates at 10 MiB): not read.
_MAX_EVENT_FILE_BYTES = 64 << 20
#: Bounds of an event's numbers (bytes; timestamps and seconds): beyond them it is not ours, and a float
#: of such a number would overflow.
_MAX_EVENT_BYTES = 1 << 62
_MAX_EVENT_SECONDS = 1e11


def read_regular(path: Path, limit: int) -> bytes | None:
    """*path*'s bytes if it is a regular file of at most *limit* bytes, else None (a missing file too).

    Never blocks and never opens anything else for real: lstat first, then open with O_NONBLOCK and
    O_NOFOLLOW (a FIFO swapped in between opens at once) and fstat before the first read.
    """
    try:
        if not stat.S_ISREG(os.lstat(path).st_mode):
            return None
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_NOFOLLOW | os.O_NOCTTY | os.O_CLOEXEC)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_size > limit:
            return None
        chunks, n = [], 0
        while n <= limit and (chunk := os.read(fd, min(1 << 20, limit + 1 - n))):
            chunks.append(chunk)
            n += len(chunk)
        return None if n > limit else b"".join(chunks)
    except OSError:
        return None
    finally:
        os.close(fd)


def read_events(store: Path) -> list[dict[str, Any]]:
    """The recompile events of *store*'s event log, rotated files included, oldest first."""
    files = sorted(store.glob("events.jsonl.*"), key=lambda p: -int(p.suffix[1:]) if p.suffix[1:].isdigit() else 0)
    out = []
    for path in [*files, store / "events.jsonl"]:
        data = read_regular(path, _MAX_EVENT_FILE_BYTES)
        if data is None:
            continue  # missing, or not a log the daemon wrote
        for line in data.decode(errors="replace").splitlines():
            try:
                event = json.loads(line)
            except (ValueError, RecursionError):
                continue  # a line cut by a crash, or not one of ours
            if isinstance(event, dict) and event.get("event") in EVENTS and _well_formed(event):
                out.append(event)
    return out


def _well_formed(e: dict[str, Any]) -> bool:
    """An event this reads: the fields it uses have their types and bounds (the log is ours, but a file
    can be edited, and a fleet event's fields come from the shared tier)."""
    lost = e.get("lost_seconds")
    return (isinstance(e.get("path"), str) and isinstance(e.get("entry", ""), str)
            and isinstance(e.get("other_entry", ""), str | None)
            and _bounded(e.get("bytes", 0), int, _MAX_EVENT_BYTES)
            and _bounded(e.get("ts", 0), int | float, _MAX_EVENT_SECONDS)
            and (lost is None or _bounded(lost, int | float, _MAX_EVENT_SECONDS)))


def _bounded(value: Any, kind: Any, limit: float) -> bool:
    """*value* is a *kind* number from 0 to *limit* (NaN fails every comparison; a bool is no number)."""
    return isinstance(value, kind) and not isinstance(value, bool) and 0 <= value <= limit


def report(store: Path, mount: Path | None, under: str | None) -> list[dict[str, Any]]:
    """Recompiles grouped by entry, newest first; *under*: only entries at or below that path."""
    groups: dict[str, dict[str, Any]] = {}
    for e in read_events(store):
        entry = e.get("entry") or ""
        if under and not (entry == under or entry.startswith(under.rstrip("/") + "/")):
            continue
        g = groups.setdefault(entry, {"entry": entry, "files": 0, "bytes": 0, "newest": 0.0, "paths": [],
                                      "same_as": [], "fleet": False, "lost_seconds": None})
        g["files"] += 1
        g["bytes"] += int(e.get("bytes", 0))
        g["newest"] = max(g["newest"], float(e.get("ts", 0)))
        g["paths"].append(e["path"])
        g["fleet"] = g["fleet"] or e["event"] == "fleet_identical_recompile"
        other = e.get("other_entry")
        if other and other not in g["same_as"]:
            g["same_as"].append(other)
        if e.get("lost_seconds") is not None:
            g["lost_seconds"] = max(g["lost_seconds"] or 0.0, float(e["lost_seconds"]))
    ordered = sorted(groups.values(), key=lambda g: -g["newest"])[:MAX_ENTRIES]
    if mount is not None:
        for g in ordered:
            mine = _within(mount, g["entry"])
            g["differs"] = {}
            for other in g["same_as"]:
                theirs = _within(mount, other)
                if mine is not None and theirs is not None:
                    g["differs"][other] = metadata_diff(mine, theirs, mount)
    return ordered


def _within(mount: Path, path: str) -> Path | None:
    """*path* under the mount, symbolic links resolved, or None when it leads anywhere else: an entry may
    come from the shared tier, where anyone who can write to it can plant a path or a link."""
    try:
        real = (mount / path).resolve(strict=True)
    except (OSError, RuntimeError, ValueError):
        return None
    return real if real.is_relative_to(mount.resolve()) else None


def _metadata(entry: Path, mount: Path) -> dict[str, dict[str, Any]]:
    """The kernel metadata JSON objects of an entry, by file name (Triton's ``<kernel>.json``)."""
    out = {}
    try:
        files = [p for p in entry.iterdir() if p.suffix == ".json" and not p.name.startswith("__grp__")]
    except OSError:
        return {}
    for p in files:
        real = _within(mount, str(p.relative_to(mount.resolve())))
        data = None if real is None else read_regular(real, _MAX_METADATA_BYTES)
        if data is None:
            continue  # out of the mount, too large, or no regular file (a planted FIFO would block)
        try:
            doc = json.loads(data)
        except (ValueError, RecursionError):
            continue
        if isinstance(doc, dict):
            out[p.name] = doc
    return out


def metadata_diff(entry: Path, other: Path, mount: Path) -> list[dict[str, Any]]:
    """Fields whose values differ between the two entries' metadata files of the same name."""
    mine, theirs = _metadata(entry, mount), _metadata(other, mount)
    out = []
    for name in sorted(mine.keys() & theirs.keys()):
        a, b = mine[name], theirs[name]
        for field in sorted(a.keys() | b.keys()):
            if field in ("hash",):  # the key itself: always differs
                continue
            try:
                differs = a.get(field) != b.get(field)
                this, that = json.loads(json.dumps(a.get(field))), json.loads(json.dumps(b.get(field)))
            except (RecursionError, ValueError, TypeError):
                continue  # nested past what can be compared: not a kernel's metadata
            if differs:
                out.append({"file": name, "field": field, "this": this, "other": that})
    return out


def format_report(groups: list[dict[str, Any]], counters: dict[str, Any] | None) -> str:
    if not groups:
        return "no identical recompiles recorded"
    lines = []
    if counters:
        n, fleet = counters.get("identical_recompiles", 0), counters.get("fleet_identical_recompiles", 0)
        lines.append(recompiles_line(n, counters.get("identical_recompile_bytes", 0), fleet))
    lines.append("newest first:")
    for g in groups:
        lost = f", about {g['lost_seconds']:.1f} s of compile lost" if g["lost_seconds"] is not None else ""
        where = "on another node" if g["fleet"] and not g["same_as"] else ""
        lines.append(f"  {shown(g['entry']) or '/'}: {g['files']} file{'s' if g['files'] != 1 else ''}, "
                     f"{format_size(g['bytes'])}{lost}")
        for other in g["same_as"]:
            lines.append(f"    same bytes as {shown(other)}")
            for d in g.get("differs", {}).get(other, []):
                lines.append(shown(f"      {d['file']}: {d['field']} = {json.dumps(d['this'])} here, "
                                    f"{json.dumps(d['other'])} there"))
        if where:
            lines.append(f"    same bytes as a file {where}")
    return "\n".join(lines)
