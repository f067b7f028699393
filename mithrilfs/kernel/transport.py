"""Requests served from io_uring entries, beside the /dev/fuse loop (``Session(uring=True)``).

Once INIT has agreed ``FUSE_OVER_IO_URING``, ``UringTransport.serve``
registers ``ENTRIES_PER_QUEUE`` entries for every queue (one per possible
CPU; ``kernel.uring``) and then answers what they bring with the session's
own dispatch (``Session._dispatch``, handed in), so every behaviour of a request
(errors, counting, handlers that suspend) is the one /dev/fuse gives it.
Between requests it waits as the /dev/fuse reader does (``kernel.polling``:
polling a moment before it sleeps, yielding to the loop's other tasks every
few requests).  An answer is a COMMIT_AND_FETCH of the entry, submitted at once; a handler
that suspends keeps its entry until it answers, and finishes as a trio task
of its own.  The /dev/fuse loop keeps running: INIT, INTERRUPT, FORGET and
whatever the kernel sends before every queue has its entries come there.

Fallback: a kernel that does not offer the flag never gets it (the session
serves /dev/fuse alone); a ring that cannot be set up, or a registration
the kernel refuses, is logged once and the kernel goes on with /dev/fuse
(it switches to the ring only once every queue has an entry, and forgets
io_uring on a refused registration).  ``describe`` says which serves.
Not covered: a successor daemon taking over a connection served over
io_uring (requests held in the dead daemon's entries are not resent).
"""

from __future__ import annotations

import errno
import logging
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from . import uring
from .polling import YIELD_EVERY

log = logging.getLogger(__name__)

#: The environment variable that asks the daemon for FUSE over io_uring ("1"; off by default).
URING_VARIABLE = "MITHRILFS_FUSE_URING"
#: Entries each queue registers: requests one CPU's clients may have in the daemon at once.
ENTRIES_PER_QUEUE = 4
_GONE = (errno.ENOTCONN, errno.ECANCELED, errno.ENODEV)


class _Slot:
    """One registered entry, with the buffer its request is laid out in and the two ways to answer it."""

    def __init__(self, transport: UringTransport, index: int, entry: uring.Entry, bufsize: int) -> None:
        self.transport = transport
        self.index = index
        self.entry = entry
        self.buf = bytearray(bufsize)
        self.view = memoryview(self.buf)

    def reply(self, unique: int, payload: bytes | memoryview | None) -> None:
        self.transport.commit(self, unique, 0, payload)

    def reply_error(self, unique: int, code: int) -> None:
        self.transport.commit(self, unique, -code, None)


