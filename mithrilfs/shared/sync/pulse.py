"""How often a mounted node asks the tier: at once while the mount is used, rarely while nobody uses it.

A node learns of the fleet's changes (the feed, ``sync.changes``), of a
tier that lost its data (the epoch, ``sync.write_behind``) and of the last
gc (``fleet.state``) by asking.  Asked at one rate for the life of a mount,
an idle node costs as much as a busy one, and a fleet of idle nodes costs
the bucket its LIST price many times over.  So each asker picks its period
from the ``Pulse``: short while the mount is *in use* (a lookup, a listing
or a first read of a file within ``IDLE_AFTER`` seconds), long while it is
idle.  The first use after an idle spell wakes the feed's follower at
once, and the lookup that ended the spell waits for that check (at most
``FRESH_WAIT``) before it answers from what the node knows: a name purged
while the node was idle is not served afterwards.  A feed that waits for
news in the tier (a Redis stream read with ``BLOCK``) is always this fresh,
and nothing waits for it.

The pulse also measures what idleness costs: the tier's requests sent
while the node was idle, per hour of idleness (``stats``:
``remote_idle_requests_per_hour``).
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from typing import Any

import trio

from mithrilfs.shared.stores.ages import env_seconds

#: Seconds without a use after which the mount is idle (``MITHRILFS_IDLE_AFTER``: tests lower it).
IDLE_AFTER = env_seconds("MITHRILFS_IDLE_AFTER", 300.0, positive=True)
#: Seconds between two checks of the feed by an idle node (``MITHRILFS_IDLE_PERIOD``: tests lower it).
IDLE_PERIOD = env_seconds("MITHRILFS_IDLE_PERIOD", 75.0, positive=True)
#: The longest a lookup that ends an idle spell waits for the feed's check it started.
FRESH_WAIT = 2.0


class Pulse:
    """Whether the mount is in use, the periods that follow from it, and the cost of its idle spells.

    *requests* counts every request the tier has sent; *watching*: the feed waits for news in the tier
    (nothing needs to wait for a check)."""

    def __init__(self, requests: Callable[[], int], *, watching: bool, idle_after: float = IDLE_AFTER) -> None:
        self._requests = requests
        self.watching = watching
        self.idle_after = idle_after
        #: When the mount was last used (monotonic); mounting is a use.
        self.last_use = time.monotonic()
        #: When the follower's check in progress began, and when the last finished one began (monotonic).
        self._check_began = -math.inf
        self._last_began = -math.inf
        self._woken = trio.Event()
        self._checked = trio.Event()
        #: The idle spell being counted: (its start, the requests sent before it); None while in use.
        self._spell: tuple[float, int] | None = None
        self.idle_seconds = 0.0
        self.idle_requests = 0
        #: A request to the tier failed since the epoch was last checked: a server may have restarted empty.
        self.suspect = False

    # -- use -----------------------------------------------------------------
    def idle(self, now: float | None = None) -> bool:
        return (time.monotonic() if now is None else now) - self.last_use >= self.idle_after

    def in_use(self) -> bool:
        """The mount is used now; True when this use ends an idle spell (the follower is woken at once)."""
        now = time.monotonic()
        was_idle = self.idle(now)
        self.last_use = now
        if was_idle:
            self._end_spell(now)
            self._woken.set()
        return was_idle

    def every(self, in_use: float, idle: float) -> float:
        """*in_use* seconds while the mount is in use, *idle* while it is not."""
        return idle if self.idle() else in_use

    # -- the follower's checks -----------------------------------------------
    async def sleep(self, seconds: float) -> None:
        """Sleep *seconds*, or until a use ends an idle spell."""
        with trio.move_on_after(seconds):
            await self._woken.wait()
        self._woken = trio.Event()

    def checking(self) -> None:
        """The follower begins a check of the feed."""
        self._check_began = time.monotonic()

    def checked(self) -> None:
        """The follower finished the check it began (and applied what it said)."""
        self._last_began = self._check_began
        self.tick()
        self._checked.set()
        self._checked = trio.Event()

    def trouble(self) -> None:
        """The follower's request failed: the uploader checks the tier's epoch at its next step."""
        self.suspect = True

    async def fresh(self) -> None:
        """Return once the follower has finished a check begun after the idle spell ended, at most
        ``FRESH_WAIT`` seconds (a tier that does not answer leaves the node serving what it knows); at once
        where the feed waits in the tier for news."""
        since = self.last_use
        with trio.move_on_after(FRESH_WAIT):
            while not self.watching and self._last_began < since:
                await self._checked.wait()

    # -- what idleness costs ---------------------------------------------------
    def tick(self) -> None:
        """Begin counting an idle spell once the mount has been idle ``idle_after`` seconds."""
        now = time.monotonic()
        if self._spell is None and self.idle(now):
            self._spell = (now, self._requests())

    def _end_spell(self, now: float) -> None:
        if self._spell is not None:
            start, before = self._spell
            self.idle_seconds += now - start
            self.idle_requests += self._requests() - before
            self._spell = None

    def snapshot(self) -> dict[str, Any]:
        self.tick()
        seconds, requests = self.idle_seconds, self.idle_requests
        if self._spell is not None:
            seconds += time.monotonic() - self._spell[0]
            requests += self._requests() - self._spell[1]
        return {"remote_idle": int(self.idle()), "remote_idle_seconds": round(seconds, 1),
                "remote_idle_requests": requests,
                "remote_idle_requests_per_hour": round(requests * 3600 / seconds, 1) if seconds >= 10 else None}
