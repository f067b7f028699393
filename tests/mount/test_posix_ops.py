"""POSIX behaviour through a real FUSE mount, using ordinary file APIs from the test process."""

from __future__ import annotations

import errno
import mmap
import os
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from conftest import Mount


@pytest.fixture
def d(shared_mnt: Mount, request) -> Path:
    p = shared_mnt.mountpoint / request.node.name
    p.mkdir()
    return p


def test_create_write_read(d):
    (d / "f").write_bytes(b"hello world")
    assert (d / "f").read_bytes() == b"hello world"
    assert (d / "f").stat().st_size == 11


def test_create_exclusive(d):
    fd = os.open(d / "x", os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o640)
    os.close(fd)
    assert stat.S_IMODE((d / "x").stat().st_mode) == 0o640
    with pytest.raises(FileExistsError):
        os.open(d / "x", os.O_CREAT | os.O_EXCL | os.O_WRONLY)


def test_open_trunc_append_rdwr(d):
    p = d / "f"
    p.write_bytes(b"0123456789")
    with open(p, "r+b") as f:  # O_RDWR, no truncation
        f.seek(3)
        f.write(b"abc")
        f.seek(0)
        assert f.read() == b"012abc6789"
    assert p.read_bytes() == b"012abc6789"
    with open(p, "ab") as f:  # O_APPEND
        f.write(b"END")
    assert p.read_bytes() == b"012abc6789END"
    fd = os.open(p, os.O_WRONLY | os.O_APPEND)
    os.lseek(fd, 0, os.SEEK_SET)
    os.write(fd, b"!")  # O_APPEND ignores the seek
    os.close(fd)
    assert p.read_bytes() == b"012abc6789END!"
    with open(p, "wb") as f:  # O_TRUNC
        f.write(b"short")
    assert p.read_bytes() == b"short"


def test_write_at_any_offset_makes_holes(d):
    p = d / "sparse"
    fd = os.open(p, os.O_CREAT | os.O_RDWR, 0o644)
    os.pwrite(fd, b"B", 100_000)
    os.pwrite(fd, b"A", 0)
    os.close(fd)
    data = p.read_bytes()
    assert len(data) == 100_001 and data[0:1] == b"A" and data[-1:] == b"B"
    assert data[1:-1] == b"\0" * 99_999


def test_truncate_and_ftruncate(d):
    p = d / "t"
    p.write_bytes(b"abcdefgh")
    os.truncate(p, 3)
    assert p.read_bytes() == b"abc"
    os.truncate(p, 6)
    assert p.read_bytes() == b"abc\0\0\0"
    with open(p, "r+b") as f:
        os.ftruncate(f.fileno(), 1)
        assert os.fstat(f.fileno()).st_size == 1
    assert p.read_bytes() == b"a"


def test_chmod_and_utimens(d):
    p = d / "m"
    p.write_bytes(b"x")
    os.chmod(p, 0o600)
    assert stat.S_IMODE(p.stat().st_mode) == 0o600
    os.utime(p, ns=(1_500_000_000_000_000_000, 1_600_000_000_123_456_789))
    st = p.stat()
    assert st.st_mtime_ns == 1_600_000_000_123_456_789
    assert st.st_atime_ns == 1_500_000_000_000_000_000


def test_mkdir_rmdir_enotempty(d):
    (d / "sub").mkdir()
    (d / "sub" / "f").write_bytes(b"x")
    with pytest.raises(OSError) as e:
        (d / "sub").rmdir()
    assert e.value.errno == errno.ENOTEMPTY
    with pytest.raises(FileExistsError):
        (d / "sub").mkdir()
    (d / "sub" / "f").unlink()
    (d / "sub").rmdir()
    assert not (d / "sub").exists()


def test_unlinked_open_file_stays_readable(d):
    p = d / "gone"
    p.write_bytes(b"keep reading me")
    with open(p, "rb") as f:
        p.unlink()
        assert not p.exists()
        assert f.read() == b"keep reading me"
    # a writer of an unlinked file keeps working too
    fd = os.open(d / "w", os.O_CREAT | os.O_RDWR, 0o644)
    os.unlink(d / "w")
    os.write(fd, b"data")
    assert os.pread(fd, 10, 0) == b"data"
    os.close(fd)


def test_rename_atomic_replace(d):
    (d / "final").write_bytes(b"old")
    (d / "tmp").write_bytes(b"new")
    with open(d / "final", "rb") as old_reader:
        os.replace(d / "tmp", d / "final")
        assert (d / "final").read_bytes() == b"new"
        assert old_reader.read() == b"old"  # the replaced inode lives while open
    assert not (d / "tmp").exists()


