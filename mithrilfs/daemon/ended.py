"""Why a mount ended without an unmount, kept for ``status`` (the mount and its daemon are gone by then).

One small JSON file per mount point in the user's state directory,
written by the supervisor when it gives up and removed by the next mount
of that path.  The mount point is taken as given (already resolved): a
path through a mount whose daemon is gone must never be resolved, as
that would wait on the dead daemon.
"""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import platformdirs


def _path(mountpoint: str) -> Path:
    key = hashlib.sha256(os.fsencode(mountpoint)).hexdigest()[:24]
    return Path(platformdirs.user_state_dir("mithrilfs")) / "ended" / f"{key}.json"


def record(mountpoint: str, reason: str) -> None:
    path = _path(mountpoint)
    try:
        path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        path.write_text(json.dumps({"mountpoint": mountpoint, "reason": reason,
                                    "at": round(time.time(), 3)}))
    except OSError:
        pass


def read(mountpoint: str) -> dict | None:
    try:
        return json.loads(_path(mountpoint).read_text())
    except (OSError, ValueError):
        return None


def clear(mountpoint: str) -> None:
    try:
        _path(mountpoint).unlink()
    except OSError:
        pass
