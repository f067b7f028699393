"""The blob-writing process of ``blob_writer``: batches of verified blobs in shared memory, one status each out.

Run as a script (``python -I -S <this file> <objects/> <staging/> <fd>
<daemon's pid>``): it imports only the standard library, so it starts in
milliseconds and holds no part of the daemon (no FUSE descriptor, no index,
not the store's lock).  It dies with the daemon (``PR_SET_PDEATHSIG``), so
no blob file appears after a successor's startup repair has counted them.  Each blob is
written as ``CAS.write_blob`` writes one: a staging file created, written,
renamed onto its name; an existing blob is left as it is.  Stdin's end (the
daemon gone, or done with it) ends it.

A batch is in the memory file *fd*: ``<IQ count, bytes>``, then per blob its
32-byte digest and ``<Q size>``, then the blobs' bytes one after another.
Stdin says a batch is there (``<Q bytes>``, the whole batch's length);
stdout answers a byte per blob written (1: new, 0: there already), up to
the first that failed, then 2 and that failure's ``<i errno>`` (the rest of
the batch is dropped).
"""

from __future__ import annotations

import ctypes
import mmap
import os
import signal
import struct
import sys
from collections.abc import Callable

HEADER = struct.Struct("<IQ")
BLOB = struct.Struct("<32sQ")
READY = struct.Struct("<Q")
NEW, THERE, FAILED = 1, 0, 2
#: Blobs are immutable and the daemon's alone (a cache may hold secrets baked into kernels).
BLOB_MODE = 0o400


def _read_exactly(stdin: int, n: int) -> bytes | None:
    """*n* bytes of the pipe; None at its end."""
    data = b""
    while len(data) < n:
        part = os.read(stdin, n - len(data))
        if not part:
            return None
        data += part
    return data


def write_and_rename(tmp: str, dest: str, data: bytes | bytearray | memoryview, *, exclusive: bool) -> None:
    """*data* written to a new file *tmp* (mode ``BLOB_MODE``), then renamed onto *dest*: a blob is never
    seen half-written.  On any failure (a full disk) *tmp* is removed and the error raised.  *exclusive*:
    *tmp* must not exist (a unique name); otherwise a leftover of that name is truncated.  How a blob's
    file is written where no blank was made ahead for it (``fill_and_link``), by ``CAS.write_blob`` and by
    this process alike."""
    flags = os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC | (os.O_EXCL if exclusive else os.O_TRUNC)
    fd = os.open(tmp, flags, BLOB_MODE)
    try:
        try:
            _fill(fd, data)
        finally:
            os.close(fd)
        os.rename(tmp, dest)
    except BaseException:
        try:
            os.unlink(tmp)
        except FileNotFoundError:
            pass
        raise


def _fill(fd: int, data: bytes | bytearray | memoryview) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view):]


def fill_and_link(fd: int, dest: str, data: bytes | bytearray | memoryview, *,
                  replace_via: Callable[[], str] | None) -> bool:
    """*data* written into *fd*, an empty nameless file (``O_TMPFILE``), then linked as *dest*: the blob
    appears whole, in one directory change; True when *dest* was new.  A *dest* that exists is left as
    it is, unless *replace_via* (a staging name, asked only then): the file is linked under that name
    first and renamed onto *dest*.  No stat before: the link is the check.  *fd* is closed here; a file
    never linked vanishes with it."""
    try:
        _fill(fd, data)
        # linkat(AT_EMPTY_PATH) needs CAP_DAC_READ_SEARCH; the magic link does not.  Any dst_dir_fd makes
        # CPython call linkat(AT_SYMLINK_FOLLOW), which follows it (link() would link the link itself);
        # the absolute name given ignores that fd.
        source = f"/proc/self/fd/{fd}"
        try:
            os.link(source, os.path.abspath(dest), dst_dir_fd=fd, follow_symlinks=True)
            return True
        except FileExistsError:
            if replace_via is None:
                return False
        staging = replace_via()
        os.link(source, os.path.abspath(staging), dst_dir_fd=fd, follow_symlinks=True)
        try:
            os.rename(staging, dest)
        except BaseException:
            os.unlink(staging)
            raise
        return False
    finally:
        os.close(fd)


def _write_one(objects: str, staging: str, shards: set[str], serial: int, digest: bytes, data: memoryview) -> int:
    h = digest.hex()
    dest = f"{objects}{h[:2]}/{h}"
    if os.path.exists(dest):
        return THERE
    if h[:2] not in shards:
        os.makedirs(os.path.dirname(dest), mode=0o700, exist_ok=True)
        shards.add(h[:2])
    # its own names (pid, serial): one a killed writer of the same pid left is written over
    write_and_rename(f"{staging}w{os.getpid()}-{serial}", dest, data, exclusive=False)
    return NEW


def _write_batch(objects: str, staging: str, shards: set[str], serial: int, batch: memoryview) -> bytearray:
    count, _ = HEADER.unpack_from(batch, 0)
    table = HEADER.size
    at = table + count * BLOB.size
    answer = bytearray()
    for i in range(count):
        digest, size = BLOB.unpack_from(batch, table + i * BLOB.size)
        try:
            answer.append(_write_one(objects, staging, shards, serial + i, digest, batch[at:at + size]))
        except OSError as e:
            answer.append(FAILED)
            answer += struct.pack("<i", e.errno or 0)
            break
        at += size
    return answer


def serve(objects: str, staging: str, memory: int, stdin: int, stdout: int) -> None:
    shards: set[str] = set()
    serial = 0
    mapped: mmap.mmap | None = None
    while True:
        ready = _read_exactly(stdin, READY.size)
        if ready is None:
            return
        (length,) = READY.unpack(ready)
        if mapped is None or len(mapped) < length:  # the daemon grew the memory file for a larger batch
            if mapped is not None:
                mapped.close()
            mapped = mmap.mmap(memory, os.fstat(memory).st_size, prot=mmap.PROT_READ)
        with memoryview(mapped) as view:
            answer = _write_batch(objects, staging, shards, serial, view[:length])
        serial += len(answer)
        out = memoryview(bytes(answer))
        while out:
            out = out[os.write(stdout, out):]


def _die_with(parent: int) -> None:
    """Killed when the thread that started this one ends (the daemon's main thread: the daemon)."""
    pr_set_pdeathsig = 1
    ctypes.CDLL(None, use_errno=True).prctl(pr_set_pdeathsig, signal.SIGKILL)
    if os.getppid() != parent:  # it died before that was set
        sys.exit(1)


if __name__ == "__main__":
    _die_with(int(sys.argv[4]))
    serve(sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.stdin.fileno(), sys.stdout.fileno())