def test_rename_noreplace(d):
    import ctypes

    libc = ctypes.CDLL(None, use_errno=True)
    (d / "a").write_bytes(b"a")
    (d / "b").write_bytes(b"b")
    AT_FDCWD, RENAME_NOREPLACE = -100, 1
    rc = libc.renameat2(AT_FDCWD, bytes(d / "a"), AT_FDCWD, bytes(d / "b"), RENAME_NOREPLACE)
    assert rc == -1 and ctypes.get_errno() == errno.EEXIST
    assert (d / "b").read_bytes() == b"b"
    rc = libc.renameat2(AT_FDCWD, bytes(d / "a"), AT_FDCWD, bytes(d / "c"), RENAME_NOREPLACE)
    assert rc == 0 and (d / "c").read_bytes() == b"a"


def test_rename_directories(d):
    (d / "src" / "deep").mkdir(parents=True)
    (d / "src" / "deep" / "f").write_bytes(b"x")
    (d / "dst").mkdir()
    os.rename(d / "src", d / "dst" / "moved")
    assert (d / "dst" / "moved" / "deep" / "f").read_bytes() == b"x"
    (d / "emptydir").mkdir()
    os.rename(d / "dst" / "moved", d / "emptydir")  # replaces an empty directory
    assert (d / "emptydir" / "deep" / "f").read_bytes() == b"x"
    (d / "full").mkdir()
    (d / "full" / "x").write_bytes(b"")
    with pytest.raises(OSError) as e:
        os.rename(d / "emptydir", d / "full")
    assert e.value.errno in (errno.ENOTEMPTY, errno.EEXIST)
    with pytest.raises(OSError) as e:
        os.rename(d / "emptydir", d / "emptydir" / "deep" / "inside")
    assert e.value.errno == errno.EINVAL


def test_readdir_lists_everything_once(d):
    names = {f"file{i:04d}" for i in range(600)}
    for n in names:
        (d / n).write_bytes(n.encode())
    assert set(os.listdir(d)) == names
    # deleting while iterating neither repeats nor skips the survivors
    seen = []
    with os.scandir(d) as it:
        for i, entry in enumerate(it):
            seen.append(entry.name)
            if i == 10:
                for victim in sorted(names)[:5]:
                    if victim not in seen:
                        os.unlink(d / victim)
    assert len(seen) == len(set(seen))
    assert set(os.listdir(d)) <= names


def test_control_dir_hidden_from_readdir(shared_mnt):
    assert ".mithrilfs" not in os.listdir(shared_mnt.mountpoint)
    assert (shared_mnt.mountpoint / ".mithrilfs" / "pid").read_text().strip().isdigit()


def test_symlink_readlink(d):
    (d / "target").write_bytes(b"pointed at")
    os.symlink("target", d / "link")
    assert os.readlink(d / "link") == "target"
    assert (d / "link").read_bytes() == b"pointed at"
    assert (d / "link").is_symlink()


def test_hard_links(d):
    (d / "a").write_bytes(b"linked")
    os.link(d / "a", d / "b")
    assert (d / "a").stat().st_ino == (d / "b").stat().st_ino
    assert (d / "b").stat().st_nlink == 2
    (d / "a").unlink()
    assert (d / "b").read_bytes() == b"linked"
    assert (d / "b").stat().st_nlink == 1


def test_statfs(shared_mnt):
    st = os.statvfs(shared_mnt.mountpoint)
    assert st.f_bsize > 0 and st.f_blocks > 0 and st.f_namemax == 255


def test_xattrs_answer_enotsup(d):
    p = d / "x"
    p.write_bytes(b"")
    for call in (
        lambda: os.getxattr(p, "user.a"),
        lambda: os.setxattr(p, "user.a", b"1"),
        lambda: os.listxattr(p),
        lambda: os.removexattr(p, "user.a"),
    ):
        with pytest.raises(OSError) as e:
            call()
        assert e.value.errno in (errno.ENOTSUP, errno.ENODATA)


def test_mmap_of_written_file(d):
    p = d / "mm"
    p.write_bytes(bytes(range(256)) * 64)
    with open(p, "rb") as f, mmap.mmap(f.fileno(), 0, prot=mmap.PROT_READ) as m:
        assert m[256:512] == bytes(range(256))
    with open(p, "r+b") as f, mmap.mmap(f.fileno(), 0) as m:
        m[0:4] = b"MMAP"
        m.flush()
    assert p.read_bytes()[:5] == b"MMAP\x04"


