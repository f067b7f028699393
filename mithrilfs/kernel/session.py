"""One FUSE session on an open /dev/fuse fd: INIT, the request loop, replies, notifications.

One worker at a time holds the reader role: it reads a request
(non-blocking; only when none is pending does it wait for the fd), decodes
it and runs the filesystem's handler one step, synchronously.  Most
handlers finish in that step (the namespace is in memory or SQLite, nothing
to wait for), and the worker writes the reply and reads on: no trio
scheduling, no lock, no task switch per request, which is what keeps one
round trip short.  A handler that really suspends (a worker thread, Redis)
makes its worker hand the reader role to a new worker first and then finish
the handler as an ordinary trio task; at most ``MAX_WORKERS`` handlers are
suspended at once (beyond that the reader finishes its handler before
reading more).  What each request's body holds, the filesystem method it
calls and how its answer is packed is ``requests``'s job; the session
serves only the connection's own requests (INIT, DESTROY, INTERRUPT).

Errors: a handler's ``FUSEError`` is its answer; any other exception is
logged and answered EIO; a request we cannot decode gets EIO and an unknown
opcode ENOSYS.  Nothing a request does ends the loop.  The loop ends when
the kernel says the mount is gone (ENODEV on read, or DESTROY) or on
``stop()``; handlers in progress finish first.

Taking over (``adopt``): a new daemon can serve the fd of a live mount
whose daemon died or handed over, with the parameters INIT agreed (the
kernel sends INIT once per connection).  Before its first read it sends
NOTIFY_RESEND (protocol 7.40): the kernel puts every request the old
daemon read and never answered back in the queue, marked with bit 63 of
its unique id, which the reply echoes.  The old daemon may have carried
such a request out before it died, so a resent request that finds its
work done is answered as done: a resent create, mkdir, mknod, symlink or
link that meets EEXIST with the entry that is there (``requests``), a
resent unlink, rmdir or rename that meets ENOENT with success.

Work after the reply (``AfterReply``): a handler may leave a head start
for the request it expects next (the blob of a file just looked up); the
session runs it once the reply is written, when a read finds no request
waiting (the client is waking up), or before the next read once a waiting
request went first.

Notifications (invalidate an entry, an inode, tell of a deletion) are
written by a thread of their own: the kernel takes the directory's lock to
apply them, so writing one from the event loop while a request in that
directory waits on us would deadlock.
"""

from __future__ import annotations

import errno
import logging
import os
import time
import types
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import trio

from . import abi
from .after_reply import AfterReply
from .api import FUSEError, Operations, RequestContext
from .notify import Notifier
from .requests import Handler, Malformed, Requests

log = logging.getLogger(__name__)

MAX_WORKERS = 32
#: Requests served back to back before the reader yields to other trio tasks.
_YIELD_EVERY = 8
#: After answering, how long the reader keeps polling the fd before it sleeps in
#: epoll: a client's next request (its read after a lookup, its next open) comes
#: within microseconds, and catching it awake saves a sleep and a wake-up.
#: Measured with 1,500 Triton kernels (second load, interleaved): 0 us 1.56-1.64 s,
#: 50 us 0.67 s, 200 us 0.61-0.62 s, 1 ms 0.59-0.67 s.
SPIN_SECONDS = 200e-6
_HDR = abi.IN_HEADER.size
_NO_REPLY = frozenset({abi.FORGET, abi.BATCH_FORGET, abi.INTERRUPT})
#: Requests that may wait on something slow (the shared tier) and can be
#: abandoned safely when the caller is interrupted: they change no local
#: state before their last await.
_INTERRUPTIBLE = frozenset({abi.LOOKUP, abi.OPENDIR, abi.READDIR, abi.READDIRPLUS})
#: Bit 63 of a request's unique id: the kernel sent it again after NOTIFY_RESEND.
UNIQUE_RESEND = 1 << 63
#: Requests whose resent copy meets ENOENT when the previous daemon already carried them out.
_GONE_WHEN_DONE = frozenset({abi.UNLINK, abi.RMDIR, abi.RENAME, abi.RENAME2})
#: NOTIFY_RESEND came with protocol 7.40.
RESEND_MINOR = 40
#: Where ``RequestTimes`` counts the work handlers left for after their reply (no opcode is negative).
AFTER_REPLY = -1
_NAMES = {**abi.OPCODE_NAMES, AFTER_REPLY: "AFTER_REPLY"}
#: INIT's ``max_stack_depth`` with passthrough: backing files on a plain local filesystem (the store's).
_STACK_DEPTH = 1


