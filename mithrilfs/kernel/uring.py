"""FUSE over io_uring: the ring, its entries, and the two commands the kernel takes on /dev/fuse.

The kernel (``CONFIG_FUSE_IO_URING``, module parameter ``enable_uring``)
offers ``FUSE_OVER_IO_URING`` at INIT when it may serve requests this way.
The daemon then keeps, for every possible CPU (a *queue*), entries of its
own: a header buffer (``struct fuse_uring_req_header``: the in/out header,
the opcode's fixed argument, and ``struct fuse_uring_ent_in_out``) and a
payload buffer at least as large as the connection's largest argument.
Each entry is handed to the kernel once with ``FUSE_IO_URING_CMD_REGISTER``
(an ``IORING_OP_URING_CMD`` SQE in a ring set up with ``IORING_SETUP_SQE128``
and ``IORING_SETUP_COOP_TASKRUN``,
``struct fuse_uring_cmd_req`` in its command area, an iovec of the two
buffers); the kernel uses the ring only once every queue has an entry, and
from then on a request made on CPU *q* completes one of queue *q*'s SQEs.
The answer goes back, and the entry waits for the next request, with one
``FUSE_IO_URING_CMD_COMMIT_AND_FETCH`` SQE.  INTERRUPT, FORGET and
notifications keep travelling through /dev/fuse.

A request arrives split: the in-header, the opcode's fixed argument in the
header buffer, the rest in the payload buffer (``payload_sz`` bytes); the
fixed argument's size is the header's length less the other two.
``Entry.request`` lays it out as /dev/fuse would, so the same handlers serve
both.  Pure Python: ``io_uring_setup``/``io_uring_enter`` by ``syscall(2)``
through ctypes and the rings through ``mmap``.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import mmap
import os
import struct
from collections.abc import Iterator

from . import abi

_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)
_libc.syscall.restype = ctypes.c_long

#: x86_64 and aarch64 share these numbers (the io_uring calls came after the tables were unified).
SYS_IO_URING_SETUP = 425
SYS_IO_URING_ENTER = 426
IORING_SETUP_SQE128 = 1 << 10
#: Task work (how the kernel hands a FUSE request to its entry) waits for the thread's next system call instead
#: of an interrupt to its CPU: the worker polls with system calls after each answer, and a sleeping thread is
#: woken all the same (docs/benchmarks.md, "N-uring").  Every kernel with FUSE over io_uring (6.14) has it (5.19).
IORING_SETUP_COOP_TASKRUN = 1 << 8
IORING_FEAT_SINGLE_MMAP = 1 << 0
IORING_ENTER_GETEVENTS = 1 << 0
IORING_OFF_SQ_RING = 0
IORING_OFF_CQ_RING = 0x8000000
IORING_OFF_SQES = 0x10000000
IORING_OP_URING_CMD = 46
SQE_SIZE = 128
CQE_SIZE = 16

FUSE_IO_URING_CMD_REGISTER = 1
FUSE_IO_URING_CMD_COMMIT_AND_FETCH = 2
#: struct fuse_uring_req_header: in_out[128], op_in[128], ring_ent_in_out (flags, commit_id, payload_sz, pad, rsvd).
HEADER_SIZE = 128 + 128 + 32
_OP_IN = 128
#: The in-header's size (``fuse_in_header``), before the opcode's argument in both layouts.
_IN = abi.IN_HEADER.size
_ENT_IN_OUT = 256
ENT_IN_OUT = struct.Struct("<QQIIQ")
#: The module parameter that lets the kernel offer FUSE_OVER_IO_URING.
ENABLE_PARAMETER = "/sys/module/fuse/parameters/enable_uring"

_PARAMS = struct.Struct("<IIIIII I III" + "IIIIIIIIQ" + "IIIIIIIIQ")
# sqe: opcode flags ioprio fd | cmd_op pad | addr | len rw_flags | user_data | buf_index personality splice_fd_in
_SQE_HEAD = struct.Struct("<BBHiIIQIIQHHi")
_CMD_REQ = struct.Struct("<QQH6x")
_CQE = struct.Struct("<QiI")


class UringError(Exception):
    """io_uring or FUSE over io_uring is not available here (said in one line)."""


def possible_cpus() -> int:
    """How many queues the kernel expects: one per possible CPU (``num_possible_cpus``)."""
    try:
        with open("/sys/devices/system/cpu/possible") as f:
            text = f.read().strip()
    except OSError:
        return os.cpu_count() or 1
    count = 0
    for part in text.split(","):
        lo, _, hi = part.partition("-")
        count += int(hi or lo) - int(lo) + 1
    return count


def _syscall(*args: int) -> int:
    r = _libc.syscall(*[ctypes.c_long(a) for a in args])
    if r < 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))
    return int(r)


class Ring:
    """One io_uring with 128-byte SQEs: put SQEs, submit them, wait for and reap CQEs."""

    def __init__(self, entries: int) -> None:
        params = bytearray(_PARAMS.size)
        struct.pack_into("<I", params, 8, IORING_SETUP_SQE128 | IORING_SETUP_COOP_TASKRUN)
        pbuf = (ctypes.c_char * len(params)).from_buffer(params)
        try:
            self.fd = _syscall(SYS_IO_URING_SETUP, entries, ctypes.addressof(pbuf))
        except OSError as e:
            raise UringError(f"io_uring_setup failed: {e.strerror}") from None
        del pbuf
        p = _PARAMS.unpack(params)
        sq_entries, cq_entries, features = p[0], p[1], p[5]
        (sq_head, sq_tail, sq_mask, _, _, _, sq_array, _, _) = p[10:19]
        (cq_head, cq_tail, cq_mask, _, _, cqes, _, _, _) = p[19:28]
        if not features & IORING_FEAT_SINGLE_MMAP:
            os.close(self.fd)
            raise UringError("this kernel's io_uring lacks IORING_FEAT_SINGLE_MMAP")
        size = max(sq_array + sq_entries * 4, cqes + cq_entries * CQE_SIZE)
        self._rings = mmap.mmap(self.fd, size, mmap.MAP_SHARED | mmap.MAP_POPULATE,
                                mmap.PROT_READ | mmap.PROT_WRITE, offset=IORING_OFF_SQ_RING)
        self._sqes = mmap.mmap(self.fd, sq_entries * SQE_SIZE, mmap.MAP_SHARED | mmap.MAP_POPULATE,
                               mmap.PROT_READ | mmap.PROT_WRITE, offset=IORING_OFF_SQES)
        self._rv = memoryview(self._rings).cast("I")
        self._sq_head, self._sq_tail, self._sq_mask = sq_head // 4, sq_tail // 4, self._rv[sq_mask // 4]
        self._cq_head, self._cq_tail, self._cq_mask = cq_head // 4, cq_tail // 4, self._rv[cq_mask // 4]
        self._sq_array = sq_array // 4
        self._cqes = cqes
        self._pending = 0

    def put_uring_cmd(self, fd: int, cmd_op: int, user_data: int, cmd: bytes, addr: int = 0, length: int = 0) -> None:
        """Queue an IORING_OP_URING_CMD SQE (submitted at the next ``submit_and_wait``)."""
        tail = self._rv[self._sq_tail]
        if tail - self._rv[self._sq_head] > self._sq_mask:
            raise UringError("the submission queue is full")
        index = tail & self._sq_mask
        off = index * SQE_SIZE
        self._sqes[off:off + SQE_SIZE] = bytes(SQE_SIZE)
        _SQE_HEAD.pack_into(self._sqes, off, IORING_OP_URING_CMD, 0, 0, fd, cmd_op, 0, addr, length, 0, user_data,
                            0, 0, 0)
        self._sqes[off + 48:off + 48 + len(cmd)] = cmd
        self._rv[self._sq_array + index] = index
        self._rv[self._sq_tail] = tail + 1
        self._pending += 1

    def submit_and_wait(self, wait: int) -> None:
        """Submit what is queued and wait until at least *wait* completions are there."""
        n, self._pending = self._pending, 0
        while True:
            try:
                _syscall(SYS_IO_URING_ENTER, self.fd, n, wait, IORING_ENTER_GETEVENTS if wait else 0, 0, 0)
                return
            except InterruptedError:
                n = 0

    def has_completions(self) -> bool:
        """Whether a completion is there to reap now."""
        return self._rv[self._cq_head] != self._rv[self._cq_tail]

    def completions(self) -> Iterator[tuple[int, int]]:
        """(user_data, result) of each completion there now; each is consumed as it is yielded."""
        rv = self._rv
        head = rv[self._cq_head]
        while head != rv[self._cq_tail]:
            user_data, res, _ = _CQE.unpack_from(self._rings, self._cqes + (head & self._cq_mask) * CQE_SIZE)
            head += 1
            rv[self._cq_head] = head
            yield user_data, res

    def close(self) -> None:
        self._rv.release()
        self._rings.close()
        self._sqes.close()
        os.close(self.fd)


class Entry:
    """One ring entry of one queue: its header and payload buffers, registered with the kernel."""

    def __init__(self, qid: int, payload_size: int) -> None:
        self.qid = qid
        self.header = bytearray(HEADER_SIZE)
        self.payload = bytearray(payload_size)
        self._hbuf = (ctypes.c_char * HEADER_SIZE).from_buffer(self.header)
        self._pbuf = (ctypes.c_char * payload_size).from_buffer(self.payload)
        self._iov = (ctypes.c_uint64 * 4)(ctypes.addressof(self._hbuf), HEADER_SIZE,
                                          ctypes.addressof(self._pbuf), payload_size)

    def register(self, ring: Ring, fd: int, user_data: int) -> None:
        ring.put_uring_cmd(fd, FUSE_IO_URING_CMD_REGISTER, user_data, _CMD_REQ.pack(0, 0, self.qid),
                           ctypes.addressof(self._iov), 2)

    def request(self, buf: bytearray) -> int:
        """Lay the request this entry holds out in *buf* as /dev/fuse would; its length."""
        h = self.header
        _, _, payload_sz, _, _ = ENT_IN_OUT.unpack_from(h, _ENT_IN_OUT)
        length = abi.IN_HEADER.unpack_from(h, 0)[0]
        op_size = max(0, min(length - _IN - payload_sz, 128))
        buf[0:_IN] = h[0:_IN]
        buf[_IN:_IN + op_size] = h[_OP_IN:_OP_IN + op_size]
        end = _IN + op_size + payload_sz
        buf[_IN + op_size:end] = self.payload[:payload_sz]
        struct.pack_into("<I", buf, 0, end)  # the in-header's length: the request as laid out here
        return end

    def commit(self, ring: Ring, fd: int, user_data: int, unique: int, error: int, payload: bytes | memoryview | None,
               ) -> None:
        """Put the answer in this entry's buffers and queue its COMMIT_AND_FETCH."""
        size = len(payload) if payload else 0
        if payload:
            self.payload[:size] = payload
        abi.OUT_HEADER.pack_into(self.header, 0, abi.OUT_HEADER.size + size, error, unique)
        ENT_IN_OUT.pack_into(self.header, _ENT_IN_OUT, 0, 0, size, 0, 0)
        ring.put_uring_cmd(fd, FUSE_IO_URING_CMD_COMMIT_AND_FETCH, user_data, _CMD_REQ.pack(0, unique, self.qid))
