"""What the last ``fleet gc`` of a tier found and did, kept in the tier for every node to show.

gc writes one small record (``mfs:{ns}:gc`` in Redis, ``gc`` in a bucket);
each node reads it at most every ``SUMMARY_SECONDS`` while its mount is in
use, ``SUMMARY_IDLE_SECONDS`` while it is idle (one GET), and shows
the tier's size and count in ``stats`` and Prometheus, and logs a
``fleet_gc`` event in its store's event log when a new one appears.  Like
everything read from a tier it is hostile until checked: only known
numeric fields pass.
"""

from __future__ import annotations

import json
from typing import Any

#: How often a node reads the record while its mount is in use, and while it is idle.
SUMMARY_SECONDS = 60.0
SUMMARY_IDLE_SECONDS = 1800.0
MAX_SUMMARY_BYTES = 4096
#: The fields, all numbers: when it ran, what the tier held after it, and what it deleted.
FIELDS = ("at", "names", "dirs", "blobs", "packs", "bytes", "deleted_dirs", "deleted_names", "deleted_blobs",
          "deleted_packs", "freed_bytes", "requests", "seconds")


def make_summary(**values: float) -> bytes:
    return json.dumps({k: values[k] for k in FIELDS if k in values}, sort_keys=True).encode()


def parse_summary(raw: Any) -> dict[str, Any] | None:
    """The record's numeric fields, or None when absent or not a record."""
    if not isinstance(raw, bytes) or len(raw) > MAX_SUMMARY_BYTES:
        return None
    try:
        d = json.loads(raw)
    except (ValueError, RecursionError):
        return None
    if not isinstance(d, dict):
        return None
    out = {k: d[k] for k in FIELDS if type(d.get(k)) in (int, float) and 0 <= d[k] < 1 << 63}
    return out if "at" in out else None
