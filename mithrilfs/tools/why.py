"""``mithrilfs why``: the identical recompiles a store recorded, grouped by cache entry, explained.

The daemon logs each identical recompile (``cache.recompiles``) in the
store's event log; this reads them back, newest entry first, with the bytes
and the compile time they cost.  For two Triton entries it compares their
kernel metadata files (``<kernel>.json``: target, debug flags, versions,
options), whose differing fields usually name the input that changed the
key.  Without a mount the events alone say the same, without the metadata.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from mithrilfs.units import format_size

EVENTS = ("identical_recompile", "fleet_identical_recompile")
#: Entries shown (the newest); the counters have the totals.
MAX_ENTRIES = 50
#: A metadata file larger than this is not a kernel's metadata.
_MAX_METADATA_BYTES = 1 << 20


def read_events(store: Path) -> list[dict[str, Any]]:
    """The recompile events of *store*'s event log, rotated files included, oldest first."""
    files = sorted(store.glob("events.jsonl.*"), key=lambda p: -int(p.suffix[1:]) if p.suffix[1:].isdigit() else 0)
    out = []
    for path in [*files, store / "events.jsonl"]:
        try:
            lines = path.read_text(errors="replace").splitlines()
        except FileNotFoundError:
            continue
        for line in lines:
            try:
                event = json.loads(line)
            except ValueError:
                continue  # a line cut by a crash
            if isinstance(event, dict) and event.get("event") in EVENTS and isinstance(event.get("path"), str):
                out.append(event)
    return out


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
            # entries come from this store's index, or from the shared tier (checked there): never outside
            g["differs"] = {other: metadata_diff(mount / g["entry"], mount / other) for other in g["same_as"]
                            if _inside(other) and _inside(g["entry"])}
    return ordered


def _inside(path: str) -> bool:
    return not path.startswith("/") and ".." not in path.split("/")


def _metadata(entry: Path) -> dict[str, dict[str, Any]]:
    """The kernel metadata JSON objects of an entry, by file name (Triton's ``<kernel>.json``)."""
    out = {}
    try:
        files = [p for p in entry.iterdir() if p.suffix == ".json" and not p.name.startswith("__grp__")]
    except OSError:
        return {}
    for p in files:
        try:
            if p.stat().st_size > _MAX_METADATA_BYTES:
                continue
            doc = json.loads(p.read_text())
        except (OSError, ValueError):
            continue
        if isinstance(doc, dict):
            out[p.name] = doc
    return out


def metadata_diff(entry: Path, other: Path) -> list[dict[str, Any]]:
    """Fields whose values differ between the two entries' metadata files of the same name."""
    mine, theirs = _metadata(entry), _metadata(other)
    out = []
    for name in sorted(mine.keys() & theirs.keys()):
        a, b = mine[name], theirs[name]
        for field in sorted(a.keys() | b.keys()):
            if field in ("hash",):  # the key itself: always differs
                continue
            if a.get(field) != b.get(field):
                out.append({"file": name, "field": field, "this": a.get(field), "other": b.get(field)})
    return out


def format_report(groups: list[dict[str, Any]], counters: dict[str, Any] | None) -> str:
    if not groups:
        return "no identical recompiles recorded"
    lines = []
    if counters:
        n, fleet = counters.get("identical_recompiles", 0), counters.get("fleet_identical_recompiles", 0)
        lines.append(f"{n} identical recompile{'s' if n != 1 else ''} here "
                     f"({format_size(counters.get('identical_recompile_bytes', 0))}); {fleet} of bytes another node"
                     " had already made")
    lines.append("newest first:")
    for g in groups:
        lost = f", about {g['lost_seconds']:.1f} s of compile lost" if g["lost_seconds"] is not None else ""
        where = "on another node" if g["fleet"] and not g["same_as"] else ""
        lines.append(f"  {g['entry'] or '/'}: {g['files']} file{'s' if g['files'] != 1 else ''}, "
                     f"{format_size(g['bytes'])}{lost}")
        for other in g["same_as"]:
            lines.append(f"    same bytes as {other}")
            for d in g.get("differs", {}).get(other, []):
                lines.append(f"      {d['file']}: {d['field']} = {json.dumps(d['this'])} here, "
                             f"{json.dumps(d['other'])} there")
        if where:
            lines.append(f"    same bytes as a file {where}")
    return "\n".join(lines)