class RequestTimes:
    """Requests answered and nanoseconds spent on them (decode, handler, reply), by opcode.

    Kept by the session because only it sees every request (the IOCTL the
    kernel forwards for every ``isatty()``, the ones answered ENOSYS);
    ``stats`` and ``scripts/bench/bench_warmstart.py`` read it to show where a
    load's time goes.
    """

    def __init__(self) -> None:
        self.by_opcode: dict[int, list[int]] = {}

    def record(self, opcode: int, ns: int) -> None:
        entry = self.by_opcode.get(opcode)
        if entry is None:
            entry = self.by_opcode[opcode] = [0, 0]
        entry[0] += 1
        entry[1] += ns

    def clear(self) -> None:
        self.by_opcode.clear()

    def by_name(self) -> dict[str, dict[str, float]]:
        """Most time first: ``{"LOOKUP": {"count": n, "seconds": s, "us_each": u}, ...}``."""
        return {_NAMES.get(op, str(op)):
                {"count": n, "seconds": round(ns / 1e9, 6), "us_each": round(ns / n / 1000, 2) if n else 0.0}
                for op, (n, ns) in sorted(self.by_opcode.items(), key=lambda kv: -kv[1][1])}


class ProtocolError(Exception):
    """The kernel speaks a protocol this session cannot serve (said in one line)."""


#: The requests the session serves itself (the connection's own); ``requests.Requests`` serves the rest.
_OWN = {abi.INIT: "_init", abi.DESTROY: "_destroy", abi.INTERRUPT: "_interrupt"}


def wanted_capabilities(readdirplus: bool, passthrough: bool = False) -> int:
    """What we ask for at INIT (the module doc and docs/design.md say why each)."""
    want = (abi.ASYNC_READ | abi.BIG_WRITES | abi.AUTO_INVAL_DATA | abi.PARALLEL_DIROPS
            | abi.MAX_PAGES | abi.CACHE_SYMLINKS | abi.INIT_EXT)
    if readdirplus:
        want |= abi.DO_READDIRPLUS | abi.READDIRPLUS_AUTO
    if passthrough:
        want |= abi.PASSTHROUGH
    return want


@dataclass(frozen=True)
class SessionParameters:
    """What INIT agreed: a daemon taking over a live connection serves with the same (``Session.adopt``)."""

    proto_minor: int
    capabilities: int
    max_write: int