class UringTransport:
    """The io_uring side of one session: its ring, its entries, and the task that serves them."""

    def __init__(self, fd: int, payload_size: int, bufsize: int, dispatch: Callable[..., Any],
                 finish: Callable[..., Awaitable[None]], stopped: Callable[[], bool], idle: Callable[[], bool],
                 poll_deadline: Callable[[], float], before_sleep: Callable[[], None]) -> None:
        """*dispatch* and *finish*: the session's (``Session._dispatch``, ``Session._finish``); *stopped*:
        whether the session is ending; *idle*: run one job left for after a reply, if any (whether it ran
        one); *poll_deadline*: until when to poll for the next request before sleeping
        (``Polling.deadline``); *before_sleep*: run what is left for an idle moment
        (``AfterReply.idle``); *bufsize*: its request buffer's size."""
        self.fd = fd
        self.bufsize = bufsize
        self._dispatch = dispatch
        self._finish = finish
        self._stopped = stopped
        self._idle = idle
        self._poll_deadline = poll_deadline
        self._before_sleep = before_sleep
        self.payload_size = payload_size
        self.queues = uring.possible_cpus()
        self.ring: uring.Ring | None = None
        self._slots: list[_Slot] = []
        self._live = 0
        #: Requests the entries brought.
        self.served = 0
        self._nursery: trio.Nursery | None = None
        self.failure: str | None = None

    def describe(self) -> str:
        """Which transport serves the mount, in a few words (``mithrilfs status``)."""
        if self.ring is not None and self._live == len(self._slots) and self._slots:
            return f"io_uring ({self.queues} queues x {ENTRIES_PER_QUEUE} entries, {self.served} requests)"
        why = f": {self.failure}" if self.failure else ""
        return f"/dev/fuse read/write (io_uring agreed at INIT, not serving{why})"

    async def serve(self) -> None:
        """Register the entries and answer their requests until the kernel ends them or the session stops."""
        count = self.queues * ENTRIES_PER_QUEUE
        try:
            self.ring = uring.Ring(1 << (2 * count - 1).bit_length())
        except uring.UringError as e:
            self._give_up(str(e))
            return
        bufsize = self.bufsize
        for q in range(self.queues):
            for _ in range(ENTRIES_PER_QUEUE):
                slot = _Slot(self, len(self._slots), uring.Entry(q, self.payload_size), bufsize)
                self._slots.append(slot)
                slot.entry.register(self.ring, self.fd, slot.index)
        self._live = len(self._slots)
        try:
            self.ring.submit_and_wait(0)
        except OSError as e:
            self._give_up(f"io_uring_enter: {e.strerror}")
            return
        log.info("serving FUSE requests over io_uring: %s", self.describe())
        try:
            async with trio.open_nursery() as nursery:
                self._nursery = nursery
                nursery.start_soon(self._worker)
        finally:
            ring, self.ring = self.ring, None
            if ring is not None:
                ring.close()

    async def _worker(self) -> None:
        """Answer completions until the entries end; a handler that suspends is finished here, by this task
        (trio's locks belong to the task that took them), once a new worker has taken over the ring."""
        ring, slots, dispatch = self.ring, self._slots, self._dispatch
        assert ring is not None and self._nursery is not None
        streak = 0
        while self._live and not self._stopped():
            for index, res in ring.completions():
                slot = slots[index]
                if res < 0:
                    self._ended(-res)
                    continue
                n = slot.entry.request(slot.buf)
                self.served += 1
                streak += 1
                suspended = dispatch(slot.buf, slot.view, n, slot.reply, slot.reply_error)
                if suspended is not None:
                    self._nursery.start_soon(self._worker)
                    await self._finish(*suspended)
                    return
            if not self._live:
                return
            if streak >= YIELD_EVERY:
                streak = 0
                await trio.lowlevel.checkpoint()
            # nothing to answer: the head starts handlers left, one at a time, and polling a moment
            # (``kernel.polling``), until a request comes
            spin_until = self._poll_deadline()
            while True:
                ran = self._idle()
                ring.submit_and_wait(0)  # runs the task work that posts a request that came meanwhile
                if ring.has_completions() or not (ran or time.perf_counter() < spin_until):
                    break
            if ring.has_completions():
                continue
            if self._stopped():
                return  # stop() came while this task yielded: its wake-up found nobody waiting
            self._before_sleep()
            if ring.has_completions():
                continue
            streak = 0
            try:
                await trio.lowlevel.wait_readable(ring.fd)
            except trio.ClosedResourceError:
                return  # stop()

    def commit(self, slot: _Slot, unique: int, error: int, payload: Any) -> None:
        """Answer the request *slot* holds and hand the entry back for the next one."""
        if self.ring is None:
            return
        slot.entry.commit(self.ring, self.fd, slot.index, unique, error, payload)
        try:
            self.ring.submit_and_wait(0)
        except OSError as e:
            log.error("cannot commit a reply over io_uring: %s", e.strerror)

    def stop(self) -> None:
        """Wake the serving task so that it ends (the kernel ends the entries at unmount)."""
        if self.ring is not None:
            try:
                trio.lowlevel.notify_closing(self.ring.fd)
            except RuntimeError:
                pass

    def _ended(self, code: int) -> None:
        self._live -= 1
        if code not in _GONE and self.failure is None:
            self._give_up(f"the kernel refused an entry: {os.strerror(code)}")

    def _give_up(self, why: str) -> None:
        self.failure = why
        log.warning("not serving over io_uring (%s): requests go through /dev/fuse", why)
