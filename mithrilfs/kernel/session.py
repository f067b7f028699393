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

FUSE over io_uring (``uring=True``, when the kernel offers it at INIT):
``transport.UringTransport`` serves the requests the kernel puts in its
ring entries through the same ``_dispatch``, answering each by a commit of
its entry; this loop goes on serving what still comes through /dev/fuse
(INIT, INTERRUPT, FORGET, and everything until every queue has entries).

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
from collections.abc import Awaitable, Callable
from typing import Any

import trio

from . import abi
from .after_reply import AfterReply
from .api import FUSEError, Operations, RequestContext
from .negotiate import PAGE, SessionParameters, allowed_max_write, init_reply, wanted_capabilities, write_size_note
from .notify import Notifier
from .polling import YIELD_EVERY, Polling
from .request_times import AFTER_REPLY, OPCODE_LABELS, RequestTimes
from .requests import Handler, Malformed, Requests
from .transport import UringTransport

log = logging.getLogger(__name__)

MAX_WORKERS = 32
_HDR = abi.IN_HEADER.size
_unpack_header = abi.IN_HEADER.unpack_from
_pack_reply = abi.OUT_HEADER.pack
_MIN_BODY = abi.MIN_BODY
#: Replies with a payload up to this size go out as one buffer (a copy is cheaper than ``writev``'s list).
_JOIN_BELOW = 4096
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
#: How a request's answer goes back: ``reply(unique, payload)`` and ``reply_error(unique, errno)``.
Reply = Callable[[int, "bytes | memoryview | None"], None]
ReplyError = Callable[[int, int], None]
#: A request whose handler suspended in ``Session._dispatch``: its coroutine, the step it yielded, its
#: opcode, unique id, caller, the clock at its start and how to answer it (what ``Session._finish`` goes on with).
_Suspended = tuple[Any, Any, int, int, RequestContext, int, Reply, ReplyError]
class ProtocolError(Exception):
    """The kernel speaks a protocol this session cannot serve (said in one line)."""


#: The requests the session serves itself (the connection's own); ``requests.Requests`` serves the rest.
_OWN = {abi.INIT: "_init", abi.DESTROY: "_destroy", abi.INTERRUPT: "_interrupt"}


