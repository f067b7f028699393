"""Commit points without open/close events, and what a kill -9 leaves of each (real mount).

The kernel opens and closes files itself, so content is committed at a
rename, fsync, chmod, link, FORGET, clean unmount, or by the idle timer.
After a kill -9 every file holds one whole committed content or is absent;
an idle-timer commit nothing confirmed is dropped, since it may be a
snapshot of a writer that only paused.
"""

from __future__ import annotations

import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from conftest import Mount, MountFactory, run_cli, wait_for, wait_unmounted

from mithrilfs.daemon.process import pid_alive

WHOLE = b"the whole content, written in two pieces"


def _commits(m: Mount) -> int:
    return m.stats()["commits"]


def _wait_commits(m: Mount, at_least: int, timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    while _commits(m) < at_least:
        assert time.monotonic() < deadline, f"still {_commits(m)} commits, expected {at_least}"
        time.sleep(0.1)


# these tests check the recovery of a remount after a crash (a node's reboot, ``--on-crash detach``);
# a successor taking over the live mount is tested in test_takeover.py
def _kill9_and_remount(m: Mount) -> None:
    pid = m.pid
    os.kill(pid, signal.SIGKILL)
    deadline = time.monotonic() + 30
    while pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    m.pid = None
    wait_unmounted(m.mountpoint)
    m.env = None  # no crash point in the next life
    m.mount()


def _write_in_place(p: Path) -> None:
    """Create and write a file in two pieces, then close it: no commit point of its own."""
    with open(p, "wb") as f:
        f.write(WHOLE[:10])
        f.flush()
        f.write(WHOLE[10:])


def _drop_kernel_caches() -> None:
    """Make the kernel forget unused inodes (it sends FORGET for each)."""
    os.sync()
    with open("/proc/sys/vm/drop_caches", "w") as f:
        f.write("2")


def _trigger(kind: str, d: Path) -> Path:
    """Write a file in place, then give it the commit point *kind*; returns the name that must survive."""
    p = d / "f"
    _write_in_place(p)
    if kind == "rename":
        os.replace(p, d / "renamed")
        return d / "renamed"
    if kind == "fsync":
        with open(p, "rb+") as f:
            os.fsync(f.fileno())
    elif kind == "chmod":
        os.chmod(p, 0o755)
    elif kind == "link":
        os.link(p, d / "linked")
    elif kind == "forget":
        _drop_kernel_caches()
    return p


@pytest.mark.parametrize("kind", ["rename", "fsync", "chmod", "link", "forget"])
def test_confirmed_commit_points_survive_kill9(mount_factory: MountFactory, kind: str):
    m = mount_factory(f"cp-{kind}", "--on-crash", "detach")
    d = m.mountpoint
    before = _commits(m)
    target = _trigger(kind, d)
    _wait_commits(m, before + 1, timeout=5)
    _kill9_and_remount(m)
    assert target.read_bytes() == WHOLE
    if kind == "link":
        assert (d / "linked").read_bytes() == WHOLE


def test_a_created_file_is_committed_once_the_daemon_is_idle(mount_factory: MountFactory):
    """A CREATE's transaction commits with the next transaction (the RENAME of a file written to a
    temporary name), at the daemon's next idle moment, or before its stats are counted each second at the
    latest: an empty file created and left alone reaches the index other processes read, and survives a
    kill -9."""
    m = mount_factory("created", "--on-crash", "detach")
    (m.mountpoint / "empty").touch()
    index = sqlite3.connect(f"file:{m.store / 'index.sqlite3'}?mode=ro", uri=True)
    try:
        wait_for(lambda: index.execute("SELECT count(*) FROM dentries WHERE name = ?", (b"empty",)).fetchone()[0],
                 timeout=4, what="the create in the index")
    finally:
        index.close()
    _kill9_and_remount(m)
    assert (m.mountpoint / "empty").read_bytes() == b""


def test_idle_commit_is_dropped_after_kill9(mount_factory: MountFactory):
    """A writer pauses with half its file written; the idle timer commits that; the daemon dies."""
    m = mount_factory("idle-crash", "--on-crash", "detach")
    d = m.mountpoint
    (d / "keep").write_bytes(b"published")
    os.replace(d / "keep", d / "kept")
    before = _commits(m)
    fd = os.open(d / "paused", os.O_CREAT | os.O_WRONLY, 0o644)
    try:
        os.write(fd, WHOLE[:10])
        _wait_commits(m, before + 1)  # the idle timer took the half-written file
        assert m.stats()["written_files"] == 0
        _kill9_and_remount(m)
    finally:
        try:
            os.close(fd)
        except OSError:
            pass  # its mount died
    assert not (d / "paused").exists()  # a miss, never the half file
    assert (d / "kept").read_bytes() == b"published"
    m.umount()
    fsck = run_cli("fsck", "--store", str(m.store))
    assert fsck.returncode == 0 and "no problems" in fsck.stdout, fsck.stdout + fsck.stderr


def test_idle_commit_survives_a_clean_unmount_and_counts(mount_factory: MountFactory):
    m = mount_factory("idle-clean")
    d = m.mountpoint
    before = _commits(m)
    _write_in_place(d / "a")
    _write_in_place(d / "b")  # same content: the idle commits deduplicate it
    _wait_commits(m, before + 2)
    s = m.stats()
    assert s["physical_bytes"] == len(WHOLE) and s["dedup_hits"] == 1 and s["written_files"] == 0
    m.remount()
    assert (d / "a").read_bytes() == WHOLE and (d / "b").read_bytes() == WHOLE


def test_clean_unmount_commits_what_is_written(mount_factory: MountFactory):
    m = mount_factory("unmount-commit")
    d = m.mountpoint
    _write_in_place(d / "fresh")
    m.remount()  # long before the idle timer
    assert (d / "fresh").read_bytes() == WHOLE


CRASH_WRITER = textwrap.dedent(
    """
    import os, sys
    d, kind = sys.argv[1], sys.argv[2]
    try:
        with open(f"{d}/old", "wb") as f:  # rewriting a committed file in place
            f.write(b"NEW" * 1000)
        with open(f"{d}/tmp", "wb") as f:
            f.write(b"published content" * 100)
        if kind == "rename":
            os.replace(f"{d}/tmp", f"{d}/final")
    except OSError:
        pass  # the daemon died under us: expected
    """
)


@pytest.mark.parametrize("kind", ["rename", "idle"])
@pytest.mark.parametrize("point", ["before_intent", "after_intent", "after_adopt", "after_set_content"])
def test_kill9_inside_a_commit_leaves_whole_files(mount_factory: MountFactory, kind: str, point: str):
    m = mount_factory(f"crash-{kind}-{point}", "--on-crash", "detach")
    d = m.mountpoint
    (d / "tmp0").write_bytes(b"OLD" * 1000)
    os.replace(d / "tmp0", d / "old")  # committed and confirmed before the crash point is armed
    m.umount()
    m.mount(env={"MITHRILFS_TEST_CRASH_AT": f"{point}:1"})
    pid = m.pid
    subprocess.run([sys.executable, "-c", CRASH_WRITER, str(d), kind], timeout=60, check=True)
    deadline = time.monotonic() + 20
    while pid_alive(pid) and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not pid_alive(pid), "the crash point was never reached"
    _remount_after_death(m)
    # "old" may also be absent: an idle commit of its rewrite that nothing confirmed is dropped
    for name in ("old", "tmp", "final"):
        if (d / name).exists():
            assert (d / name).read_bytes() in (b"", b"OLD" * 1000, b"NEW" * 1000, b"published content" * 100), name
    if kind == "rename" and point == "after_set_content":
        # the commit and the rename are one transaction: committed, confirmed and published together
        assert (d / "final").read_bytes() == b"published content" * 100
        assert not (d / "tmp").exists()
    m.umount()
    fsck = run_cli("fsck", "--store", str(m.store))
    assert fsck.returncode == 0 and "no problems" in fsck.stdout, fsck.stdout + fsck.stderr


def _remount_after_death(m: Mount) -> None:
    m.pid = None
    wait_unmounted(m.mountpoint)
    m.env = None
    m.mount()
