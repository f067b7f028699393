"""Settings kept in the store (``mithrilfs config``), as ccache keeps ``max_size`` in its directory.

A store remembers its budget and eviction settings in ``STORE/config.json``;
every later mount uses them unless its command line says otherwise, so a
remount without ``--max-size`` keeps the budget the user chose instead of
falling back to the default.  The file is small, typed JSON written by
rename; one that cannot be read is named in a one-line error, never
half-applied.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from mithrilfs.cache.policy import EvictionPolicy
from mithrilfs.store.open import StoreError

SETTINGS_FILE = "config.json"

#: Setting name (as on the command line, with _ for -) -> (EvictionPolicy field, type).
SETTINGS: dict[str, tuple[str, type]] = {
    "max_size": ("max_bytes", int),
    "high_watermark": ("high", float),
    "low_watermark": ("low", float),
    "min_age": ("min_age", float),
    "idle_ttl": ("idle_ttl", float),
    "min_entries": ("min_entries", int),
}


def load(store: Path) -> dict[str, Any]:
    """The settings stored in *store* ({} when none); StoreError naming the file when it is unreadable."""
    path = store / SETTINGS_FILE
    try:
        text = path.read_text()
    except FileNotFoundError:
        return {}
    except (OSError, UnicodeDecodeError) as e:
        raise StoreError(f"{path}: cannot read settings: {getattr(e, 'strerror', None) or e}") from None
    try:
        doc = json.loads(text)
    except (ValueError, RecursionError):
        raise StoreError(f"{path}: settings are not valid JSON; fix or delete the file") from None
    if not isinstance(doc, dict):
        raise StoreError(f"{path}: settings must be a JSON object; fix or delete the file")
    out: dict[str, Any] = {}
    for key, value in doc.items():
        if key not in SETTINGS:
            raise StoreError(f"{path}: unknown setting {key!r}; fix or delete the file")
        kind = SETTINGS[key][1]
        if isinstance(value, bool) or not isinstance(value, (int, float)) or (kind is int and not isinstance(value, int)):
            raise StoreError(f"{path}: setting {key!r} must be a number, not {value!r}; fix or delete the file")
        out[key] = kind(value)
    try:
        policy(out)
    except ValueError as e:
        raise StoreError(f"{path}: {e}; fix or delete the file") from None
    return out


def save(store: Path, settings: dict[str, Any]) -> None:
    """Write the settings by rename (a reader sees the old file or the new one), owner-only."""
    path = store / SETTINGS_FILE
    tmp = path.with_name(f".{SETTINGS_FILE}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(settings, f, sort_keys=True, indent=1)
        f.write("\n")
    os.rename(tmp, path)


def policy(stored: dict[str, Any], overrides: dict[str, Any] | None = None) -> EvictionPolicy:
    """The eviction policy: defaults, then the stored settings, then the command line's; ValueError if invalid."""
    merged = {**stored, **{k: v for k, v in (overrides or {}).items() if v is not None}}
    return EvictionPolicy(**{SETTINGS[k][0]: v for k, v in merged.items()})
