"""The event log: one JSON object a line in ``STORE/events.jsonl``, rotated by size.

Mounts, unmounts, eviction batches, corruption, errors and a summary every
minute, for operators who want history rather than the live counters.
"""

from __future__ import annotations

import json
import logging
import os
import time
from pathlib import Path
from typing import Any

log = logging.getLogger(__name__)


class EventLog:
    """Append-only JSON lines, rotated when the file passes *max_bytes* (keeps *keep* old files)."""

    def __init__(self, path: Path | None, max_bytes: int = 10 << 20, keep: int = 3) -> None:
        self.path = path
        self.max_bytes = max_bytes
        self.keep = keep

    def emit(self, event: str, **fields: Any) -> None:
        if self.path is None:
            return
        record = {"ts": round(time.time(), 3), "event": event, **fields}
        line = json.dumps(record, sort_keys=True) + "\n"
        try:
            if self.path.exists() and self.path.stat().st_size + len(line) > self.max_bytes:
                self._rotate()
            with open(self.path, "a") as f:
                f.write(line)
        except OSError as e:
            log.warning("event log %s: %s", self.path, e)

    def _rotate(self) -> None:
        assert self.path is not None
        for i in range(self.keep - 1, 0, -1):
            older = self.path.with_name(f"{self.path.name}.{i}")
            if older.exists():
                os.replace(older, self.path.with_name(f"{self.path.name}.{i + 1}"))
        os.replace(self.path, self.path.with_name(f"{self.path.name}.1"))
