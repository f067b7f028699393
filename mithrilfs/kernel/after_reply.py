"""Work a handler leaves for after its reply is written: a head start on the request it expects next.

A client waits for each reply, and on a VM an idle CPU takes tens of
microseconds to wake: whatever the daemon does before it replies is paid
by the client, round trip by round trip.  What a handler can only guess it
will need next (the blob of a file just looked up, the other names of a
directory just entered) is cheaper to do once the reply is on its way.

When the session runs the jobs (``Session._next_request``): as soon as it
finds no request waiting, one job at a time, between attempts to read;
a Python client's ``open()`` then spends its IOCTL round trip while the
job runs.  A request that is already waiting goes first, but only one: the
jobs run before the request after it is read (when the client runs on the
daemon's CPU, it has always sent its next request by the time the reply's
write returns, and jobs that waited for an idle moment would never run
before their READ).  Jobs run on the event loop like the handlers
themselves, so a job sees and changes the filesystem's state with no lock,
exactly as a handler would.  A job is a head start, never an answer: it
may find that nothing is left to do, and what fails in it is the next
request's to find.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable

log = logging.getLogger(__name__)


class AfterReply:
    """The queue of jobs handlers defer until their reply is written."""

    def __init__(self) -> None:
        self._jobs: deque[Callable[[], None]] = deque()
        self._idle_jobs: list[Callable[[], None]] = []
        self._overtaken = False

    def defer(self, job: Callable[[], None]) -> None:
        self._jobs.append(job)

    def when_idle(self, job: Callable[[], None]) -> None:
        """Run *job* once the session has nothing to do: no request waiting, no job left, and it is about to
        sleep until the next request (deferred work that must not wait longer: the index's commit of
        creates, ``cache.names``)."""
        self._idle_jobs.append(job)

    def idle(self) -> None:
        """Run the jobs left for the session's next idle moment (``when_idle``): it is about to sleep."""
        while self._idle_jobs:
            jobs, self._idle_jobs = self._idle_jobs, []
            for job in jobs:
                try:
                    job()
                except Exception:  # as for ``run``
                    log.exception("work left for an idle moment failed")

    @property
    def pending(self) -> bool:
        return bool(self._jobs)

    def overtaken(self) -> None:
        """A request is about to be served before the jobs queued now (the session read it)."""
        self._overtaken = bool(self._jobs)

    @property
    def overdue(self) -> bool:
        """A request went before the jobs queued: they run before the next one is read."""
        return self._overtaken and bool(self._jobs)

    def run(self, *, everything: bool) -> None:
        """Run the oldest job queued, or *everything* queued."""
        self._overtaken = False
        while self._jobs:
            job = self._jobs.popleft()
            try:
                job()
            except Exception:  # a job handles what it expects; anything else is a bug, never the loop's end
                log.exception("work after a reply failed")
            if not everything:
                return
