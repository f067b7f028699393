"""Writing a batch of verified blobs in another process, so the daemon's lock is not in the way.

A prefetch writes thousands of small blobs: a create, a write, a close and
a rename each, every one a system call that drops CPython's interpreter lock
and must take it back.  In the daemon the event loop holds that lock most of
the time (naming, bookkeeping, the workload's requests), and a thread that
gives it up waits up to the switch interval (5 ms) to get it again, so a
thread writing blobs beside a busy loop takes many times as long as beside
an idle one (docs/benchmarks.md, "H3").  ``BlobWriter`` copies a batch into
a memory file it shares with a small child process (``blob_writer_child``:
the standard library only, run as a script), tells it so through a pipe and
reads one answer: the daemon drops its lock twice a batch, not five times a
blob (the batch itself goes through the shared memory, not the pipe: fewer
copies by the kernel, docs/benchmarks.md, "K").

The child is started on the daemon's main thread (``start``: it dies with
that thread, the daemon) when a prefetch begins, and ends with stdin
(``close``, when the prefetch ends) or with the daemon, kill -9 included.
Without it (not started, could not start, died) a batch is written in this
process as before; a child that cannot start or dies is said once in the
log and not tried again: nothing is lost, only the speed.  A blob the dead child wrote
before it died counts as there already (its bytes are in the store; the
budget learns them at the next ``fsck``).
"""

from __future__ import annotations

import logging
import mmap
import os
import struct
import subprocess
import sys
import threading

from mithrilfs.store import blob_writer_child
from mithrilfs.store.cas import CAS

log = logging.getLogger(__name__)

#: The shared memory's least size: a prefetch's batches are at most 8 MiB (``prefetch.BATCH_BYTES``).
MEMORY_BYTES = 9 << 20


class BlobWriter:
    """The CAS's ``write_blob`` for a batch, done by a child process (one batch at a time)."""

    def __init__(self, cas: CAS) -> None:
        self.cas = cas
        self._child: subprocess.Popen[bytes] | None = None
        #: The memory file the batches are put in, and its mapping here (grown for a larger batch).
        self._memory = -1
        self._mapped: mmap.mmap | None = None
        #: Set once the child could not be started or died: batches are written here from then on.
        self._broken = False
        self._lock = threading.Lock()

    def start(self) -> None:
        """Start the child, on the daemon's main thread (the child dies when the thread that started it
        ends).  Cheap when it runs; nothing when it cannot (batches are written here)."""
        with self._lock:
            if self._child is not None or self._broken:
                return
            try:
                self._memory = os.memfd_create("mithrilfs-blobs", os.MFD_CLOEXEC)
                self._child = subprocess.Popen(
                    [sys.executable, "-I", "-S", blob_writer_child.__file__, self.cas._objects_prefix,
                     self.cas.staging_prefix, str(self._memory), str(os.getpid())],
                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                    pass_fds=(self._memory,))
            except OSError as e:
                self._give_up(f"the blob writer process could not start ({e}): writing in the daemon")

    def write(self, blobs: list[tuple[bytes, bytes | memoryview]], new: list[bool]) -> None:
        """Write *blobs* (digest, verified bytes); *new* gets, in order, whether each was new, up to the one
        whose write failed, whose OSError (a full disk) is raised.  Blocking: from a worker thread."""
        with self._lock:
            if self._child is not None:
                try:
                    failed = self._through(blobs, new)
                except (OSError, EOFError) as e:
                    self._give_up(f"the blob writer process ended ({e}): writing in the daemon")
                else:
                    if failed is not None:  # the child's write failed (a full disk): as this process's would
                        raise OSError(failed, os.strerror(failed))
                    return
            for digest, data in blobs[len(new):]:
                new.append(self.cas.write_blob(digest, data))

    def close(self) -> None:
        """End the child (stdin closed: it exits) and free the shared memory; ``start`` starts another."""
        with self._lock:
            self._end(kill=False)

    def _give_up(self, why: str) -> None:
        if not self._broken:
            log.warning("%s", why)
        self._broken = True
        self._end(kill=True)

    def _end(self, *, kill: bool) -> None:
        child, self._child = self._child, None
        if child is not None:
            if kill:
                child.kill()
            for pipe in (child.stdin, child.stdout):
                if pipe is not None:
                    pipe.close()
            try:
                child.wait(timeout=10)
            except subprocess.TimeoutExpired:
                child.kill()
                child.wait()
        if self._mapped is not None:
            self._mapped.close()
            self._mapped = None
        if self._memory >= 0:
            os.close(self._memory)
            self._memory = -1

    def _through(self, blobs: list[tuple[bytes, bytes | memoryview]], new: list[bool]) -> int | None:
        """One batch through the child; the errno of the blob whose write failed, None when none did."""
        child = self._child
        assert child is not None and child.stdin is not None and child.stdout is not None
        table = blob_writer_child.HEADER.size + len(blobs) * blob_writer_child.BLOB.size
        length = table + sum(len(data) for _, data in blobs)
        if self._mapped is None or len(self._mapped) < length:
            if self._mapped is not None:
                self._mapped.close()
            os.ftruncate(self._memory, max(length, MEMORY_BYTES))
            self._mapped = mmap.mmap(self._memory, max(length, MEMORY_BYTES))
        mapped = self._mapped
        blob_writer_child.HEADER.pack_into(mapped, 0, len(blobs), length)
        at = table
        for i, (digest, data) in enumerate(blobs):  # copies under the lock: no system call per blob
            blob_writer_child.BLOB.pack_into(mapped, blob_writer_child.HEADER.size + i * blob_writer_child.BLOB.size,
                                             digest, len(data))
            mapped[at:at + len(data)] = data
            at += len(data)
        os.write(child.stdin.fileno(), blob_writer_child.READY.pack(length))
        answer = b""
        while True:  # one read, as a rule: the child answers a batch in one write
            failed = answer.find(blob_writer_child.FAILED)
            if len(answer) >= (len(blobs) if failed < 0 else failed + 5):
                break
            part = os.read(child.stdout.fileno(), len(blobs) + 5 - len(answer))
            if not part:
                raise EOFError("its answer was cut")
            answer += part
        for status in answer[:len(blobs)]:
            if status == blob_writer_child.FAILED:
                break
            new.append(status == blob_writer_child.NEW)
        failed = answer.find(blob_writer_child.FAILED)
        if 0 <= failed < len(blobs) and failed == len(new):
            return int(struct.unpack_from("<i", answer, failed + 1)[0])
        return None