def test_fsync_commits_while_open(shared_mnt, d):
    p = d / "synced"
    with open(p, "wb") as f:
        f.write(b"durable")
        f.flush()
        os.fsync(f.fileno())
        f.write(b"+more")
    assert p.read_bytes() == b"durable+more"


def test_other_process_sees_content_after_close(d):
    p = d / "ipc"
    p.write_bytes(b"from parent")
    out = subprocess.run(
        [sys.executable, "-c", f"import sys; sys.stdout.write(open({str(p)!r}).read())"],
        capture_output=True, text=True, check=True,
    )
    assert out.stdout == "from parent"


def test_mtime_moves_on_write(d):
    p = d / "mt"
    p.write_bytes(b"1")
    before = p.stat().st_mtime_ns
    time.sleep(0.01)
    with open(p, "ab") as f:
        f.write(b"2")
    assert p.stat().st_mtime_ns > before


def test_large_file_roundtrip(d):
    data = os.urandom(8 << 20)
    (d / "big").write_bytes(data)
    assert (d / "big").read_bytes() == data


# -- gaps a POSIX conformance run found ---------------------------------------
NAME_MAX = 255


def test_device_nodes_are_stored_with_their_rdev_and_never_opened(mount_factory):
    m = mount_factory("dev")
    chr_path, blk_path = m.mountpoint / "null-like", m.mountpoint / "loop-like"
    os.mknod(chr_path, stat.S_IFCHR | 0o600, os.makedev(1, 3))
    os.mknod(blk_path, stat.S_IFBLK | 0o640, os.makedev(7, 0))
    fifo = m.mountpoint / "fifo"
    os.mkfifo(fifo, 0o644)
    for _ in range(2):  # the same after a remount: type and device number are in the index
        st = os.lstat(chr_path)
        assert stat.S_ISCHR(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600 and st.st_rdev == os.makedev(1, 3)
        st = os.lstat(blk_path)
        assert stat.S_ISBLK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o640 and st.st_rdev == os.makedev(7, 0)
        assert stat.S_ISFIFO(os.lstat(fifo).st_mode)
        assert sorted(os.listdir(m.mountpoint)) == ["fifo", "loop-like", "null-like"]
        # the mount is nodev: a device node in a cache must never reach a real device
        with pytest.raises(PermissionError):
            os.open(chr_path, os.O_RDONLY)
        m.remount()
    os.unlink(chr_path)
    os.unlink(blk_path)
    assert sorted(os.listdir(m.mountpoint)) == ["fifo"]


@pytest.mark.parametrize("op", ["create", "mkdir", "mknod", "symlink", "link", "rename", "stat", "unlink",
                                "rmdir"])
def test_names_longer_than_name_max_are_refused(d, op):
    long = d / ("n" * (NAME_MAX + 1))
    ok = d / ("n" * NAME_MAX)
    (d / "src").write_bytes(b"x")
    ok.write_bytes(b"fits")  # the longest legal name works
    assert ok.read_bytes() == b"fits"
    attempt = {
        "create": lambda: long.write_bytes(b"x"),
        "mkdir": lambda: long.mkdir(),
        "mknod": lambda: os.mkfifo(long),
        "symlink": lambda: os.symlink("src", long),
        "link": lambda: os.link(d / "src", long),
        "rename": lambda: os.rename(d / "src", long),
        "stat": lambda: os.stat(long),
        "unlink": lambda: os.unlink(long),
        "rmdir": lambda: os.rmdir(long),
    }[op]
    with pytest.raises(OSError) as e:
        attempt()
    assert e.value.errno == errno.ENAMETOOLONG
    assert sorted(os.listdir(d)) == sorted(["src", ok.name])


def test_setgid_directory_passes_its_group_on(d):
    top = d / "shared"
    top.mkdir()
    os.chown(top, -1, 4242)
    os.chmod(top, 0o2775)
    (top / "file").write_bytes(b"x")
    (top / "sub").mkdir()
    os.symlink("file", top / "link")
    assert os.stat(top / "file").st_gid == 4242  # not the creator's group (root's 0)
    assert os.lstat(top / "link").st_gid == 4242
    sub = os.stat(top / "sub")
    assert sub.st_gid == 4242 and sub.st_mode & stat.S_ISGID  # subdirectories keep the bit
    assert not os.stat(top / "file").st_mode & stat.S_ISGID
    (top / "sub" / "deeper").write_bytes(b"y")
    assert os.stat(top / "sub" / "deeper").st_gid == 4242
    plain = d / "plain"
    plain.mkdir()
    os.chown(plain, -1, 4242)
    (plain / "f").write_bytes(b"z")
    assert os.stat(plain / "f").st_gid == 0  # without the bit, the creator's group
