"""Defects an adversarial run found (issue "13. Nothing ships broken, wedges or is lost"), one test each.

Real mounts, ordinary file APIs from other processes (``dd``, ``rm``, the
CLI), a tmpfs store where a full disk is the point.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from conftest import (MountFactory, as_user, pid_alive, run_cli, traversable, wait_for, wait_unmounted,
                      write_committed)

K, M = 1024, 1024 * 1024


@pytest.mark.timeout(180)
def test_full_disk_fails_the_write_but_keeps_cache_reserve_and_rm(mount_factory: MountFactory, tmpfs):
    """A write that can never fit fails with ENOSPC; the cache, the reserve and rm survive it."""
    disk = tmpfs("30m")
    m = mount_factory("full", "--min-age", "0s", store=disk / "store")
    cached = {}
    for i in range(27):
        cached[f"f{i}"] = os.urandom(1000 * K)
        write_committed(m.mountpoint / f"f{i}", cached[f"f{i}"])
    dd = subprocess.run(["dd", "if=/dev/zero", f"of={m.mountpoint / 'big'}", "bs=1M", "count=40"],
                        capture_output=True, text=True, timeout=60)
    assert dd.returncode != 0 and "No space left on device" in dd.stderr, dd.stderr
    time.sleep(2.5)  # the idle timer has had its chance to commit the partial file
    left = [n for n in cached if (m.mountpoint / n).exists()]
    assert len(left) >= 20, f"a write that could not fit took the cache: {len(left)} of 27 files left"
    for name in left:
        assert (m.mountpoint / name).read_bytes() == cached[name]
    # the partial file of the failed writer is not kept: its bytes are not in the store
    assert os.stat(m.mountpoint / "big").st_size == 0
    assert m.stats()["physical_bytes"] <= len(left) * 1000 * K + 64 * K
    wait_for(lambda: (m.store / "reserve").exists() and (m.store / "reserve").stat().st_size == M,
             timeout=10, what="the 1 MiB reserve is back")
    rm = subprocess.run(["rm", str(m.mountpoint / "big")], capture_output=True, text=True, timeout=30)
    assert rm.returncode == 0, rm.stderr
    gc = run_cli("gc", str(m.mountpoint))
    assert gc.returncode == 0, gc.stderr
    write_committed(m.mountpoint / "after", b"room again")
    assert (m.mountpoint / "after").read_bytes() == b"room again"
    m.umount()
    assert run_cli("fsck", "--store", str(m.store)).returncode == 0


@pytest.mark.timeout(120)
def test_full_disk_second_write_of_a_failed_file_fails_fast(mount_factory: MountFactory, tmpfs):
    """After its write failed for room, a file's next writes fail at once instead of evicting more."""
    disk = tmpfs("12m")
    m = mount_factory("fast", "--min-age", "0s", store=disk / "store")
    for i in range(8):
        write_committed(m.mountpoint / f"f{i}", os.urandom(1000 * K))
    fd = os.open(m.mountpoint / "big", os.O_WRONLY | os.O_CREAT, 0o644)
    try:
        with pytest.raises(OSError) as e:
            for _ in range(40):
                os.write(fd, b"\0" * M)
        assert e.value.errno == errno.ENOSPC
        evicted = m.stats()["evicted_files"]
        with pytest.raises(OSError) as again:
            os.write(fd, b"\0" * M)
        assert again.value.errno == errno.ENOSPC
        assert m.stats()["evicted_files"] == evicted, "a failed file's next write evicted more"
        with pytest.raises(OSError) as sync:
            os.fsync(fd)  # the writer learns that its content was not kept
        assert sync.value.errno == errno.ENOSPC
    finally:
        os.close(fd)
    # starting over (O_TRUNC) is allowed again
    write_committed(m.mountpoint / "big", b"small now")
    assert (m.mountpoint / "big").read_bytes() == b"small now"


RENAMER = textwrap.dedent(
    """
    import os, sys
    mp = sys.argv[1]
    for name in sys.argv[2:]:
        with open(os.path.join(mp, name + ".tmp"), "wb") as f:
            f.write(os.urandom(900 * 1024))
        os.replace(os.path.join(mp, name + ".tmp"), os.path.join(mp, name))
    """
)


