"""The protocol layer alone: the session's answers to requests no kernel would send.

The real kernel never sends a malformed request, so this drives
``kernel.Session`` over a SEQPACKET socket pair (one message per read, like
/dev/fuse) with hand-made requests in the ``linux/fuse.h`` layout; every
behaviour of the mounted filesystem is tested through real mounts elsewhere.
"""

from __future__ import annotations

import errno
import os
import select
import socket
import stat

import trio

from mithrilfs.kernel import abi
from mithrilfs.kernel.after_reply import AfterReply
from mithrilfs.kernel.api import EntryAttributes, FUSEError, Operations
from mithrilfs.kernel.negotiate import MAX_WRITE, max_pages_limit
from mithrilfs.kernel.session import Session


class _Root(Operations):
    async def getattr(self, inode, ctx):
        if inode != 1:
            raise FUSEError(errno.ENOENT)
        a = EntryAttributes()
        a.st_ino, a.st_mode, a.st_nlink, a.attr_timeout = 1, stat.S_IFDIR | 0o755, 2, 1.5
        return a

    async def readlink(self, inode, ctx):
        raise RuntimeError("a bug in a handler")


def _request(opcode: int, unique: int, body: bytes = b"", nodeid: int = 1, length: int | None = None) -> bytes:
    size = abi.IN_HEADER.size + len(body)
    return abi.IN_HEADER.pack(length if length is not None else size, opcode, unique, nodeid, 0, 0, 1, 0, 0) + body


def test_bad_requests_get_errors_and_the_loop_goes_on():
    ours, kernel_side = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    session = Session(ours.fileno(), _Root())
    replies: list[tuple[int, int, bytes]] = []

    async def ask(message: bytes, *, expect_reply: bool = True) -> None:
        kernel_side.send(message)
        if expect_reply:
            with trio.fail_after(5):
                data = await trio.to_thread.run_sync(kernel_side.recv, 1 << 16)
            length, error, unique = abi.OUT_HEADER.unpack_from(data)
            assert length == len(data)
            replies.append((unique, error, data[abi.OUT_HEADER.size:]))

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(session.serve)
            # nothing but INIT is served before INIT
            await ask(_request(abi.GETATTR, 1, abi.GETATTR_IN.pack(0, 0, 0)))
            init = abi.INIT_IN.pack(7, 45, 1 << 20, abi.PARALLEL_DIROPS | abi.INIT_EXT | abi.MAX_PAGES, 0)
            await ask(_request(abi.INIT, 2, init + b"\0" * 44))
            await ask(_request(abi.LOOKUP, 3, b"name-without-its-nul"))  # malformed: EIO
            await ask(_request(4242, 4))  # unknown opcode: ENOSYS
            await ask(_request(abi.SETATTR, 5, b"\0" * 8))  # body too short for its struct: EIO
            await ask(_request(abi.GETATTR, 6, length=12))  # length field shorter than a header: EIO
            await ask(b"\x01\x02\x03", expect_reply=False)  # not even a header: ignored
            await ask(_request(abi.READLINK, 7))  # the handler raises: EIO
            await ask(_request(abi.FORGET, 8, abi.FORGET_IN.pack(1)), expect_reply=False)  # no reply, by protocol
            await ask(_request(abi.GETATTR, 9, abi.GETATTR_IN.pack(0, 0, 0)))  # and the loop still answers
            kernel_side.close()  # end of file: the session ends

    trio.run(main)
    session.close()
    ours.close()
    by_unique = {u: (err, body) for u, err, body in replies}
    assert by_unique[1][0] == -errno.EIO
    err, body = by_unique[2]
    major, minor, _, flags, *_rest = abi.INIT_OUT.unpack(body)
    assert err == 0 and (major, minor) == (7, 45) and flags & abi.PARALLEL_DIROPS
    assert session.capabilities & abi.PARALLEL_DIROPS and not session.capabilities & abi.DO_READDIRPLUS
    assert by_unique[3][0] == -errno.EIO
    assert by_unique[4][0] == -errno.ENOSYS
    assert by_unique[5][0] == -errno.EIO
    assert by_unique[6][0] == -errno.EIO
    assert by_unique[7][0] == -errno.EIO
    err, body = by_unique[9]
    assert err == 0
    attr_valid, attr_nsec, _, ino, *_fields = abi.ATTR_OUT.unpack(body)
    assert (attr_valid, attr_nsec, ino) == (1, 500_000_000, 1)
    assert sorted(by_unique) == [1, 2, 3, 4, 5, 6, 7, 9]