class Session:
    """Serve *ops* on the FUSE device *fd* (already mounted) until the mount goes away."""

    def __init__(self, fd: int, ops: Operations, *, max_write: int = 1 << 20, max_readahead: int = 1 << 20,
                 readdirplus: bool = True, passthrough: bool = False, interruptible: bool = False,
                 debug: bool = False,
                 notifier: Notifier | None = None, request_times: RequestTimes | None = None,
                 after_reply: AfterReply | None = None, polls: Callable[[], bool] = lambda: True) -> None:
        self.fd = fd
        self.ops = ops
        self.max_write = max_write
        self.max_readahead = max_readahead
        self.readdirplus = readdirplus
        #: Whether INIT asks for FUSE passthrough (backing files: ``kernel.BackingFiles``).
        self.passthrough = passthrough
        #: Whether handlers can wait on something slow (the shared tier): then
        #: lookups and directory reads run in a cancel scope an INTERRUPT can cancel.
        self.interruptible = interruptible
        self.debug = debug
        self.spin = SPIN_SECONDS
        #: Whether to poll for the next request now (``SPIN_SECONDS``) rather than sleep at once: the daemon
        #: says no while it streams a prefetch on the same cores (``Tier.streaming``), where a core
        #: polling is one the prefetch, its writing process and the workload itself wait for
        #: (docs/benchmarks.md, "K").
        self.polls = polls
        #: Waits for a next request that began by polling (``polls`` said yes).
        self.polled = 0
        #: Capabilities both sides agreed on at INIT (abi flag bits), and the protocol minor.
        self.capabilities = 0
        self.proto_minor = 0
        self.initialized = trio.Event()
        self._bufsize = max(abi.MIN_READ_BUFFER, max_write + 4096)
        self._stopping = False
        #: Handlers suspended in tasks of their own.
        self._suspended = 0
        self._nursery: trio.Nursery | None = None
        self._inflight: dict[int, trio.CancelScope] = {}
        #: Notifications (``notify``): the caller's, when the filesystem was built with it, or one of its own.
        self.notifier = notifier if notifier is not None else Notifier(fd)
        self.error: ProtocolError | None = None
        #: Requests and the daemon's time on them, by opcode name (``stats`` shows them).
        self.request_times: RequestTimes = request_times if request_times is not None else RequestTimes()
        #: Head starts the filesystem's handlers leave, run after each reply (the filesystem's, when it has one).
        self.after_reply = after_reply if after_reply is not None else AfterReply()
        #: The handler of each opcode; anything else is answered ENOSYS.
        self._handlers: dict[int, Handler] = {
            **Requests(ops).handlers(), **{opcode: getattr(self, name) for opcode, name in _OWN.items()}}

    @property
    def parameters(self) -> SessionParameters:
        return SessionParameters(self.proto_minor, self.capabilities, self.max_write)

    async def adopt(self, params: SessionParameters) -> None:
        """Serve a connection whose INIT an earlier daemon answered (see the module doc); before ``serve``.

        The requests the earlier daemon read and never answered are asked
        for again first, and only then may notifications go out: one the
        kernel applies under a directory lock that a request waiting for
        its resend holds would never finish.
        """
        self.proto_minor, self.capabilities, self.max_write = params.proto_minor, params.capabilities, params.max_write
        self._bufsize = max(abi.MIN_READ_BUFFER, self.max_write + 4096)
        await self.ops.init()
        self.initialized.set()
        if self.proto_minor >= RESEND_MINOR:
            try:
                os.write(self.fd, abi.OUT_HEADER.pack(abi.OUT_HEADER.size, abi.NOTIFY_RESEND, 0))
            except OSError as e:
                log.warning("could not ask the kernel to resend what the previous daemon left unanswered: %s", e)
        self.notifier.open()

    # ------------------------------------------------------------------
    # the loop
    # ------------------------------------------------------------------
    async def serve(self) -> None:
        """Answer requests until the mount is gone or ``stop()``; raises ProtocolError for a kernel we cannot serve."""
        os.set_blocking(self.fd, False)
        async with trio.open_nursery() as nursery:
            self._nursery = nursery
            nursery.start_soon(self._reader)
        if self.error is not None:
            raise self.error

    def stop(self) -> None:
        """End the loop: the reader stops waiting for requests, handlers in progress finish."""
        if self._stopping:
            return
        self._stopping = True
        self.notifier.shut()
        try:
            trio.lowlevel.notify_closing(self.fd)  # wakes the reader out of its wait
        except RuntimeError:
            pass  # called outside the loop: the reader sees the flag at its next request

    def close(self) -> None:
        """Stop the notification thread (the fd belongs to whoever mounted)."""
        self.notifier.close()

    async def _reader(self) -> None:
        """Read and answer requests until the session ends or a handler suspends (see module doc)."""
        buf = bytearray(self._bufsize)
        view = memoryview(buf)
        streak = 0
        while True:
            n = await self._next_request(buf)
            if n is None:
                return
            coro = self._handle(buf, view, n)
            try:
                step = coro.send(None)
            except StopIteration:
                streak += 1
                if streak >= _YIELD_EVERY:
                    streak = 0
                    await trio.lowlevel.checkpoint()
                continue
            except BaseException:
                coro.close()
                raise
            # the handler waits on something: finish it here and let a new reader go on
            assert self._nursery is not None
            if self._suspended < MAX_WORKERS:
                self._suspended += 1
                self._nursery.start_soon(self._reader)
                try:
                    await _resume(coro, step)
                finally:
                    self._suspended -= 1
                return
            await _resume(coro, step)  # too many suspended: finish this one before reading more

    async def _next_request(self, buf: bytearray) -> int | None:
        """Read one request into *buf*; None once the session is over."""
        if self.polls():
            spin_until = time.perf_counter() + self.spin
            self.polled += 1
        else:
            spin_until = 0.0
        if self.after_reply.overdue and not self._stopping:
            self._run_after_reply(everything=True)
        while not self._stopping:
            try:
                n = os.readv(self.fd, [buf])
                if n == 0:  # end of file: the other side is gone (never happens on /dev/fuse)
                    self.stop()
                    return None
                self.after_reply.overtaken()
                return n
            except BlockingIOError:
                if self.after_reply.pending:  # nothing to answer: time for a head start
                    self._run_after_reply(everything=False)
                    continue
                if time.perf_counter() < spin_until:
                    continue
            except OSError as e:
                if e.errno in (errno.ENOENT, errno.EINTR):
                    continue  # the request was interrupted before we read it
                if e.errno == errno.ENODEV:
                    log.debug("the kernel ended the session (unmounted)")
                    self.stop()
                    return None
                raise
            try:
                await trio.lowlevel.wait_readable(self.fd)
            except trio.ClosedResourceError:
                return None  # stop()
        return None

    def _run_after_reply(self, *, everything: bool) -> None:
        begun = time.perf_counter_ns()
        self.after_reply.run(everything=everything)
        self.request_times.record(AFTER_REPLY, time.perf_counter_ns() - begun)

    async def _handle(self, buf: bytearray, view: memoryview, n: int) -> None:
        start = time.perf_counter_ns()
        if n < _HDR:
            log.error("short request from the kernel (%d bytes): ignored", n)
            return
        length, opcode, unique, nodeid, uid, gid, pid, extlen, _ = abi.IN_HEADER.unpack_from(buf)
        try:
            end = min(length, n) - 8 * extlen
            if end < _HDR:
                self._reply_error(unique, errno.EIO)
                return
            if self.debug:
                log.debug("request %d: %s node %d (%d bytes)", unique, abi.OPCODE_NAMES.get(opcode, opcode), nodeid,
                          length)
            handler = self._handlers.get(opcode)
            if handler is None:
                self._reply_error(unique, errno.ENOSYS)
                return
            if end - _HDR < abi.MIN_BODY.get(opcode, 0):
                # handlers unpack fixed structs from a buffer larger than the request: never past its end
                log.error("malformed %s request: %d bytes of body", abi.OPCODE_NAMES.get(opcode, opcode), end - _HDR)
                if opcode not in _NO_REPLY:
                    self._reply_error(unique, errno.EIO)
                return
            if not self.initialized.is_set() and opcode != abi.INIT:
                self._reply_error(unique, errno.EIO)
                return
            ctx = RequestContext(uid, gid, pid)
            if unique & UNIQUE_RESEND:
                ctx.resent = True
            scope = None
            try:
                if self.interruptible and opcode in _INTERRUPTIBLE:
                    with trio.CancelScope() as scope:
                        self._inflight[unique] = scope
                        payload = await handler(nodeid, ctx, buf, view, _HDR, end)
                    if scope.cancelled_caught:
                        raise FUSEError(errno.EINTR)
                else:
                    payload = await handler(nodeid, ctx, buf, view, _HDR, end)
            except FUSEError as e:
                if ctx.resent and e.errno == errno.ENOENT and opcode in _GONE_WHEN_DONE:
                    self._reply(unique, None)  # the previous daemon did it before it died
                elif opcode not in _NO_REPLY:
                    self._reply_error(unique, e.errno)
                return
            except (Malformed, ValueError, IndexError) as e:
                log.error("malformed %s request: %s", abi.OPCODE_NAMES.get(opcode, opcode), e)
                if opcode not in _NO_REPLY:
                    self._reply_error(unique, errno.EIO)
                return
            except Exception:
                log.exception("%s failed", abi.OPCODE_NAMES.get(opcode, opcode))
                if opcode not in _NO_REPLY:
                    self._reply_error(unique, errno.EIO)
                return
            finally:
                if scope is not None:
                    self._inflight.pop(unique, None)
            if opcode not in _NO_REPLY:
                self._reply(unique, payload)
        finally:
            self.request_times.record(opcode, time.perf_counter_ns() - start)

    # ------------------------------------------------------------------
    # replies and notifications
    # ------------------------------------------------------------------
    def _send(self, parts: list[Any]) -> None:
        try:
            os.writev(self.fd, parts)
        except OSError as e:
            # ENOENT: the request was interrupted and is gone; ENODEV: unmounted meanwhile
            if e.errno not in (errno.ENOENT, errno.ENODEV):
                log.error("cannot write a reply to the kernel: %s", e)

    def _reply(self, unique: int, payload: bytes | memoryview | None) -> None:
        if not payload:
            self._send([abi.OUT_HEADER.pack(16, 0, unique)])
        else:
            self._send([abi.OUT_HEADER.pack(16 + len(payload), 0, unique), payload])

    def _reply_error(self, unique: int, code: int) -> None:
        self._send([abi.OUT_HEADER.pack(16, -code, unique)])

    # ------------------------------------------------------------------
    # session management
    # ------------------------------------------------------------------
    async def _init(self, nodeid: int, ctx: RequestContext, buf: bytearray, view: memoryview, off: int,
                    end: int) -> bytes:
        major, minor, max_readahead, flags = abi.INIT_IN.unpack_from(buf, off)[:4]
        if major > abi.KERNEL_VERSION:
            # the kernel retries INIT with our major
            return abi.INIT_OUT.pack(abi.KERNEL_VERSION, abi.KERNEL_MINOR_VERSION, *((0,) * 11))
        if major < abi.KERNEL_VERSION or minor < abi.MIN_KERNEL_MINOR:
            self.error = ProtocolError(
                f"the kernel speaks FUSE {major}.{minor}; mithrilfs needs 7.{abi.MIN_KERNEL_MINOR} or newer")
            self.stop()
            raise FUSEError(errno.EPROTO)
        kernel_caps = flags
        if flags & abi.INIT_EXT and end - off >= abi.INIT_IN.size:
            kernel_caps |= abi.INIT_IN.unpack_from(buf, off)[4] << 32
        caps = wanted_capabilities(self.readdirplus, self.passthrough) & kernel_caps
        self.capabilities = caps
        self.proto_minor = min(minor, abi.KERNEL_MINOR_VERSION)
        max_pages = max(1, self.max_write // 4096)
        log.info("FUSE %d.%d (kernel %d.%d): max_write %d, parallel dirops %s, readdirplus %s",
                 abi.KERNEL_VERSION, self.proto_minor, major, minor, self.max_write,
                 bool(caps & abi.PARALLEL_DIROPS), bool(caps & abi.DO_READDIRPLUS))
        await self.ops.init()
        # no await from here to the reply's write in _handle: whoever waits on ``initialized`` (the
        # supervisor's line, told a successor may take over) runs only once the kernel has the reply
        self.initialized.set()
        self.notifier.open()
        return abi.INIT_OUT.pack(
            abi.KERNEL_VERSION, self.proto_minor, min(max_readahead, self.max_readahead), caps & 0xFFFFFFFF,
            64, 48, self.max_write, 1, max_pages, 0, caps >> 32, _STACK_DEPTH if caps & abi.PASSTHROUGH else 0, 0)

    async def _destroy(self, nodeid: int, ctx: RequestContext, buf: bytearray, view: memoryview, off: int,
                       end: int) -> None:
        await self.ops.destroy()
        self.stop()
        return None

    async def _interrupt(self, nodeid: int, ctx: RequestContext, buf: bytearray, view: memoryview, off: int,
                         end: int) -> None:
        (target,) = abi.INTERRUPT_IN.unpack_from(buf, off)
        scope = self._inflight.get(target)
        if scope is not None:
            scope.cancel()
        return None


@types.coroutine
def _resume(coro: Any, step: Any) -> Any:
    """Go on running a coroutine that already yielded *step* to trio, as part of the current task.

    ``yield from`` from its second step on: what trio sends or throws in
    goes to *coro*, what *coro* yields goes to trio.
    """
    while True:
        try:
            sent = yield step
        except BaseException as e:
            try:
                step = coro.throw(e)
            except StopIteration as stop:
                return stop.value
        else:
            try:
                step = coro.send(sent)
            except StopIteration as stop:
                return stop.value
