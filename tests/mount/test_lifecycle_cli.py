"""Mount lifecycle and CLI errors: daemonizing, signals, stale mounts, bad input."""

from __future__ import annotations

import errno
import os
import signal
import subprocess
import time
from pathlib import Path

import pytest
from conftest import (
    Mount,
    MountFactory,
    daemon_pid,
    is_mounted,
    pid_alive,
    run_cli,
    supervisor_pid,
    wait_for,
    wait_unmounted,
    write_committed,
)

from mithrilfs.daemon.umount import store_free
from mithrilfs.testing import own_namespace


def _wait_gone(pid: int, timeout: float = 20) -> bool:
    deadline = time.monotonic() + timeout
    while pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    return not pid_alive(pid)


def test_mount_returns_once_live_and_daemon_runs_in_background(mnt: Mount):
    # the CLI has already exited 0; the mount answers and the daemon is another process
    assert is_mounted(mnt.mountpoint)
    assert mnt.pid != os.getpid() and pid_alive(mnt.pid)
    write_committed(mnt.mountpoint / "x", b"1")


def test_umount_waits_for_the_daemon(mnt: Mount):
    pid = mnt.pid
    mnt.umount()
    assert not pid_alive(pid)


def test_umount_names_a_namespace_still_holding_the_mount_and_a_tests_namespace_holds_only_what_it_keeps(
        mount_factory: MountFactory):
    """A mount namespace made while a filesystem is mounted holds a private copy of it that the unmount here
    does not reach, and the daemon serves that copy on: ``umount`` names the namespace's process in one line
    at once instead of waiting out its timeout.  A namespace a test makes (``own_namespace``) holds only the
    mounts it keeps: another test's unmount is never held up by it."""
    kept, other = mount_factory("kept"), mount_factory("other")
    write_committed(kept.mountpoint / "f", b"served on")
    holder = subprocess.Popen(own_namespace.argv(["sleep", "600"], keep=[kept.mountpoint]))
    try:
        wait_for(lambda: Path(f"/proc/{holder.pid}/comm").read_text().strip() == "sleep", 30, "the namespace's command")
        other_pid = other.pid
        other.umount()  # not kept there: unmounted as though the namespace did not exist
        assert other_pid is not None and not pid_alive(other_pid)
        res = run_cli("umount", str(kept.mountpoint), timeout=60)
        assert res.returncode == 1 and f"sleep[{holder.pid}]" in res.stderr, res.stderr
        assert str(kept.store) in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr
        assert not is_mounted(kept.mountpoint) and kept.pid is not None and pid_alive(kept.pid)
        seen = subprocess.run(["nsenter", "-t", str(holder.pid), "-m", "cat", str(kept.mountpoint / "f")],
                              capture_output=True, timeout=30)
        assert seen.stdout == b"served on", seen.stderr
    finally:
        holder.kill()
        holder.wait()
    wait_for(lambda: kept.pid is not None and not pid_alive(kept.pid), 30, "the daemon's exit with the last copy")
    kept.pid = None
    wait_for(lambda: store_free(kept.store), 30, "the store's lock released")


def test_root_unmounts_without_fusermount3(mnt: Mount, tmp_path: Path):
    """Root mounts with mount(2) and must unmount with umount2(2): the GPU machine's image had no fusermount3,
    and ``umount`` failed there with "fusermount3: No such file or directory" (a mount left behind)."""
    write_committed(mnt.mountpoint / "kept", b"data")
    bin_dir = tmp_path / "bin"  # a PATH with python and nothing else: no fusermount3
    bin_dir.mkdir()
    (bin_dir / "python3").symlink_to(os.path.realpath(os.sys.executable))
    res = run_cli("umount", str(mnt.mountpoint), env=dict(os.environ, PATH=str(bin_dir)))
    assert res.returncode == 0, res.stderr
    assert not is_mounted(mnt.mountpoint) and not pid_alive(mnt.pid)
    wait_unmounted(mnt.mountpoint)
    mnt.pid = None
    mnt.mount()
    assert (mnt.mountpoint / "kept").read_bytes() == b"data"


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_signal_unmounts_cleanly_and_keeps_data(mnt: Mount, sig):
    write_committed(mnt.mountpoint / "kept", b"data")
    os.kill(mnt.pid, sig)
    assert _wait_gone(mnt.pid)
    assert not is_mounted(mnt.mountpoint)
    wait_unmounted(mnt.mountpoint)  # and its supervisor, which holds the store's lock a moment longer
    mnt.pid = None
    mnt.mount()
    assert (mnt.mountpoint / "kept").read_bytes() == b"data"