def test_a_kernel_older_than_7_31_is_refused_in_one_line():
    ours, kernel_side = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    session = Session(ours.fileno(), _Root())

    async def main() -> None:
        kernel_side.send(_request(abi.INIT, 1, abi.INIT_IN.pack(7, 26, 1 << 17, 0, 0)))
        with trio.fail_after(5):
            await session.serve()

    try:
        trio.run(main)
    except Exception as e:  # the ProtocolError the daemon turns into its one-line message
        assert "7.31" in str(e) and "7.26" in str(e)
    else:
        raise AssertionError("an old kernel was served")
    error = abi.OUT_HEADER.unpack_from(kernel_side.recv(1 << 16))[1]
    assert error == -errno.EPROTO
    session.close()
    ours.close()
    kernel_side.close()


class _Names(Operations):
    """A root with one directory entry, ``there``, which MKDIR, CREATE and UNLINK find as a dead daemon left it."""

    def __init__(self) -> None:
        self.lookups = 0

    def _entry(self, mode: int) -> EntryAttributes:
        a = EntryAttributes()
        a.st_ino, a.st_mode, a.st_nlink = 2, mode, 1
        return a

    async def lookup(self, parent_inode, name, ctx):
        if name != b"there":
            raise FUSEError(errno.ENOENT)
        self.lookups += 1
        return self._entry(stat.S_IFDIR | 0o755)

    async def mkdir(self, parent_inode, name, mode, ctx):
        raise FUSEError(errno.EEXIST)

    async def create(self, parent_inode, name, mode, flags, ctx):
        raise FUSEError(errno.EEXIST)

    async def unlink(self, parent_inode, name, ctx):
        raise FUSEError(errno.ENOENT)


def test_a_successor_asks_for_a_resend_first_and_answers_resent_requests_it_finds_done():
    """``adopt``: no INIT, NOTIFY_RESEND before anything else; a resent request (bit 63 of its unique id)
    whose work the dead daemon had done is answered as done, with the unique id echoed; a fresh one is not."""
    from mithrilfs.kernel.session import UNIQUE_RESEND, SessionParameters

    ours, kernel_side = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    ops = _Names()
    session = Session(ours.fileno(), ops)
    replies: dict[int, tuple[int, bytes]] = {}
    resent = UNIQUE_RESEND

    async def ask(message: bytes) -> None:
        kernel_side.send(message)
        with trio.fail_after(5):
            data = await trio.to_thread.run_sync(kernel_side.recv, 1 << 16)
        _, error, unique = abi.OUT_HEADER.unpack_from(data)
        replies[unique] = (error, data[abi.OUT_HEADER.size:])

    async def main() -> None:
        await session.adopt(SessionParameters(45, abi.PARALLEL_DIROPS, 1 << 17))
        first = kernel_side.recv(1 << 16)
        assert first == abi.OUT_HEADER.pack(16, abi.NOTIFY_RESEND, 0)
        async with trio.open_nursery() as nursery:
            nursery.start_soon(session.serve)
            mkdir = abi.MKDIR_IN.pack(0o755, 0o022) + b"there\0"
            await ask(_request(abi.MKDIR, resent | 1, mkdir))
            await ask(_request(abi.MKDIR, 2, mkdir))
            create = abi.CREATE_IN.pack(os.O_WRONLY | os.O_CREAT, 0o644, 0o022, 0) + b"there\0"
            await ask(_request(abi.CREATE, resent | 3, create))
            await ask(_request(abi.UNLINK, resent | 4, b"gone\0"))
            await ask(_request(abi.UNLINK, 5, b"gone\0"))
            await ask(_request(abi.GETATTR, 6, abi.GETATTR_IN.pack(0, 0, 0)))  # served: no INIT was needed
            kernel_side.close()

    trio.run(main)
    session.close()
    ours.close()
    err, body = replies[resent | 1]
    assert err == 0 and abi.ENTRY_OUT.unpack_from(body)[0] == 2  # the directory the dead daemon made
    assert replies[2][0] == -errno.EEXIST
    err, body = replies[resent | 3]
    assert err == 0 and len(body) == abi.ENTRY_OUT.size + abi.OPEN_OUT.size
    assert replies[resent | 4] == (0, b"")
    assert replies[5][0] == -errno.ENOENT
    assert replies[6][0] != -errno.EIO
    assert ops.lookups == 2


