"""Sizes and durations as people type them: ``500M``, ``10 GB``, ``1.5TiB``, ``30s``, ``7d``.

Sizes: ``K``, ``M``, ``G``, ``T``, ``P`` alone or with ``iB`` are powers of
1024 (``10G`` = ``10GiB``, as ``df -h`` shows); with ``B`` alone they are
powers of 1000 (``10GB`` = 10,000,000,000 bytes, as disks are sold).  A
size must fit in a signed 64-bit integer (SQLite, ``statfs``).
"""

from __future__ import annotations

import re
from decimal import Decimal

_SIZE_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40, "P": 1 << 50}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(?:([KMGTP])(i?B?)|(B?))\s*$", re.IGNORECASE)
#: The largest size anything takes: it must fit in 64 bits (signed, for SQLite).
MAX_SIZE = (1 << 63) - 1
SIZE_HELP = "K/M/G/T alone or with iB are powers of 1024 (10G = 10GiB), KB/MB/GB/TB powers of 1000"
_DURATION_UNITS = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}
_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|[smhdw]?)\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """Bytes from ``10G``, ``500M``, ``10GB``, ``1.5TiB``, ``4096`` (see the module doc); ValueError otherwise."""
    m = _SIZE_RE.match(text)
    if not m:
        raise ValueError(f"invalid size {text!r} (use e.g. 500M, 10G, 1.5T or a number of bytes)")
    number, letter, suffix = m.group(1), (m.group(2) or "").upper(), (m.group(3) or "").lower()
    unit = _SIZE_UNITS[letter]
    if suffix == "b":  # KB, MB, GB: decimal
        unit = 1000 ** (" KMGTP".index(letter))
    size = int(Decimal(number) * unit)
    if size > MAX_SIZE:
        raise ValueError(f"size {text!r} is too large (at most {MAX_SIZE} bytes, 8 EiB)")
    return size


def parse_duration(text: str) -> float:
    """Seconds from ``30s``, ``5m``, ``2h``, ``7d``, ``1w``, ``250ms`` or plain seconds."""
    m = _DURATION_RE.match(text)
    if not m:
        raise ValueError(f"invalid duration {text!r} (use e.g. 30s, 5m, 2h, 7d or a number of seconds)")
    unit = m.group(2).lower()
    return float(m.group(1)) * (0.001 if unit == "ms" else _DURATION_UNITS[unit])


def format_size(n: float) -> str:
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(n) < 1024 or unit == "TiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def format_duration_short(seconds: float) -> str:
    """``8h``, ``90m``, ``45s``, ``2d``: the largest unit that divides it, for messages."""
    for unit, n in (("d", 86400), ("h", 3600), ("m", 60)):
        if seconds >= n and seconds % n == 0:
            return f"{seconds / n:.0f}{unit}"
    return f"{seconds:g}s"
