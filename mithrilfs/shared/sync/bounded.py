"""The one bound on every wait of the mount on the shared tier: ``REMOTE_WAIT`` without progress.

A request of the mount (a lookup, a listing, a first read) that needs the
tier waits for it at most ``REMOTE_WAIT`` seconds *in which no byte
arrives*: a transfer that keeps moving (a large blob over a slow link) is
waited for as long as it moves, a stalled endpoint (connections accepted,
nothing answered) costs one ``REMOTE_WAIT`` and then the back-off answers
at once.  The clients' own timeouts (``stores.s3``'s 120 s for large blobs,
Redis's socket timeouts) only bound how long the abandoned worker thread
lives; nobody waits on them.  Progress is what the store's levels count in
``bytes_in`` as it arrives, and each answer asking for fewer requests (a
throttled bucket answers: ``RemoteStore.received``).

A thread that outlives the bound is abandoned (``abandon_on_cancel``): it
must own everything it touches (the staging file it writes to), and its
levels that did not answer meanwhile back off (``RemoteStore.stalled``),
so the next requests do not queue behind it.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import trio

from mithrilfs.shared.stores.base import REMOTE_WAIT, RemoteStore
from mithrilfs.shared.stores.entries import RemoteError

#: How often the watcher looks for progress.
_POLL = 0.1


class Stalled(RemoteError):
    """The tier did not move a byte for ``REMOTE_WAIT``: the request gave up (the thread runs on)."""


async def within_bound(store: RemoteStore, run: Callable[[], Any], *, wait: float = REMOTE_WAIT) -> Any:
    """Await ``run()`` (a coroutine function); raise ``Stalled`` when *store* received nothing for *wait* s.

    Exceptions of *run* propagate unchanged (not wrapped in a group).
    """
    box: dict[str, Any] = {}
    began = time.monotonic()

    async def body(scope: trio.CancelScope) -> None:
        try:
            box["value"] = await run()
        except Exception as e:  # re-raised below, outside the nursery (no exception group)
            box["error"] = e
        scope.cancel()

    async def watch(scope: trio.CancelScope, outer: trio.CancelScope) -> None:
        seen = store.received()
        while True:
            await trio.sleep(_POLL)
            now = store.received()
            if now != seen:
                seen = now
                outer.deadline = trio.current_time() + wait

    with trio.move_on_after(wait) as outer:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(body, nursery.cancel_scope)
            nursery.start_soon(watch, nursery.cancel_scope, outer)
    if "error" in box:
        raise box["error"]
    if "value" in box:
        return box["value"]
    why = f"no answer in {wait:g} s"
    store.stalled(why, since=began)
    raise Stalled(why)


async def in_thread(store: RemoteStore, limiter: trio.CapacityLimiter, fn: Callable[..., Any], *args: Any,
                    wait: float = REMOTE_WAIT) -> Any:
    """``fn(*args)`` in a worker thread, waited for within the bound (the thread is abandoned past it)."""
    return await within_bound(
        store, lambda: trio.to_thread.run_sync(fn, *args, limiter=limiter, abandon_on_cancel=True), wait=wait)


async def request(store: RemoteStore, limiter: trio.CapacityLimiter, fn: Callable[..., Any], *args: Any) -> Any:
    """A request of the mount: ``fn(*args)`` within the bound; None when the tier is backed off, fails, or
    stalls past ``REMOTE_WAIT``."""
    if not store.available():
        return None
    try:
        return await in_thread(store, limiter, fn, *args)
    except RemoteError:
        return None