class _Deferring(_Names):
    """``there`` looked up leaves two jobs for after the reply: one that fails, one that records what it saw."""

    def __init__(self, after: AfterReply, kernel_side: socket.socket) -> None:
        super().__init__()
        self.after = after
        self.kernel_side = kernel_side
        self.seen: list[bool] = []

    async def lookup(self, parent_inode, name, ctx):
        entry = await super().lookup(parent_inode, name, ctx)

        def failing() -> None:
            raise RuntimeError("a bug in a job")

        def recording() -> None:  # is the reply already there for the kernel to read?
            self.seen.append(bool(select.select([self.kernel_side], [], [], 0)[0]))

        self.after.defer(failing)
        self.after.defer(recording)
        return entry


def test_work_left_for_after_the_reply_runs_after_it_and_a_failing_job_ends_nothing(caplog):
    """``AfterReply``: a job a handler defers runs once its reply is written (the kernel can already read
    it), is counted as AFTER_REPLY, and one that raises is logged while the next job and request go on."""
    ours, kernel_side = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    after = AfterReply()
    ops = _Deferring(after, kernel_side)
    session = Session(ours.fileno(), ops, after_reply=after)
    replies: dict[int, int] = {}

    async def ask(message: bytes) -> None:
        kernel_side.send(message)
        with trio.fail_after(5):
            data = await trio.to_thread.run_sync(kernel_side.recv, 1 << 16)
        _, error, unique = abi.OUT_HEADER.unpack_from(data)
        replies[unique] = error

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(session.serve)
            await ask(_request(abi.INIT, 1, abi.INIT_IN.pack(7, 45, 1 << 20, abi.INIT_EXT, 0) + b"\0" * 44))
            for unique in (2, 3):
                kernel_side.send(_request(abi.LOOKUP, unique, b"there\0"))
                with trio.fail_after(5):  # nobody reads the reply until the jobs have run
                    while len(ops.seen) < unique - 1:
                        await trio.sleep(0.01)
                replies[unique] = abi.OUT_HEADER.unpack_from(kernel_side.recv(1 << 16))[1]
            kernel_side.close()

    trio.run(main)
    session.close()
    ours.close()
    assert replies == {1: 0, 2: 0, 3: 0}
    assert ops.seen == [True, True]  # each ran with its lookup's reply already written
    assert sum("a bug in a job" in r.getMessage() or "a bug in a job" in str(r.exc_info) for r in caplog.records) == 2
    assert session.request_times.by_name()["AFTER_REPLY"]["count"] == 4


class _Ordered(_Root):
    """Every request and job noted in the order they ran; a LOOKUP leaves a job for after its reply."""

    def __init__(self, after: AfterReply) -> None:
        self.after = after
        self.order: list[str] = []

    async def lookup(self, parent_inode, name, ctx):
        self.order.append("lookup")
        self.after.defer(lambda: self.order.append("job"))
        a = EntryAttributes()
        a.st_ino, a.st_mode, a.st_nlink = 2, stat.S_IFREG | 0o644, 1
        return a

    async def getattr(self, inode, ctx):
        self.order.append(f"getattr {inode}")
        return await super().getattr(1, ctx)