def test_kill9_with_on_crash_detach_leaves_no_dead_mount(mount_factory: MountFactory):
    # the supervisor sees the daemon die and detaches the mount: no ENOTCONN left for the next user
    mnt = mount_factory("m", "--on-crash", "detach")
    write_committed(mnt.mountpoint / "committed", b"safe")
    assert supervisor_pid(mnt.mountpoint) is not None
    os.kill(mnt.pid, signal.SIGKILL)
    assert _wait_gone(mnt.pid)
    wait_unmounted(mnt.mountpoint)  # its work done, the supervisor leaves too
    mnt.pid = None
    res = run_cli("status", str(mnt.mountpoint))
    assert res.returncode == 1 and "--on-crash detach" in res.stdout, res.stdout
    mnt.mount()
    assert (mnt.mountpoint / "committed").read_bytes() == b"safe"


def test_stale_mount_after_kill9_is_cleaned_by_next_mount(mnt: Mount):
    # without the supervisor (killed too), the next mount of the path cleans up
    write_committed(mnt.mountpoint / "committed", b"safe")
    supervisor = supervisor_pid(mnt.mountpoint)
    assert supervisor is not None
    os.kill(supervisor, signal.SIGKILL)
    os.kill(mnt.pid, signal.SIGKILL)
    assert _wait_gone(mnt.pid)
    with pytest.raises(OSError) as e:
        os.statvfs(mnt.mountpoint)  # statfs always reaches the (dead) daemon
    # the kernel still has the dead mount (ECONNABORTED if the call was queued as the daemon died)
    assert e.value.errno in (errno.ENOTCONN, errno.ECONNABORTED)
    res = run_cli("mount", str(mnt.mountpoint), "--store", str(mnt.store))
    assert res.returncode == 0, res.stderr
    assert "stale mount" in res.stderr
    mnt.pid = int((mnt.mountpoint / ".mithrilfs" / "pid").read_text())
    assert (mnt.mountpoint / "committed").read_bytes() == b"safe"


def test_umount_detaches_a_dead_mount_and_says_it_was_dead(mnt: Mount):
    """Daemon and supervisor killed: the kernel answers ENOTCONN.  ``umount`` (which the README and the CLI's
    own message name for this) detaches it in one line, exit 0, instead of a traceback."""
    write_committed(mnt.mountpoint / "committed", b"safe")
    supervisor = supervisor_pid(mnt.mountpoint)
    assert supervisor is not None
    os.kill(supervisor, signal.SIGKILL)
    assert _wait_gone(supervisor)
    os.kill(mnt.pid, signal.SIGKILL)
    assert _wait_gone(mnt.pid)
    mnt.pid = None
    with pytest.raises(OSError) as e:
        os.statvfs(mnt.mountpoint)  # statfs always reaches the (dead) daemon (a stat may be cached)
    assert e.value.errno in (errno.ENOTCONN, errno.ECONNABORTED)
    res = run_cli("umount", str(mnt.mountpoint))
    assert res.returncode == 0, res.stderr
    assert "dead mount" in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert not is_mounted(mnt.mountpoint)
    mnt.mount()
    assert (mnt.mountpoint / "committed").read_bytes() == b"safe"


def test_foreground_mount_stays_attached(tmp_path: Path):
    import subprocess
    import sys

    mp = tmp_path / "mp"
    mp.mkdir()
    proc = subprocess.Popen(
        [sys.executable, "-m", "mithrilfs", "mount", str(mp), "--store", str(tmp_path / "s"), "--foreground"],
        stderr=subprocess.PIPE, text=True,
    )
    # a signal while the daemon is still coming up must not deadlock it on its own mount
    (tmp_path / "mp2").mkdir()
    early = subprocess.Popen(
        [sys.executable, "-m", "mithrilfs", "mount", str(tmp_path / "mp2"), "--store", str(tmp_path / "s2"),
         "--foreground"], stderr=subprocess.DEVNULL,
    )
    m = Mount(mp, tmp_path / "s", pid=proc.pid)
    try:
        while "mithrilfs: mounted" not in (line := proc.stderr.readline()):
            assert line, "the foreground mount ended before announcing itself"
        assert is_mounted(mp) and proc.poll() is None
        write_committed(mp / "f", b"fg")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
        assert not is_mounted(mp)
        early.send_signal(signal.SIGTERM)
        assert early.wait(timeout=20) in (0, 1, -signal.SIGTERM)
    finally:
        m.force_cleanup()
        Mount(tmp_path / "mp2", tmp_path / "s2", pid=early.pid).force_cleanup()
        for p in (proc, early):
            if p.poll() is None:
                p.kill()