class Session:
    """Serve *ops* on the FUSE device *fd* (already mounted) until the mount goes away."""

    def __init__(self, fd: int, ops: Operations, *, max_write: int | None = None, max_readahead: int = 1 << 20,
                 readdirplus: bool = True, passthrough: bool = False, interruptible: bool = False,
                 debug: bool = False,
                 notifier: Notifier | None = None, request_times: RequestTimes | None = None,
                 after_reply: AfterReply | None = None, polls: Callable[[], bool] = lambda: True,
                 uring: bool = False) -> None:
        self.fd = fd
        self.ops = ops
        #: The largest WRITE (and READ) a request carries: ``negotiate.MAX_WRITE`` unless the kernel allows less.
        self.max_write = max_write if max_write is not None else allowed_max_write()
        self.max_readahead = max_readahead
        self.readdirplus = readdirplus
        #: Whether INIT asks for FUSE passthrough (backing files: ``kernel.BackingFiles``).
        self.passthrough = passthrough
        #: Whether handlers can wait on something slow (the shared tier): then
        #: lookups and directory reads run in a cancel scope an INTERRUPT can cancel.
        self.interruptible = interruptible
        self.debug = debug
        #: Whether to ask for FUSE over io_uring at INIT (served by ``transport.UringTransport`` when agreed).
        self.uring = uring
        self.transport: UringTransport | None = None
        #: How both transports wait for the next request (``kernel.polling``; *polls*: whether to poll now).
        self.polling = Polling(polls)
        #: Capabilities both sides agreed on at INIT (abi flag bits), and the protocol minor.
        self.capabilities = 0
        self.proto_minor = 0
        self.initialized = trio.Event()
        #: ``initialized`` as a plain flag, for the request loop.
        self._ready = False
        self._bufsize = max(abi.MIN_READ_BUFFER, self.max_write + PAGE)
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
        self.request_times.transport = self.describe_transport
        #: Head starts the filesystem's handlers leave, run after each reply (the filesystem's, when it has one).
        self.after_reply = after_reply if after_reply is not None else AfterReply()
        #: The handler of each opcode; anything else is answered ENOSYS.
        self._handlers: dict[int, Handler] = {
            **Requests(ops).handlers(), **{opcode: getattr(self, name) for opcode, name in _OWN.items()}}

    def describe_transport(self) -> str:
        """Which transport serves the mount, in a few words (``mithrilfs status``)."""
        if self.transport is not None:
            how = self.transport.describe()
        elif self.uring and self._ready:
            how = "/dev/fuse read/write (io_uring asked for; the kernel does not offer it: enable_uring is N?)"
        else:
            how = "/dev/fuse read/write"
        return how + write_size_note(self.max_write)

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
        self._bufsize = max(abi.MIN_READ_BUFFER, self.max_write + PAGE)
        await self.ops.init()
        self._ready = True
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
        if self.transport is not None:
            self.transport.stop()
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
        read = self._read_waiting
        dispatch = self._dispatch
        reply, reply_error = self._reply, self._reply_error
        while True:
            n = read(buf)
            if n <= 0:
                waited = await self._next_request(buf, n)
                if waited is None:
                    return
                n = waited
            suspended = dispatch(buf, view, n, reply, reply_error)
            if suspended is None:
                streak += 1
                if streak >= YIELD_EVERY:
                    streak = 0
                    await trio.lowlevel.checkpoint()
                continue
            # the handler waits on something: finish it here and let a new reader go on
            assert self._nursery is not None
            if self._suspended < MAX_WORKERS:
                self._suspended += 1
                self._nursery.start_soon(self._reader)
                try:
                    await self._finish(*suspended)
                finally:
                    self._suspended -= 1
                return
            await self._finish(*suspended)  # too many suspended: finish this one before reading more

    def _read_waiting(self, buf: bytearray) -> int:
        """Read a request already waiting into *buf*: its length, or 0 when none waits (-1: try again at once).

        Work left for after a reply that a request overtook runs first; an
        error other than "nothing waiting" is left to ``_next_request``.
        """
        after = self.after_reply
        if after.overdue and not self._stopping:
            self._run_after_reply(everything=True)
        if self._stopping:
            return -1
        try:
            n = os.readv(self.fd, [buf])
        except BlockingIOError:
            return 0
        except OSError:
            return -1
        if n == 0:
            return -1
        after.overtaken()
        return n

    async def _next_request(self, buf: bytearray, last: int) -> int | None:
        """Wait for the next request and read it into *buf*; None once the session is over.

        *last* is what ``_read_waiting`` found: 0 (nothing waiting, so poll
        a moment when ``polls`` says so, then sleep in epoll) or -1 (read
        again: an error or the end of the session shows there).
        """
        spin_until = self.polling.deadline() if last == 0 else 0.0
        nothing_waiting = last == 0
        while not self._stopping:
            if not nothing_waiting:
                try:
                    n = os.readv(self.fd, [buf])
                    if n == 0:  # end of file: the other side is gone (never happens on /dev/fuse)
                        self.stop()
                        return None
                    self.after_reply.overtaken()
                    return n
                except BlockingIOError:
                    pass
                except OSError as e:
                    if e.errno in (errno.ENOENT, errno.EINTR):
                        continue  # the request was interrupted before we read it
                    if e.errno == errno.ENODEV:
                        log.debug("the kernel ended the session (unmounted)")
                        self.stop()
                        return None
                    raise
            nothing_waiting = False
            if self._idle_work():  # nothing to answer: time for a head start
                continue
            if time.perf_counter() < spin_until:
                continue
            self.after_reply.idle()
            try:
                await trio.lowlevel.wait_readable(self.fd)
            except trio.ClosedResourceError:
                return None  # stop()
        return None

    def _idle_work(self) -> bool:
        """Run the oldest job left for after a reply, when one is queued; whether one ran."""
        if not self.after_reply.pending or self._stopping:
            return False
        self._run_after_reply(everything=False)
        return True

    def _run_after_reply(self, *, everything: bool) -> None:
        begun = time.perf_counter_ns()
        self.after_reply.run(everything=everything)
        self.request_times.record(AFTER_REPLY, time.perf_counter_ns() - begun)

    def _dispatch(self, buf: bytearray, view: memoryview, n: int, reply: Reply, reply_error: ReplyError,
                  ) -> _Suspended | None:
        """Decode the request in *buf* and run its handler's first step; answer it unless the handler suspends.

        *reply* and *reply_error* send the answer: a write to /dev/fuse, or
        a commit of the io_uring entry that brought the request.

        Returns what ``_finish`` needs to go on with a handler that
        suspended, or None once the request is answered (or needs no answer).
        """
        start = time.perf_counter_ns()
        if n < _HDR:
            log.error("short request from the kernel (%d bytes): ignored", n)
            return None
        length, opcode, unique, nodeid, uid, gid, pid, extlen, _ = _unpack_header(buf)
        handler = self._handlers.get(opcode)
        end = (length if length < n else n) - 8 * extlen
        if (handler is None or end < _HDR or end - _HDR < _MIN_BODY.get(opcode, 0)
                or not self._ready and opcode != abi.INIT):
            self._refuse(opcode, unique, handler, end, reply_error)
            self.request_times.record(opcode, time.perf_counter_ns() - start)
            return None
        if self.debug:
            log.debug("request %d: %s node %d (%d bytes)", unique, OPCODE_LABELS.get(opcode, opcode), nodeid, length)
        ctx = RequestContext(uid, gid, pid)
        if unique & UNIQUE_RESEND:
            ctx.resent = True
        coro: Any = handler(nodeid, ctx, buf, view, _HDR, end)
        if self.interruptible and opcode in _INTERRUPTIBLE:
            coro = self._cancellable(unique, coro)
        try:
            step = coro.send(None)
        except StopIteration as done:
            if opcode not in _NO_REPLY:
                reply(unique, done.value)
        except Exception as e:
            self._failed(opcode, unique, ctx, e, reply, reply_error)
        except BaseException:
            coro.close()
            raise
        else:
            return coro, step, opcode, unique, ctx, start, reply, reply_error
        self.request_times.record(opcode, time.perf_counter_ns() - start)
        return None

    def _refuse(self, opcode: int, unique: int, handler: Handler | None, end: int, reply_error: ReplyError) -> None:
        """Answer a request no handler may run: malformed or before INIT (EIO), or unknown (ENOSYS)."""
        if end < _HDR:
            reply_error(unique, errno.EIO)
        elif handler is None:
            reply_error(unique, errno.ENOSYS)
        elif end - _HDR < _MIN_BODY.get(opcode, 0):
            # handlers unpack fixed structs from a buffer larger than the request: never past its end
            log.error("malformed %s request: %d bytes of body", OPCODE_LABELS.get(opcode, opcode), end - _HDR)
            if opcode not in _NO_REPLY:
                reply_error(unique, errno.EIO)
        else:
            reply_error(unique, errno.EIO)  # nothing but INIT before INIT

    async def _finish(self, coro: Any, step: Any, opcode: int, unique: int, ctx: RequestContext, start: int,
                      reply: Reply, reply_error: ReplyError) -> None:
        """Go on with a handler that suspended in ``_dispatch``, and answer its request."""
        try:
            payload = await _resume(coro, step)
        except Exception as e:
            self._failed(opcode, unique, ctx, e, reply, reply_error)
        else:
            if opcode not in _NO_REPLY:
                reply(unique, payload)
        finally:
            self.request_times.record(opcode, time.perf_counter_ns() - start)

    async def _cancellable(self, unique: int, handler: Awaitable[Any]) -> Any:
        """Run *handler* in a cancel scope an INTERRUPT for *unique* cancels (then it is answered EINTR)."""
        try:
            with trio.CancelScope() as scope:
                self._inflight[unique] = scope
                payload = await handler
        finally:
            self._inflight.pop(unique, None)
        if scope.cancelled_caught:
            raise FUSEError(errno.EINTR)
        return payload

    def _failed(self, opcode: int, unique: int, ctx: RequestContext, e: Exception, reply: Reply,
                reply_error: ReplyError) -> None:
        """Answer a request whose handler raised *e*: a ``FUSEError`` is its answer, anything else EIO."""
        if isinstance(e, FUSEError):
            if ctx.resent and e.errno == errno.ENOENT and opcode in _GONE_WHEN_DONE:
                reply(unique, None)  # the previous daemon did it before it died
            elif opcode not in _NO_REPLY:
                reply_error(unique, e.errno)
            return
        if isinstance(e, (Malformed, ValueError, IndexError)):
            log.error("malformed %s request: %s", OPCODE_LABELS.get(opcode, opcode), e)
        else:
            log.error("%s failed", OPCODE_LABELS.get(opcode, opcode), exc_info=e)
        if opcode not in _NO_REPLY:
            reply_error(unique, errno.EIO)

    # ------------------------------------------------------------------
    # replies and notifications
    # ------------------------------------------------------------------
    def _reply(self, unique: int, payload: bytes | memoryview | None) -> None:
        try:
            if not payload:
                os.write(self.fd, _pack_reply(16, 0, unique))
            elif len(payload) < _JOIN_BELOW:
                os.write(self.fd, _pack_reply(16 + len(payload), 0, unique) + payload)
            else:
                os.writev(self.fd, [_pack_reply(16 + len(payload), 0, unique), payload])
        except OSError as e:
            _unsent(e)

    def _reply_error(self, unique: int, code: int) -> None:
        try:
            os.write(self.fd, _pack_reply(16, -code, unique))
        except OSError as e:
            _unsent(e)

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
        caps = wanted_capabilities(self.readdirplus, self.uring, self.passthrough) & kernel_caps
        self.capabilities = caps
        self.proto_minor = min(minor, abi.KERNEL_MINOR_VERSION)
        log.info("FUSE %d.%d (kernel %d.%d): max_write %d, parallel dirops %s, readdirplus %s",
                 abi.KERNEL_VERSION, self.proto_minor, major, minor, self.max_write,
                 bool(caps & abi.PARALLEL_DIROPS), bool(caps & abi.DO_READDIRPLUS))
        await self.ops.init()
        # no await from here to the reply's write in _dispatch: whoever waits on ``initialized`` (the
        # supervisor's line, told a successor may take over) runs only once the kernel has the reply
        self._ready = True
        self.initialized.set()
        self.notifier.open()
        if caps & abi.OVER_IO_URING and self._nursery is not None:
            self.transport = UringTransport(self.fd, max(abi.MIN_READ_BUFFER, self.max_write), self._bufsize,
                                            self._dispatch, self._finish, lambda: self._stopping, self._idle_work,
                                            self.polling.deadline, self.after_reply.idle)
            self._nursery.start_soon(self.transport.serve)  # runs once this reply is written
        return init_reply(self.proto_minor, min(max_readahead, self.max_readahead), caps, self.max_write)

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


def _unsent(e: OSError) -> None:
    """A reply the kernel refused: ENOENT (the request was interrupted and is gone) and ENODEV (unmounted
    meanwhile) are expected; anything else is logged."""
    if e.errno not in (errno.ENOENT, errno.ENODEV):
        log.error("cannot write a reply to the kernel: %s", e)


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