def test_a_request_already_waiting_goes_before_the_jobs_but_only_one():
    """A LOOKUP and two GETATTRs queued at once: the first GETATTR was waiting when the LOOKUP's reply went,
    so it goes first; the job runs before the second is read (a client on the daemon's CPU always has its
    next request queued by then, and jobs waiting for an idle moment would come after their READ)."""
    ours, kernel_side = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    after = AfterReply()
    ops = _Ordered(after)
    session = Session(ours.fileno(), ops, after_reply=after)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(session.serve)
            kernel_side.send(_request(abi.INIT, 1, abi.INIT_IN.pack(7, 45, 1 << 20, abi.INIT_EXT, 0) + b"\0" * 44))
            with trio.fail_after(5):
                await trio.to_thread.run_sync(kernel_side.recv, 1 << 16)
            # all three queued before the session (this same trio thread) reads any of them
            kernel_side.send(_request(abi.LOOKUP, 2, b"file\0"))
            kernel_side.send(_request(abi.GETATTR, 3, abi.GETATTR_IN.pack(0, 0, 0), nodeid=3))
            kernel_side.send(_request(abi.GETATTR, 4, abi.GETATTR_IN.pack(0, 0, 0), nodeid=4))
            with trio.fail_after(5):
                for _ in range(3):
                    await trio.to_thread.run_sync(kernel_side.recv, 1 << 16)
            kernel_side.close()

    trio.run(main)
    session.close()
    ours.close()
    assert ops.order == ["lookup", "getattr 3", "job", "getattr 4"]


def test_the_session_polls_for_a_next_request_only_when_told_it_may():
    """``polls``: after a reply the session polls the device a moment for the next request (a client's
    next one comes within microseconds), except while the daemon says no (a prefetch streaming on the
    same cores): then it sleeps in epoll at once, and answers as before."""
    polling = {"now": True}
    ours, kernel_side = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    session = Session(ours.fileno(), _Root(), polls=lambda: polling["now"])
    seen: list[int] = []

    async def ask(unique: int) -> None:
        kernel_side.send(_request(abi.GETATTR, unique, abi.GETATTR_IN.pack(0, 0, 0)))
        with trio.fail_after(5):
            data = await trio.to_thread.run_sync(kernel_side.recv, 1 << 16)
        assert abi.OUT_HEADER.unpack_from(data)[1:] == (0, unique)

    async def main() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(session.serve)
            init = abi.INIT_IN.pack(7, 45, 1 << 20, abi.INIT_EXT | abi.MAX_PAGES, 0)
            kernel_side.send(_request(abi.INIT, 1, init + b"\0" * 44))
            await trio.to_thread.run_sync(kernel_side.recv, 1 << 16)
            for unique in range(2, 7):
                await ask(unique)
            seen.append(session.polling.polled)
            polling["now"] = False
            for unique in range(7, 17):
                await ask(unique)
            seen.append(session.polling.polled)
            kernel_side.close()

    trio.run(main)
    session.close()
    ours.close()
    assert seen[0] >= 5  # it polled before each request
    # told not to: ten requests answered, none polled for (but the wait that began before it was told)
    assert seen[1] <= seen[0] + 1


def test_writes_are_asked_in_2_MiB_and_status_says_when_the_kernel_allows_less(tmp_path):
    limit = tmp_path / "max_pages_limit"
    limit.write_text("256\n")
    assert max_pages_limit(str(limit)) == 256
    assert max_pages_limit(str(tmp_path / "absent")) == 256  # kernels before the setting: 256 pages
    limit.write_text("1024\n")
    assert max_pages_limit(str(limit)) == 1024
    ours, kernel_side = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    with ours, kernel_side:
        assert "pieces" not in Session(ours.fileno(), _Root(), max_write=MAX_WRITE).describe_transport()
        assert "writes in 1024 KiB pieces" in Session(ours.fileno(), _Root(), max_write=1 << 20).describe_transport()
