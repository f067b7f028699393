"""FUSE passthrough: a large committed file is read and mapped by the kernel from its blob.

Every test mounts for real and reads from other processes; the daemon's
``reads`` counter (file READ requests that reached it) tells whether the
kernel read the blob itself.
"""

from __future__ import annotations

import errno
import hashlib
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
from conftest import Mount, MountFactory, blob_files, run_cli, wait_for, write_committed

from mithrilfs.daemon.process import pid_alive
from mithrilfs.fs.passthrough import MIN_SIZE
from mithrilfs.kernel.negotiate import MAX_WRITE, max_pages_limit

pytestmark = [pytest.mark.timeout(180),
              pytest.mark.skipif(os.geteuid() != 0, reason="FUSE passthrough needs CAP_SYS_ADMIN")]

BIG = 2 * MIN_SIZE
ON = ("--passthrough", "on")

#: Reads the file by read() and by mmap; prints both digests.
READER = textwrap.dedent(
    """
    import hashlib, mmap, sys
    with open(sys.argv[1], "rb") as f:
        by_read = hashlib.sha256(f.read()).hexdigest()
    with open(sys.argv[1], "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as m:
        by_map = hashlib.sha256(m).hexdigest()
    print(by_read, by_map)
    """
)

#: Opens and maps the file, says "held", then on each line read prints the digest of the mapping and of
#: a pread of the whole file; ends at end of input.
HOLDER = textwrap.dedent(
    """
    import hashlib, mmap, os, sys
    f = open(sys.argv[1], "rb")
    m = mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ)
    print("held", flush=True)
    for _ in sys.stdin:
        size = os.fstat(f.fileno()).st_size
        print(hashlib.sha256(m).hexdigest(), hashlib.sha256(os.pread(f.fileno(), size, 0)).hexdigest(), flush=True)
    """
)


#: Maps each file named (read-only), touches every page and prints how many kB the kernel mapped with
#: 2 MiB entries (``FilePmdMapped``), one number a file.
PMD_MAPPED = textwrap.dedent(
    """
    import mmap, sys
    for name in sys.argv[1:]:
        with open(name, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as m:
            m[::mmap.PAGESIZE]
            lines, kib = open("/proc/self/smaps").read().splitlines(), 0
            for i, line in enumerate(lines):
                if line.endswith(name):
                    kib = next(int(x.split()[1]) for x in lines[i:] if x.startswith("FilePmdMapped:"))
            print(kib)
    """
)


