"""How a request handler's failure becomes the kernel's answer, and how long each took.

Every handler of ``operations.Operations`` goes through ``request`` (or
``data_request``, for those that write file data): one place decides that
a full disk gets one eviction pass and a retry, that a stray OSError is its
errno and anything else EIO, logged with the operation's name and counted
in the event log.  ``timed`` records a handler's latency for the stats'
percentiles.  Kept apart so the handlers read as what they do.
"""

from __future__ import annotations

import errno
import functools
import logging
import sqlite3
import time
from collections.abc import Awaitable, Callable
from typing import Any, Protocol, TypeVar

from mithrilfs.cache.budget import Budget, room_would_help
from mithrilfs.kernel import FUSEError
from mithrilfs.observe.events import EventLog
from mithrilfs.observe.stats import Stats
from mithrilfs.store.open import is_disk_full

log = logging.getLogger("mithrilfs.fs")  # the name the handlers log under (operations too)

F = TypeVar("F", bound=Callable[..., Awaitable[Any]])


class Handlers(Protocol):
    """What the wrapped handlers' object offers the policy (``operations.Operations``)."""

    budget: Budget
    events: EventLog
    stats: Stats


def sqlite_errno(e: sqlite3.Error) -> int:
    """The errno a failed index operation means for the caller."""
    if is_disk_full(e):
        return errno.ENOSPC
    text = str(e)
    if "readonly" in text or "read-only" in text:
        return errno.EROFS
    return errno.EIO


def error_policy(*, data: bool) -> Callable[[F], F]:
    """Error policy of the request handlers.

    A full backing disk gets one eviction pass to make room and one retry
    (handlers are written so that a failed attempt changes nothing); *data*
    says the handler writes file data (see ``Budget.retry_after_room``).  Stray
    OSErrors become their errno and anything else EIO, logged here with
    the operation's name and counted in the event log.
    """

    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        async def wrapper(self: Handlers, *args: Any, **kwargs: Any) -> Any:
            try:
                # Budget.retry_when_full, with its first attempt inlined: no closure or extra coroutine
                # per request
                try:
                    return await fn(self, *args, **kwargs)
                except (OSError, sqlite3.OperationalError) as e:
                    if not room_would_help(e):
                        raise
                return await self.budget.retry_after_room(lambda: fn(self, *args, **kwargs), data=data)
            except FUSEError:
                raise
            except OSError as e:
                if e.errno in (None, errno.EIO, errno.ENOSPC, errno.EROFS):
                    log.warning("%s failed: %s", fn.__name__, e)
                    self.events.emit("error", op=fn.__name__, error=str(e))
                raise FUSEError(e.errno or errno.EIO) from None
            except sqlite3.Error as e:
                code = sqlite_errno(e)
                if code == errno.EIO:
                    log.exception("%s failed", fn.__name__)
                else:
                    log.warning("%s failed: %s", fn.__name__, e)
                self.events.emit("error", op=fn.__name__, error=str(e))
                raise FUSEError(code) from None
            except Exception as e:
                log.exception("%s failed", fn.__name__)
                self.events.emit("error", op=fn.__name__, error=repr(e))
                raise FUSEError(errno.EIO) from None

        return wrapper  # type: ignore[return-value]

    return wrap


request = error_policy(data=False)
#: Handlers that write file data into the store: ``write``, ``setattr`` (a truncate copies the blob),
#: and ``read`` (a first read of content in the shared tier fetches it).
data_request = error_policy(data=True)


def timed(op: str) -> Callable[[F], F]:
    """Record the handler's latency (success or not) under *op* for the stats' percentiles."""

    def wrap(fn: F) -> F:
        @functools.wraps(fn)
        async def wrapper(self: Handlers, *args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter_ns()
            try:
                return await fn(self, *args, **kwargs)
            finally:
                self.stats.record_latency(op, time.perf_counter_ns() - start)

        return wrapper  # type: ignore[return-value]

    return wrap
