"""Warm start at the protocol floor (issue 17): work done before the client asks for it.

A small file's blob is read and verified right after the LOOKUP's reply is
written, and its READ is answered from those bytes (``cache.readahead``).
Nothing is pushed into the kernel's page cache: ``--push-on-lookup`` did
that and lost in-place writes (issue 19); it was removed.
"""

from __future__ import annotations

import errno
import os
import random
import time
from pathlib import Path

import pytest
from conftest import Mount, MountFactory, run_cli, wait_for, write_committed

FILES = 24


def _requests(m: Mount, op: str) -> int:
    time.sleep(0.01)  # past the control file's freshness (FRESH_SECONDS): a new production
    return m.stats()["requests"].get(op, {}).get("count", 0)


def test_the_removed_push_option_is_refused_in_one_line(tmp_path: Path):
    res = run_cli("mount", str(tmp_path / "mnt"), "--store", str(tmp_path / "store"), "--push-on-lookup")
    assert res.returncode == 2 and not (tmp_path / "store").exists()
    assert res.stderr.strip() == ("mithrilfs mount: error: --push-on-lookup was removed: it could lose in-place"
                                  " writes (docs/design.md)")


def test_a_corrupt_blob_is_not_read_ahead_and_its_read_fails(mount_factory: MountFactory):
    m = mount_factory("m")
    write_committed(m.mountpoint / "victim.so", b"original kernel bytes")
    m.umount()
    from mithrilfs.store.cas import hash_bytes

    digest = hash_bytes(b"original kernel bytes").hex()
    blob = m.store / "objects" / digest[:2] / digest
    os.chmod(blob, 0o644)
    blob.write_bytes(b"evil kernel bytes!!!!")  # same length, wrong content
    m.mount()
    (m.mountpoint / "victim.so").stat()  # the lookup: the read-ahead after it finds the blob wrong
    wait_for(lambda: m.stats()["requests"].get("AFTER_REPLY", {}).get("count", 0) >= 1, 10, "the read-ahead")
    with pytest.raises(OSError) as e:
        (m.mountpoint / "victim.so").read_bytes()
    assert e.value.errno == errno.EIO
    time.sleep(0.01)  # past the control file's freshness (FRESH_SECONDS): not the production wait_for read
    s = m.stats()
    assert s["read_ahead"] == 0 and s["corrupt_blobs"] == 1


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


#: Files written in place right after their first lookup (issue 19: the push landed over 29-120 of 100-200).
IN_PLACE_FILES = 100


def test_a_file_written_in_place_right_after_its_first_lookup_keeps_its_new_bytes(mount_factory: MountFactory):
    """O_RDWR and a 64 KiB pwrite right after the kernel first meets the file, then fsync: the new bytes
    are read back at once and after a remount, every time.  (``--push-on-lookup`` lost them: a push of
    the old content landed over the written pages; it was removed, docs/design.md.)"""
    m = mount_factory("m")
    old, new = b"o" * (128 << 10), b"N" * (64 << 10)
    (m.mountpoint / "w").mkdir()
    for i in range(IN_PLACE_FILES):
        write_committed(m.mountpoint / "w" / f"k{i}.cubin", old)
    m.remount()  # the kernel holds nothing: each open below is the file's first lookup
    for i in range(IN_PLACE_FILES):
        fd = os.open(m.mountpoint / "w" / f"k{i}.cubin", os.O_RDWR)
        try:
            assert os.pwrite(fd, new, 0) == len(new)
            os.fsync(fd)
            assert os.pread(fd, len(old), 0) == new + old[len(new):], f"k{i}.cubin lost its write"
        finally:
            os.close(fd)
    m.remount()
    lost = [i for i in range(IN_PLACE_FILES) if (m.mountpoint / "w" / f"k{i}.cubin").read_bytes() != new + old[len(new):]]
    assert not lost, f"{len(lost)} files lost their confirmed write after a remount"