def _read_elsewhere(p: Path) -> list[str]:
    out = subprocess.run([sys.executable, "-c", READER, str(p)], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout.split()


def _holder(p: Path) -> subprocess.Popen:
    h = subprocess.Popen([sys.executable, "-c", HOLDER, str(p)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                         text=True)
    assert h.stdout is not None and h.stdout.readline().strip() == "held"
    return h


def _ask(h: subprocess.Popen) -> list[str]:
    assert h.stdin is not None and h.stdout is not None
    h.stdin.write("read\n")
    h.stdin.flush()
    return h.stdout.readline().split()


def _status(m: Mount) -> str:
    return run_cli("status", str(m.mountpoint), check=True).stdout


def test_a_large_committed_file_is_read_and_mapped_without_a_read_request(mount_factory: MountFactory):
    mnt = mount_factory("big", *ON)
    data = os.urandom(BIG)
    write_committed(mnt.mountpoint / "big.bin", data)
    mnt.remount()  # a cold mount: the blob is verified at the open that hands it over
    reads = mnt.stats()["reads"]
    digest = hashlib.sha256(data).hexdigest()
    assert _read_elsewhere(mnt.mountpoint / "big.bin") == [digest, digest]
    assert _read_elsewhere(mnt.mountpoint / "big.bin") == [digest, digest]
    assert mnt.stats()["reads"] == reads  # the kernel read the blob itself, twice
    assert "passthrough on" in _status(mnt)


def test_small_files_and_files_being_written_are_served_as_before(mount_factory: MountFactory):
    mnt = mount_factory("small", *ON)
    small = os.urandom(4096)
    write_committed(mnt.mountpoint / "small", small)
    mnt.remount()
    reads = mnt.stats()["reads"]
    h = hashlib.sha256(small).hexdigest()
    assert _read_elsewhere(mnt.mountpoint / "small") == [h, h]
    assert mnt.stats()["reads"] > reads  # through the page cache, as before
    data = os.urandom(BIG)
    with open(mnt.mountpoint / "growing", "wb") as f:
        f.write(data)
        f.flush()  # staged, not committed: no blob to hand over
        h = hashlib.sha256(data).hexdigest()
        assert _read_elsewhere(mnt.mountpoint / "growing") == [h, h]
        f.write(b"more")
        f.flush()
        h = hashlib.sha256(data + b"more").hexdigest()
        assert _read_elsewhere(mnt.mountpoint / "growing") == [h, h]


def test_a_writer_cannot_open_a_file_a_reader_holds_from_its_blob(mount_factory: MountFactory):
    mnt = mount_factory("writer", *ON)
    data = os.urandom(BIG)
    write_committed(mnt.mountpoint / "big.bin", data)
    holder = _holder(mnt.mountpoint / "big.bin")
    try:
        with pytest.raises(OSError) as e:
            open(mnt.mountpoint / "big.bin", "r+b")
        assert e.value.errno == errno.ETXTBSY  # never a write into the shared blob
        with pytest.raises(OSError) as e:
            os.truncate(mnt.mountpoint / "big.bin", 0)
        assert e.value.errno == errno.ETXTBSY  # nor content changing under the reader
        digest = hashlib.sha256(data).hexdigest()
        assert _ask(holder) == [digest, digest]
    finally:
        assert holder.stdin is not None
        holder.stdin.close()
        holder.wait(timeout=30)

    def writable() -> bool:
        try:
            with open(mnt.mountpoint / "big.bin", "r+b") as f:
                f.write(b"X")
            return True
        except OSError as e:
            assert e.errno == errno.ETXTBSY  # until the reader's RELEASE reaches the daemon
            return False

    wait_for(writable, what="a write open once the reader is gone")
    assert (mnt.mountpoint / "big.bin").read_bytes() == b"X" + data[1:]


def test_a_corrupt_large_blob_is_never_handed_to_the_kernel(mount_factory: MountFactory):
    m = mount_factory("corrupt", *ON)
    data = os.urandom(BIG)
    write_committed(m.mountpoint / "victim.bin", data)
    m.umount()
    from mithrilfs.store.cas import hash_bytes

    digest = hash_bytes(data).hex()
    blob = m.store / "objects" / digest[:2] / digest
    os.chmod(blob, 0o644)
    with open(blob, "r+b") as f:
        f.seek(BIG // 2)
        f.write(b"evil")  # same length, wrong content
    m.mount()
    out = subprocess.run([sys.executable, "-c", READER, str(m.mountpoint / "victim.bin")], capture_output=True,
                         text=True, timeout=60)
    assert out.returncode != 0 and "Errno 5" in out.stderr, out.stderr  # EIO at the open: never served
    assert m.stats()["corrupt_blobs"] == 1
    wait_for(lambda: not (m.mountpoint / "victim.bin").exists(), what="the quarantined name gone")


def test_a_mapped_file_stays_readable_after_its_name_and_blob_go(mount_factory: MountFactory):
    m = mount_factory("gone", "--min-age", "0", *ON)
    data = os.urandom(BIG)
    write_committed(m.mountpoint / "big.bin", data)
    m.remount()
    holder = _holder(m.mountpoint / "big.bin")
    digest = hashlib.sha256(data).hexdigest()
    try:
        (m.mountpoint / "big.bin").unlink()
        assert _ask(holder) == [digest, digest]
        assert m.stats()["reads"] == 0  # the kernel reads the blob itself
    finally:
        assert holder.stdin is not None
        holder.stdin.close()
        holder.wait(timeout=30)
    wait_for(lambda: not blob_files(m.store), what="the blob freed once nothing holds it")


def test_a_file_held_from_its_blob_stays_readable_when_its_blob_is_evicted(mount_factory: MountFactory):
    m = mount_factory("evict", "--max-size", str(3 * BIG), "--min-age", "0", *ON)
    data = os.urandom(BIG)
    write_committed(m.mountpoint / "big.bin", data)
    holder = _holder(m.mountpoint / "big.bin")
    digest = hashlib.sha256(data).hexdigest()
    try:
        for i in range(4):  # past the budget: the held file is the least recently used
            write_committed(m.mountpoint / f"filler{i}", os.urandom(BIG))
        run_cli("gc", str(m.mountpoint), check=True)
        wait_for(lambda: "big.bin" not in os.listdir(m.mountpoint), what="big.bin evicted")
        assert _ask(holder) == [digest, digest]
    finally:
        assert holder.stdin is not None
        holder.stdin.close()
        holder.wait(timeout=30)


@pytest.mark.parametrize("option", [(), ("--passthrough", "off")], ids=["default", "off"])
def test_with_passthrough_off_open_stays_in_the_kernel(mount_factory: MountFactory, option: tuple[str, ...]):
    m = mount_factory("off", *option)
    data = os.urandom(BIG)
    write_committed(m.mountpoint / "big.bin", data)
    m.remount()
    digest = hashlib.sha256(data).hexdigest()
    for _ in range(3):
        assert _read_elsewhere(m.mountpoint / "big.bin") == [digest, digest]
    requests = m.stats()["requests"]
    assert requests.get("OPEN", {}).get("count", 0) <= 1  # answered ENOSYS once, then never sent
    assert "RELEASE" not in requests
    assert m.stats()["reads"] > 0
    assert "passthrough off (the default;" in _status(m)


def test_a_successor_serves_files_a_predecessor_handed_to_the_kernel(mount_factory: MountFactory):
    mnt = mount_factory("successor", *ON)
    data = os.urandom(BIG)
    write_committed(mnt.mountpoint / "big.bin", data)
    holder = _holder(mnt.mountpoint / "big.bin")
    digest = hashlib.sha256(data).hexdigest()
    try:
        old = mnt.pid
        assert old is not None
        os.kill(old, signal.SIGKILL)
        wait_for(lambda: not pid_alive(old), timeout=10, what="the daemon died")
        assert mnt.stats()["pid"] != old  # the read waits for the successor
        assert _ask(holder) == [digest, digest]  # the kernel holds the blob the dead daemon handed over
        assert _read_elsewhere(mnt.mountpoint / "big.bin") == [digest, digest]
        assert "passthrough on" in _status(mnt)  # the INIT its predecessor agreed holds
    finally:
        assert holder.stdin is not None
        holder.stdin.close()
        holder.wait(timeout=30)
    assert _read_elsewhere(mnt.mountpoint / "big.bin") == [digest, digest]


def test_a_file_written_in_one_go_reaches_the_daemon_in_2_MiB_writes(mount_factory: MountFactory):
    assert max_pages_limit() * 4096 >= MAX_WRITE, "fs.fuse.max_pages_limit is below 512: run scripts/setup"
    mnt = mount_factory("writes")
    before = mnt.stats()["requests"].get("WRITE", {}).get("count", 0)
    write_committed(mnt.mountpoint / "big.bin", os.urandom(8 * MAX_WRITE))
    assert mnt.stats()["requests"]["WRITE"]["count"] - before == 8
    assert "pieces" not in _status(mnt)  # said only when the kernel cuts writes smaller


def test_a_passed_through_mapping_takes_2_MiB_entries_where_a_plain_file_does(mount_factory: MountFactory):
    mnt = mount_factory("folios", *ON)
    data = os.urandom(4 * MAX_WRITE)
    plain = mnt.store.parent / "plain.bin"  # on the store's filesystem
    write_committed(plain, data)
    write_committed(mnt.mountpoint / "big.bin", data)
    out = subprocess.run([sys.executable, "-c", PMD_MAPPED, str(plain),
                          str(mnt.mountpoint / "big.bin")], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    plain_kib, mount_kib = (int(x) for x in out.stdout.split())
    # the blob's page cache holds the folios its writes made, as the plain file's holds its write's
    assert mount_kib == plain_kib


def test_a_successor_knows_a_writer_its_predecessor_let_in(mount_factory: MountFactory):
    mnt = mount_factory("writer-successor", *ON)
    data = os.urandom(BIG)
    write_committed(mnt.mountpoint / "big.bin", data)
    digest = hashlib.sha256(data).hexdigest()
    with open(mnt.mountpoint / "big.bin", "r+b") as writer:  # through the page cache, not written yet
        old = mnt.pid
        assert old is not None
        os.kill(old, signal.SIGKILL)
        wait_for(lambda: not pid_alive(old), timeout=10, what="the daemon died")
        assert mnt.stats()["pid"] != old
        # the successor serves this reader through the page cache too: the kernel refuses (EIO) a
        # backing file for an inode a writer holds in page-cache mode
        assert _read_elsewhere(mnt.mountpoint / "big.bin") == [digest, digest]
        writer.write(b"new")
        writer.flush()
        os.fsync(writer.fileno())
    changed = hashlib.sha256(b"new" + data[3:]).hexdigest()
    assert _read_elsewhere(mnt.mountpoint / "big.bin") == [changed, changed]