@pytest.mark.timeout(120)
def test_a_file_being_renamed_into_place_is_never_evicted(mount_factory: MountFactory):
    m = mount_factory("rename", "--max-size", "1M", "--min-age", "0s")
    res = subprocess.run([sys.executable, "-c", RENAMER, str(m.mountpoint), "big1", "big2", "big3"],
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    assert (m.mountpoint / "big3").stat().st_size == 900 * K  # the last one stays: it was just used


@pytest.mark.timeout(180)
def test_eight_writers_renaming_under_a_small_budget(mount_factory: MountFactory):
    m = mount_factory("renamers", "--max-size", "3M", "--min-age", "0s")
    procs = [subprocess.Popen([sys.executable, "-c", RENAMER, str(m.mountpoint),
                               *[f"w{w}-{i}" for i in range(4)]], stderr=subprocess.PIPE, text=True)
             for w in range(8)]
    errors = [p.communicate(timeout=120)[1] for p in procs]
    assert [p.returncode for p in procs] == [0] * 8, [e[-300:] for e in errors]
    m.umount()
    assert run_cli("fsck", "--store", str(m.store)).returncode == 0


@pytest.mark.timeout(120)
def test_idle_commits_survive_a_crash_after_a_clean_remount(mount_factory: MountFactory):
    """A clean unmount settles every unconfirmed commit: a later crash drops none of them."""
    m = mount_factory("settle")
    (m.mountpoint / "A").write_text("a\n")  # committed by the idle timer: unconfirmed
    (m.mountpoint / "D.tmp").write_bytes(b"d")
    os.replace(m.mountpoint / "D.tmp", m.mountpoint / "D")
    time.sleep(3)
    m.remount()
    pid = m.pid
    assert pid is not None
    os.kill(pid, signal.SIGKILL)
    wait_for(lambda: not pid_alive(pid), timeout=10, what="the daemon died")
    wait_unmounted(m.mountpoint)
    m.mount()
    assert sorted(os.listdir(m.mountpoint)) == ["A", "D"]
    assert (m.mountpoint / "A").read_text() == "a\n"


NOBODY = 65534


@pytest.mark.timeout(120)
def test_stats_and_status_work_for_other_users_of_an_allow_other_mount(mount_factory: MountFactory):
    traversable(mount_factory.root)
    m = mount_factory("shared", "--allow-other")
    (m.mountpoint / "inductor").mkdir()
    write_committed(m.mountpoint / "inductor" / "k.py", b"x" * 5000)
    stats = as_user(NOBODY, "-m", "mithrilfs", "stats", "--json", str(m.mountpoint))
    assert stats.returncode == 0, stats.stderr
    doc = json.loads(stats.stdout)
    assert doc["files"] == 1 and {r["name"]: r["bytes"] for r in doc["usage"]["by_top"]}["inductor"] == 5000
    table = as_user(NOBODY, "-m", "mithrilfs", "stats", str(m.mountpoint))
    assert table.returncode == 0 and "inductor" in table.stdout, table.stderr
    assert as_user(NOBODY, "-m", "mithrilfs", "status", str(m.mountpoint)).returncode == 0
    # commands change the mount: the owner's; said in one line
    for args in (["gc"], ["clear"], ["stats", "--zero"], ["stats", "--top", "3"]):
        res = as_user(NOBODY, "-m", "mithrilfs", *args, str(m.mountpoint))
        assert res.returncode == 1, (args, res.stdout, res.stderr)
        assert "needs the rights of the mount's owner (uid 0" in res.stderr, (args, res.stderr)
        assert len(res.stderr.strip().splitlines()) == 1 and "Traceback" not in res.stderr
    assert (m.mountpoint / "inductor" / "k.py").exists()  # nobody's clear evicted nothing


@pytest.mark.timeout(120)
def test_a_user_who_cannot_enter_the_mount_is_told_why(mount_factory: MountFactory):
    traversable(mount_factory.root)
    m = mount_factory("private")
    for args in (["stats"], ["status"], ["gc"], ["env"]):
        res = as_user(NOBODY, "-m", "mithrilfs", *args, str(m.mountpoint))
        assert res.returncode == 1, (args, res.stdout, res.stderr)
        out = (res.stdout + res.stderr).strip()
        assert "Traceback" not in out and len(out.splitlines()) == 1, (args, out)
        assert f"uid {NOBODY} cannot enter this mount: uid 0 mounted it without --allow-other" in out, (args, out)
    res = as_user(NOBODY, "-m", "mithrilfs", "status", "--json", str(m.mountpoint))
    assert res.returncode == 1 and json.loads(res.stdout)["state"] == "forbidden"
