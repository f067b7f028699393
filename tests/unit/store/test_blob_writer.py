"""A prefetch's batches of blobs written by a child process: the same files, the same answers, a full
disk told as one, and nothing lost when the child dies or was never started."""

from __future__ import annotations

import errno
import logging
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from mithrilfs.store.blob_writer import BlobWriter
from mithrilfs.store.cas import CAS, hash_bytes


def _blobs(n: int, size: int) -> list[tuple[bytes, bytes]]:
    out = []
    for _ in range(n):
        data = os.urandom(size)
        out.append((hash_bytes(data), data))
    return out


def _written_by(pid: int) -> int:
    """Bytes the process *pid* has written with write(2) and its kind (``wchar``)."""
    for line in Path(f"/proc/{pid}/io").read_text().splitlines():
        if line.startswith("wchar:"):
            return int(line.split()[1])
    raise AssertionError("no wchar")


def _staging_left(cas: CAS) -> list[str]:
    return os.listdir(cas.staging)


def test_a_batch_is_written_by_the_child_as_write_blob_would(tmp_path):
    cas = CAS(tmp_path / "store")
    writer = BlobWriter(cas)
    writer.start()
    child = writer._child
    assert child is not None and child.pid != os.getpid()
    blobs = _blobs(300, 20_000) + [(hash_bytes(b""), b"")]
    new: list[bool] = []
    writer.write(blobs, new)
    assert new == [True] * len(blobs)
    assert _written_by(child.pid) >= 300 * 20_000  # the child wrote the bytes, not this process
    for digest, data in blobs:
        assert cas.read(digest) == data
        assert os.stat(cas.path(digest)).st_mode & 0o777 == 0o400
    again: list[bool] = []
    writer.write(blobs[:5] + _blobs(1, 10), again)
    assert again == [False] * 5 + [True]  # there already: left as it is; a new one is new
    assert _staging_left(cas) == []
    writer.close()
    assert child.wait(timeout=10) == 0 and writer._child is None


def test_a_batch_larger_than_the_first_shared_memory_grows_it(tmp_path):
    cas = CAS(tmp_path / "store")
    writer = BlobWriter(cas)
    writer.start()
    blobs = _blobs(12, 1 << 20)  # 12 MiB: more than the 9 MiB the memory starts with
    new: list[bool] = []
    writer.write(blobs, new)
    assert new == [True] * 12 and all(cas.read(d) == data for d, data in blobs)
    writer.close()


def test_a_full_disk_raises_enospc_after_the_blobs_that_fit(tmpfs):
    cas = CAS(Path(tmpfs("2m")) / "store")
    writer = BlobWriter(cas)
    writer.start()
    blobs = _blobs(40, 100_000)  # 4 MB for a 2 MiB disk
    new: list[bool] = []
    with pytest.raises(OSError) as raised:
        writer.write(blobs, new)
    assert raised.value.errno == errno.ENOSPC
    assert 0 < len(new) < 40 and all(new)
    for digest, data in blobs[:len(new)]:
        assert cas.read(digest) == data
    for digest, _ in blobs[len(new):]:
        assert not cas.exists(digest)
    assert _staging_left(cas) == []  # the half-written one removed
    assert writer._child is not None  # a full disk is the disk's, not the child's: it goes on
    for digest, _ in blobs[:len(new)]:
        cas.delete(digest)
    more: list[bool] = []
    writer.write(blobs[:3], more)
    assert more == [True] * 3
    writer.close()


def test_a_child_killed_between_batches_leaves_the_writes_to_this_process(tmp_path, caplog):
    cas = CAS(tmp_path / "store")
    writer = BlobWriter(cas)
    writer.start()
    child = writer._child
    assert child is not None
    first = _blobs(10, 5000)
    writer.write(first, [])
    os.kill(child.pid, signal.SIGKILL)
    child.wait(timeout=10)
    blobs = _blobs(50, 5000)
    new: list[bool] = []
    with caplog.at_level(logging.WARNING, logger="mithrilfs.store.blob_writer"):
        writer.write(blobs, new)
        writer.write(_blobs(5, 10), [])
        writer.start()  # given up on: not started again
    assert new == [True] * 50 and all(cas.read(d) == data for d, data in blobs + first)
    assert writer._child is None
    assert len([r for r in caplog.records if "blob writer process ended" in r.getMessage()]) == 1


def test_never_started_it_writes_in_this_process(tmp_path):
    cas = CAS(tmp_path / "store")
    writer = BlobWriter(cas)
    blobs = _blobs(5, 1000)
    new: list[bool] = []
    writer.write(blobs, new)
    assert new == [True] * 5 and all(cas.read(d) == data for d, data in blobs)
    writer.close()


def test_the_child_dies_with_the_process_that_started_it(tmp_path):
    """A daemon killed by -9 in the middle of a batch takes its writer with it (stdin's end alone would
    not stop a batch): no blob file appears after a successor's startup repair counted them.  The batch
    is held in the child's first create (a FIFO where its staging file goes)."""
    script = textwrap.dedent(f"""
        import os, threading, time
        from mithrilfs.store.blob_writer import BlobWriter
        from mithrilfs.store.cas import CAS
        cas = CAS({str(tmp_path / "store")!r})
        w = BlobWriter(cas)
        w.start()
        os.mkfifo(f"{{cas.staging_prefix}}w{{w._child.pid}}-0")
        threading.Thread(target=w.write, args=([(b"x" * 32, b"data")], []), daemon=True).start()
        print(w._child.pid, flush=True)
        time.sleep(600)
    """)
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    child = 0
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        deadline = time.monotonic() + 30
        while Path(f"/proc/{child}/wchan").read_text() not in ("wait_for_partner", "fifo_open"):  # in the create
            assert time.monotonic() < deadline, Path(f"/proc/{child}/wchan").read_text()
            time.sleep(0.01)
        parent.kill()
        parent.wait(timeout=10)
        deadline = time.monotonic() + 30
        while Path(f"/proc/{child}").exists() and Path(f"/proc/{child}/stat").read_text().split()[2] != "Z":
            assert time.monotonic() < deadline, "the writer outlived the process that started it"
            time.sleep(0.01)
    finally:
        parent.kill()
        parent.wait(timeout=10)
        if child and Path(f"/proc/{child}").exists():
            os.kill(child, signal.SIGKILL)
