"""Warm start at the protocol floor (issue 17): small files pushed into the page cache at lookup.

The daemon puts a small file's verified content into the kernel's page
cache right after the kernel first looks it up (NOTIFY_STORE), so the
file's read needs no READ.  A push carries the file's old content, so it
must never land over newer bytes, nor move the size the kernel shows:
writers racing a push are checked here, from another process, through the
kernel.
"""

from __future__ import annotations

import errno
import os
import random
import time

import pytest
from conftest import Mount, MountFactory, wait_for, write_committed

FILES = 24


def _drop_kernel_caches() -> None:
    """Make the kernel forget the inodes it does not use (FORGET): the next lookup of each is a first one."""
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("2")


def _requests(m: Mount, op: str) -> int:
    time.sleep(0.01)  # past the control file's freshness (FRESH_SECONDS): a new production
    return m.stats()["requests"].get(op, {}).get("count", 0)


def test_looked_up_files_are_read_without_a_read_request(mount_factory: MountFactory):
    m = mount_factory()
    rnd = random.Random(7)
    contents = {f"k{i}.ptx": rnd.randbytes(rnd.randrange(1, 70_000)) for i in range(FILES)}
    (m.mountpoint / "w").mkdir()
    for name, data in contents.items():
        write_committed(m.mountpoint / "w" / name, data)
    m.remount()  # a warm start: the kernel holds nothing, the daemon has verified nothing
    for name in contents:
        (m.mountpoint / "w" / name).stat()  # the lookup: the push follows it
    wait_for(lambda: m.stats()["pushed_files"] == FILES, 10, "every file to be pushed")
    for name, data in contents.items():
        assert (m.mountpoint / "w" / name).read_bytes() == data
        assert (m.mountpoint / "w" / name).stat().st_size == len(data)
    s = m.stats()
    assert s["by_dir"]["w"]["reads"] == 0  # no READ reached the daemon for these files
    assert s["push_missed"] == 0


def test_a_push_never_lands_over_newer_content_or_size(mount_factory: MountFactory):
    """Open for writing right after the kernel's first lookup, while the push may be on its way: what a
    read shows afterwards is always what was written, at the size written."""
    m = mount_factory()
    f = m.mountpoint / "f"
    old = os.urandom(60_000)
    for i in range(60):
        write_committed(f, old)
        _drop_kernel_caches()
        new = os.urandom(random.randrange(1, 60_000))
        if i % 2:  # O_TRUNC: the size goes down first (SETATTR), then the write
            with open(f, "wb") as out:
                out.write(new)
            expected = new
        else:  # in place: the first bytes change, the size stays
            with open(f, "r+b") as out:
                out.write(new)
            expected = new + old[len(new):]
        assert os.stat(f).st_size == len(expected), i
        assert f.read_bytes() == expected, i
    _drop_kernel_caches()
    assert f.read_bytes() == expected  # and what the daemon kept is the same


def test_a_corrupt_blob_is_not_pushed(mount_factory: MountFactory):
    m = mount_factory()
    write_committed(m.mountpoint / "victim.so", b"original kernel bytes")
    m.umount()
    from mithrilfs.store.cas import hash_bytes

    digest = hash_bytes(b"original kernel bytes").hex()
    blob = m.store / "objects" / digest[:2] / digest
    os.chmod(blob, 0o644)
    blob.write_bytes(b"evil kernel bytes!!!!")  # same length, wrong content
    m.mount()
    (m.mountpoint / "victim.so").stat()
    time.sleep(0.2)
    assert m.stats()["pushed_files"] == 0
    with pytest.raises(OSError) as e:
        (m.mountpoint / "victim.so").read_bytes()
    assert e.value.errno == errno.EIO


def test_requests_are_counted_by_opcode(mount_factory: MountFactory):
    """``stats`` shows every request the daemon answered by opcode (the IOCTL of each Python open too)."""
    m = mount_factory()
    write_committed(m.mountpoint / "a", b"x" * 100)
    before = _requests(m, "IOCTL")
    for _ in range(5):
        with open(m.mountpoint / "a", "rb") as f:  # Python < 3.14 asks isatty(): TCGETS reaches the daemon
            f.read()
    assert _requests(m, "IOCTL") - before >= 5
    assert m.stats()["requests"]["LOOKUP"]["seconds"] > 0
