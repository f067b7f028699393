"""Sizes and durations as people type them: ``500M``, ``1.5T``, ``30s``, ``7d``."""

from __future__ import annotations

import re

_SIZE_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40, "P": 1 << 50}
_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGTP]?)(?:i?B)?\s*$", re.IGNORECASE)
_DURATION_UNITS = {"": 1.0, "s": 1.0, "m": 60.0, "h": 3600.0, "d": 86400.0, "w": 604800.0}
_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|[smhdw]?)\s*$", re.IGNORECASE)


def parse_size(text: str) -> int:
    """Bytes from ``10G``, ``500M``, ``1.5T``, ``4096`` (binary units); ValueError otherwise."""
    m = _SIZE_RE.match(text)
    if not m:
        raise ValueError(f"invalid size {text!r} (use e.g. 500M, 10G, 1.5T or a number of bytes)")
    return int(float(m.group(1)) * _SIZE_UNITS[m.group(2).upper()])


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
