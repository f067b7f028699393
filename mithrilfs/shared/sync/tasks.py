"""Where the tier's parts run their work: worker threads, and the background nursery of the mount.

``Threads`` runs a part's blocking call (a store request, an index write)
in a worker thread, at most as many at once as the tier's limiter lets;
``Background`` holds the nursery ``RemoteTier.run`` opens, once it has it,
so a part can start a task that outlives the request that began it (a
read-ahead, the look-ahead).  Both are built once by ``remote_tier`` and
handed to the parts that need them.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import trio


class Threads:
    """Blocking calls in worker threads, at most *limiter*'s at once; awaited with no bound of its own."""

    def __init__(self, limiter: trio.CapacityLimiter) -> None:
        self.limiter = limiter

    async def __call__(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await trio.to_thread.run_sync(fn, *args, limiter=self.limiter)


class Background:
    """The tier's background nursery: None until ``open`` (the tier's ``run`` began), then for the mount."""

    def __init__(self) -> None:
        self.nursery: trio.Nursery | None = None
        #: Set once the nursery is open: a command that starts background work waits for it.
        self.opened = trio.Event()

    def open(self, nursery: trio.Nursery) -> None:
        self.nursery = nursery
        self.opened.set()