def _one_line_error(res, code: int, needle: str) -> None:
    assert res.returncode == code, (res.returncode, res.stderr)
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1, res.stderr
    assert needle in lines[0]
    assert "Traceback" not in res.stderr


def test_missing_mountpoint(tmp_path):
    res = run_cli("mount", str(tmp_path / "nope"), "--store", str(tmp_path / "s"))
    _one_line_error(res, 2, "does not exist")
    assert not (tmp_path / "s").exists()


def test_mountpoint_not_a_directory(tmp_path):
    (tmp_path / "file").write_text("")
    res = run_cli("mount", str(tmp_path / "file"), "--store", str(tmp_path / "s"))
    _one_line_error(res, 2, "not a directory")


def test_already_mounted(mnt: Mount, tmp_path):
    res = run_cli("mount", str(mnt.mountpoint), "--store", str(tmp_path / "other"))
    _one_line_error(res, 2, "already mounted")


def test_store_inside_mountpoint(tmp_path):
    mp = tmp_path / "mp"
    mp.mkdir()
    res = run_cli("mount", str(mp), "--store", str(mp / "store"))
    _one_line_error(res, 2, "inside the mount point")
    assert not (mp / "store").exists()


def test_store_is_not_a_store(tmp_path):
    mp, st = tmp_path / "mp", tmp_path / "st"
    mp.mkdir()
    st.mkdir()
    (st / "precious.txt").write_text("user data")
    res = run_cli("mount", str(mp), "--store", str(st))
    _one_line_error(res, 2, "not a mithrilfs store")
    assert not is_mounted(mp)
    assert sorted(os.listdir(st)) == ["precious.txt"]


def test_store_in_use_by_another_mount(mnt: Mount, tmp_path):
    mp2 = tmp_path / "mp2"
    mp2.mkdir()
    res = run_cli("mount", str(mp2), "--store", str(mnt.store))
    _one_line_error(res, 1, "in use")
    assert not is_mounted(mp2)


def test_unknown_option_and_missing_argument(tmp_path):
    _one_line_error(run_cli("mount", str(tmp_path), "--bogus"), 2, "unrecognized arguments")
    _one_line_error(run_cli("mount"), 2, "required")
    _one_line_error(run_cli("frobnicate"), 2, "invalid choice")


def test_umount_of_something_not_mounted(tmp_path):
    _one_line_error(run_cli("umount", str(tmp_path)), 2, "not mounted")


def test_mount_through_fusermount3(mount_factory):
    # the path a non-root user takes: fusermount3 mounts and passes the /dev/fuse fd back over
    # _FUSE_COMMFD; forced here as root (this machine's /dev/fuse is 0600 root)
    m = mount_factory("fm", env={"MITHRILFS_MOUNT_VIA": "fusermount3"})
    (m.mountpoint / "d").mkdir()
    write_committed(m.mountpoint / "d" / "f", b"through fusermount3")
    assert (m.mountpoint / "d" / "f").read_bytes() == b"through fusermount3"
    with open("/proc/self/mounts") as f:
        line = next(x for x in f if f" {m.mountpoint} " in x)
    assert "fuse.mithrilfs" in line and "nodev" in line and "nosuid" in line
    m.remount()  # a clean unmount through fusermount3, then again
    assert (m.mountpoint / "d" / "f").read_bytes() == b"through fusermount3"
    # a killed daemon's mount made through fusermount3 is taken over as well
    assert supervisor_pid(m.mountpoint) is not None
    os.kill(m.pid, signal.SIGKILL)
    assert _wait_gone(m.pid)
    assert (m.mountpoint / "d" / "f").read_bytes() == b"through fusermount3"
    m.pid = daemon_pid(m.mountpoint)
    m.umount()
    wait_unmounted(m.mountpoint)
