"""Warm start at the protocol floor (issue 17): work done before the client asks for it.

By default, a small file's blob is read and verified right after the
LOOKUP's reply is written, and its READ is answered from those bytes
(``cache.readahead``).  With ``--push-on-lookup`` the daemon puts a small
file's verified content into the kernel's page cache right after the
kernel first looks it up (NOTIFY_STORE), so the file's read needs no READ.
Without it nothing is pushed.
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


@pytest.mark.parametrize("options", [(), ("--push-on-lookup",)], ids=["read-ahead", "push"])
def test_a_corrupt_blob_is_neither_read_ahead_nor_pushed_and_its_read_fails(mount_factory: MountFactory,
                                                                            options: tuple[str, ...]):
    m = mount_factory("m", *options)
    write_committed(m.mountpoint / "victim.so", b"original kernel bytes")
    m.umount()
    from mithrilfs.store.cas import hash_bytes

    digest = hash_bytes(b"original kernel bytes").hex()
    blob = m.store / "objects" / digest[:2] / digest
    os.chmod(blob, 0o644)
    blob.write_bytes(b"evil kernel bytes!!!!")  # same length, wrong content
    m.mount()
    (m.mountpoint / "victim.so").stat()  # the lookup: the push, or the read-ahead after it, finds the blob wrong
    if options:
        time.sleep(0.2)
    else:
        wait_for(lambda: m.stats()["requests"].get("AFTER_REPLY", {}).get("count", 0) >= 1, 10, "the read-ahead")
    with pytest.raises(OSError) as e:
        (m.mountpoint / "victim.so").read_bytes()
    assert e.value.errno == errno.EIO
    time.sleep(0.01)  # past the control file's freshness (FRESH_SECONDS): not the production wait_for read
    s = m.stats()
    assert s["pushed_files"] == 0 and s["read_ahead"] == 0 and s["corrupt_blobs"] == 1


def test_a_small_files_blob_is_read_ahead_after_its_lookup_and_serves_its_read(mount_factory: MountFactory):
    """The default mount after a remount: each file's blob is hashed once, between the LOOKUP's reply and
    the READ, and the READ is answered from those verified bytes, exactly the file's."""
    m = mount_factory()
    rnd = random.Random(11)
    contents = {f"k{i}.cubin": rnd.randbytes(rnd.randrange(1, 70_000)) for i in range(FILES)}
    (m.mountpoint / "w").mkdir()
    for name, data in contents.items():
        write_committed(m.mountpoint / "w" / name, data)
    m.remount()
    for name, data in contents.items():
        assert (m.mountpoint / "w" / name).read_bytes() == data
    s = m.stats()["by_dir"]["w"]
    assert s["reads"] == FILES
    # a READ that arrives before the daemon had a moment to spare is served the old way (a loaded machine)
    assert s["read_ahead"] >= FILES // 2
    assert s["read_ahead_served"] == s["read_ahead"]


def test_a_file_written_in_place_after_its_read_ahead_reads_its_new_bytes(mount_factory: MountFactory):
    """Bytes read ahead are the committed blob's: a file written in place after its lookup is served its
    uncommitted content, not them."""
    m = mount_factory()
    path = m.mountpoint / "k.ptx"
    write_committed(path, b"a" * 10_000)
    m.remount()
    path.stat()
    wait_for(lambda: m.stats()["read_ahead"] == 1, 10, "the read-ahead")
    fd = os.open(path, os.O_RDWR)
    try:
        os.pwrite(fd, b"NEW", 5000)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # the kernel asks the daemon for every page again
        reads = m.stats()["by_dir"]["/"]["reads"]
        assert os.pread(fd, 10_000, 0) == b"a" * 5000 + b"NEW" + b"a" * 4997
        time.sleep(0.01)  # past the control file's freshness (FRESH_SECONDS): a new production
        assert m.stats()["by_dir"]["/"]["reads"] > reads  # that read reached the daemon
    finally:
        os.close(fd)
    assert path.read_bytes() == b"a" * 5000 + b"NEW" + b"a" * 4997


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
