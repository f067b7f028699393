"""Warm start at the protocol floor (issue 17): small files pushed into the page cache at lookup.

With ``--push-on-lookup`` the daemon puts a small file's verified content
into the kernel's page cache right after the kernel first looks it up
(NOTIFY_STORE), so the file's read needs no READ.  Without it nothing is
pushed.
"""

from __future__ import annotations

import errno
import os
import random
import time

import pytest
from conftest import Mount, MountFactory, wait_for, write_committed

FILES = 24


def _requests(m: Mount, op: str) -> int:
    time.sleep(0.01)  # past the control file's freshness (FRESH_SECONDS): a new production
    return m.stats()["requests"].get(op, {}).get("count", 0)


def test_looked_up_files_are_read_without_a_read_request(mount_factory: MountFactory):
    m = mount_factory("m", "--push-on-lookup")
    rnd = random.Random(7)
    contents = {f"k{i}.ptx": rnd.randbytes(rnd.randrange(1, 70_000)) for i in range(FILES)}
    (m.mountpoint / "w").mkdir()
    for name, data in contents.items():
        write_committed(m.mountpoint / "w" / name, data)
    m.remount()  # a warm start: the kernel holds nothing, the daemon has verified nothing
    for name in contents:
        (m.mountpoint / "w" / name).stat()  # the lookup: the push follows it
    wait_for(lambda: m.stats()["pushed_files"] + m.stats()["push_missed"] == FILES, 10, "every push to be tried")
    for name, data in contents.items():
        assert (m.mountpoint / "w" / name).read_bytes() == data
        assert (m.mountpoint / "w" / name).stat().st_size == len(data)
    s = m.stats()
    # a READ reached the daemon only for a file whose push the kernel refused (it had not made the inode
    # after several tries: a heavily loaded machine)
    assert s["pushed_files"] >= FILES // 2
    assert s["by_dir"]["w"]["reads"] == s["push_missed"]


def test_without_the_option_nothing_is_pushed(mount_factory: MountFactory):
    """Pushing is opt-in (``--push-on-lookup``): a file written in place right after its first lookup could
    otherwise have the push land over the new bytes (docs/design.md)."""
    m = mount_factory()
    (m.mountpoint / "w").mkdir()
    write_committed(m.mountpoint / "w" / "k", b"x" * 5000)
    m.remount()
    (m.mountpoint / "w" / "k").stat()
    assert (m.mountpoint / "w" / "k").read_bytes() == b"x" * 5000
    s = m.stats()
    assert s["pushed_files"] == 0 and s["by_dir"]["w"]["reads"] == 1


def test_a_corrupt_blob_is_not_pushed(mount_factory: MountFactory):
    m = mount_factory("m", "--push-on-lookup")
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
