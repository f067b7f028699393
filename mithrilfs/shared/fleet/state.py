"""A mount's part in the fleet's lifecycle: its use records going out, the last gc's summary coming in.

Built by ``remote_tier`` (the tier's ``fleet``), stepped by the uploader's loop
(``WriteBehind.uploader``) so it costs no task of its own: use records go
out when due (Redis: with the next batch; a bucket: at most every
``ages.USE_FLUSH_SECONDS``), and the tier's gc record is read at most
every ``stores.summary.SUMMARY_SECONDS`` while the mount is in use
(``SUMMARY_IDLE_SECONDS`` while it is idle); a new one is logged as a
``fleet_gc`` event and shown in ``stats`` (``remote_tier_*``).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Awaitable, Callable
from typing import Any

from mithrilfs.observe.events import EventLog
from mithrilfs.shared.fleet.usage import UseRecorder, dir_of
from mithrilfs.shared.stores.base import RemoteStore
from mithrilfs.shared.stores.entries import RemoteError
from mithrilfs.shared.stores.summary import SUMMARY_IDLE_SECONDS, SUMMARY_SECONDS
from mithrilfs.store.namespace import DirPaths, Namespace

log = logging.getLogger(__name__)


class FleetState:
    """This mount's use records on their way out and the last gc summary it read (see the module doc)."""

    def __init__(self, remote: RemoteStore, events: EventLog, *, ns: Namespace, paths: DirPaths,
                 every: Callable[[float, float], float]) -> None:
        self.remote = remote
        #: A period while the mount is in use or while it is idle (``sync.pulse.Pulse.every``).
        self.every = every
        self.events = events
        self.ns = ns
        self.paths = paths
        #: When each inode's read was last turned into a use record.
        self._use_noted: dict[int, float] = {}
        self.usage = UseRecorder(now=remote.clock.now)
        self._flushed = 0.0
        self._summary_at = 0.0
        #: The last gc record read from the tier (None: none yet).
        self.summary: dict[str, Any] | None = None
        #: Use records sent (stats: ``remote_use_records``).
        self.records_sent = 0

    def read(self, ino: int) -> None:
        """A read of inode *ino* at offset 0: its directory is used (at most one record per ``usage.every``
        for an inode)."""
        now = time.monotonic()
        noted = self._use_noted.get(ino)
        if noted is None or now - noted >= self.usage.every:  # one dict lookup for most reads
            if len(self._use_noted) > 100_000:
                self._use_noted.clear()
            self._use_noted[ino] = now
            for parent, _name in self.ns.names_of(ino)[:1]:
                dir_path = self.paths.of_dir(parent)
                if dir_path is not None:
                    self.usage.used(dir_path)

    def used_path(self, path: str) -> None:
        """A file at *path* (in the tier's namespace) was read."""
        self.usage.used(dir_of(path))

    async def before_publish(self, paths: list[str], thread: Callable[..., Awaitable[Any]]) -> None:
        """Record the use of the directories these names go into, now, before they are published (a
        RemoteError propagates: the names wait for the next batch)."""
        for path in paths:
            self.usage.published(dir_of(path))
        await self._send(thread)

    async def step(self, thread: Callable[..., Awaitable[Any]]) -> None:
        """Send due use records and read the gc record when their time has come (RemoteError propagates:
        the uploader backs off)."""
        now = time.monotonic()
        if self.usage.pending() and now - self._flushed >= self.remote.use_flush_seconds:
            await self._send(thread)
        if now - self._summary_at >= self.every(SUMMARY_SECONDS, SUMMARY_IDLE_SECONDS):
            self._summary_at = now
            summary = await thread(self.remote.tier_summary)
            if summary is not None and (self.summary is None or summary["at"] != self.summary["at"]):
                if self.summary is not None or self.remote.clock.now() - summary["at"] < 2 * SUMMARY_SECONDS:
                    self.events.emit("fleet_gc", url=self.remote.url, **summary)
                self.summary = summary

    async def _send(self, thread: Callable[..., Awaitable[Any]]) -> None:
        records = self.usage.take()
        if not records:
            return
        try:
            await thread(self.remote.record_use, records)
        except RemoteError:
            self.usage.failed(records)
            raise
        self._flushed = time.monotonic()
        self.records_sent += len(records)

    def snapshot(self) -> dict[str, Any]:
        out: dict[str, Any] = {"remote_use_records": self.records_sent}
        if self.summary is not None:
            out.update(remote_tier_bytes=self.summary.get("bytes", 0), remote_tier_blobs=self.summary.get("blobs", 0),
                       remote_tier_names=self.summary.get("names", 0), remote_tier_gc_at=self.summary["at"],
                       remote_tier_gc_freed_bytes=self.summary.get("freed_bytes", 0))
        return out
