"""Defects an adversarial run found (issue "13. Nothing ships broken, wedges or is lost"), one test each.

Real mounts, ordinary file APIs from other processes (``dd``, ``rm``, the
CLI), a tmpfs store where a full disk is the point.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
from conftest import (
    Mount,
    MountFactory,
    as_user,
    entry,
    make_archive,
    pid_alive,
    run_cli,
    traversable,
    wait_for,
    wait_unmounted,
    write_committed,
)

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
        assert m.stats()["written_files"] == 0  # nothing of it is staged, nothing pins it
        time.sleep(2.5)  # the idle timer's commits leave a failed file alone...
        with pytest.raises(OSError) as sync:
            os.fsync(fd)  # the writer learns that its content was not kept
        assert sync.value.errno == errno.ENOSPC  # ...so the writer's own commit point still learns of it
        os.fsync(fd)  # told once
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
    m = mount_factory("settle", "--on-crash", "detach")
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


def _one_line(res: subprocess.CompletedProcess) -> str:
    assert "Traceback" not in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr
    return res.stderr


@pytest.mark.timeout(120)
def test_export_is_private_unless_asked(mount_factory: MountFactory, tmp_path: Path):
    m = mount_factory("exp")
    secret = m.mountpoint / "secret.so"
    write_committed(secret, b"private bytes")
    os.chmod(secret, 0o600)
    assert run_cli("export", str(m.mountpoint), str(tmp_path / "a.tar")).returncode == 0
    assert stat.S_IMODE(os.stat(tmp_path / "a.tar").st_mode) == 0o600
    assert run_cli("export", str(m.mountpoint), str(tmp_path / "b.tar"), "--mode", "0644").returncode == 0
    assert stat.S_IMODE(os.stat(tmp_path / "b.tar").st_mode) == 0o644
    assert run_cli("export", str(m.mountpoint), str(tmp_path / "c.tar"), "--mode", "999").returncode == 2
    # another user cannot read the default archive
    traversable(tmp_path)
    res = as_user(NOBODY, "-c", f"open({str(tmp_path / 'a.tar')!r}, 'rb').read()")
    assert res.returncode != 0 and "PermissionError" in res.stderr


@pytest.mark.timeout(120)
def test_import_refuses_what_the_mount_cannot_hold(mount_factory: MountFactory, tmp_path: Path):
    from mithrilfs.store.cas import hash_bytes

    data = b"kernel bytes"
    h = hash_bytes(data).hex()
    long_name = "x" * 300
    arc = tmp_path / "odd.tar"
    make_archive(arc, [
        entry(f"d/{long_name}", blob=h, size=len(data)),
        entry("suid", blob=h, size=len(data), mode=0o6777),
        {"path": "sgid-dir", "type": "dir", "mode": 0o2775, "mtime_ns": 1, "atime_ns": 1},
        {"path": "link", "type": "symlink", "mode": 0o644, "mtime_ns": 1, "atime_ns": 1, "target": "suid"},
        entry("ok.so", blob=h, size=len(data)),
        entry(".mithrilfs/stats.json", blob=h, size=len(data)),  # the control directory's place
    ], {h: data})
    store = tmp_path / "s"
    res = run_cli("import", str(arc), "--store", str(store))
    assert res.returncode == 1, res.stdout + res.stderr  # something was rejected: not a silent success
    assert "2 names the mount cannot serve rejected" in res.stdout, res.stdout
    m = mount_factory("odd", store=store)
    assert not (m.mountpoint / "d").exists()  # nothing of the rejected path was made
    assert stat.S_IMODE(os.stat(m.mountpoint / "suid").st_mode) == 0o777  # no set-user/group-id file
    assert stat.S_IMODE(os.stat(m.mountpoint / "sgid-dir").st_mode) == 0o2775
    assert stat.S_IMODE(os.lstat(m.mountpoint / "link").st_mode) == 0o777
    assert (m.mountpoint / "ok.so").read_bytes() == data
    m.umount()
    assert run_cli("fsck", "--store", str(store)).returncode == 0

    # conflicting paths left alone: exit 1 as the README says
    arc2 = tmp_path / "conflict.tar"
    make_archive(arc2, [{"path": "ok.so", "type": "dir", "mode": 0o755, "mtime_ns": 5, "atime_ns": 5}])
    res = run_cli("import", str(arc2), "--store", str(store))
    assert res.returncode == 1 and "1 conflicting paths left alone" in res.stdout, res.stdout


@pytest.mark.timeout(120)
def test_fsck_reports_and_repairs_names_the_mount_cannot_serve(tmp_path: Path, mount_factory: MountFactory):
    import sqlite3

    m = mount_factory("names")
    (m.mountpoint / "dir").mkdir()
    write_committed(m.mountpoint / "dir" / "good", b"g")
    write_committed(m.mountpoint / "dir" / "bad", b"b")
    (m.mountpoint / "baddir" / "sub").mkdir(parents=True)
    write_committed(m.mountpoint / "baddir" / "sub" / "x", b"x")
    m.umount()
    db = sqlite3.connect(m.store / "index.sqlite3")
    db.execute("UPDATE dentries SET name = ? WHERE name = ?", (b"y" * 300, b"bad"))
    db.execute("UPDATE dentries SET name = ? WHERE name = ?", (b"..", b"baddir"))  # a directory, with a tree
    db.commit()
    db.close()
    res = run_cli("fsck", "--store", str(m.store))
    assert res.returncode == 4 and "2 names the mount cannot serve" in res.stdout, res.stdout
    assert f"  name the mount cannot serve: dir/{'y' * 300}" in res.stdout
    assert run_cli("fsck", "--repair", "--store", str(m.store)).returncode == 1
    assert run_cli("fsck", "--store", str(m.store)).returncode == 0
    m.mount()
    assert os.listdir(m.mountpoint / "dir") == ["good"]
    assert sorted(os.listdir(m.mountpoint)) == ["dir"]


@pytest.mark.timeout(120)
def test_sizes_that_do_not_fit_in_64_bits_are_refused_and_statfs_never_fails(mount_factory: MountFactory,
                                                                             tmp_path: Path):
    huge = "99999999999999999999999999"
    refused = mount_factory.root / "refused-mnt"  # the factory unmounts it should the mount be taken
    refused.mkdir()
    mount_factory.mounts.append(Mount(refused, tmp_path / "s"))
    for args in (["mount", str(refused), "--store", str(tmp_path / "s"), "--max-size", huge],
                 ["config", str(tmp_path / "s"), "--max-size", huge], ["config", str(tmp_path / "s"), "--max-size", "1e99"]):
        res = run_cli(*args)
        assert res.returncode == 2, (args, res.stderr)
        _one_line(res)
    # a budget near the limit still gives a working df
    m = mount_factory("big", "--max-size", "8000P")
    df = subprocess.run(["df", "-B1", str(m.mountpoint)], capture_output=True, text=True, timeout=30)
    assert df.returncode == 0, df.stderr
    os.statvfs(m.mountpoint)
    # "GB" means 10^9 bytes, "G" and "GiB" 2^30
    for text, expect in (("10GB", 10 * 10**9), ("10G", 10 << 30), ("10 GiB", 10 << 30)):
        assert run_cli("config", str(tmp_path / "c"), "--max-size", text).returncode == 0
        cfg = run_cli("config", str(tmp_path / "c"), "--json")
        assert json.loads(cfg.stdout)["settings"]["max_size"] == expect, (text, cfg.stdout)
    assert "powers of 1000" in run_cli("mount", "--help").stdout


@pytest.mark.timeout(120)
def test_df_on_a_disk_smaller_than_the_budget(mount_factory: MountFactory, tmpfs):
    disk = tmpfs("20m")
    m = mount_factory("df", "--max-size", "10G", store=disk / "store")
    write_committed(m.mountpoint / "f", os.urandom(2 * M))
    st, disk_st = os.statvfs(m.mountpoint), os.statvfs(disk)
    used = (st.f_blocks - st.f_bfree) * st.f_frsize
    assert 2 * M <= used < 3 * M, used  # used is what the cache holds, not the budget minus the disk's room
    size = st.f_blocks * st.f_frsize
    assert size < 20 * M  # the disk, not the 10 GiB budget, bounds what the cache can reach
    assert abs(st.f_bavail * st.f_frsize - disk_st.f_bavail * disk_st.f_frsize) < 256 * K


@pytest.mark.timeout(120)
def test_a_shell_redirect_runs_a_control_command(mount_factory: MountFactory):
    m = mount_factory("redir")
    for i in range(3):
        write_committed(m.mountpoint / f"f{i}", b"x" * 1000)
    res = subprocess.run(["sh", "-c", f"echo run > {m.mountpoint}/.mithrilfs/clear && cat {m.mountpoint}/.mithrilfs/clear"],
                         capture_output=True, text=True, timeout=30)
    assert res.returncode == 0, res.stderr
    assert json.loads(res.stdout)["files"] == 3
    assert os.listdir(m.mountpoint) == []
    res = subprocess.run(["sh", "-c", f": > {m.mountpoint}/.mithrilfs/stats.json"], capture_output=True, text=True)
    assert res.returncode != 0  # a file that only reads stays read-only


@pytest.mark.timeout(120)
def test_paths_too_long_and_commands_that_cannot_run_get_one_line(tmp_path: Path):
    long_path = "/" + "/".join(["d" * 250] * 18)
    for args in (["mount", long_path, "--store", str(tmp_path / "s")],
                 ["mount", str(tmp_path / "mp"), "--store", long_path],
                 ["stats", long_path], ["fsck", "--store", long_path]):
        (tmp_path / "mp").mkdir(exist_ok=True)
        res = run_cli(*args)
        assert res.returncode in (1, 2), (args, res.stderr)
        assert "too long" in _one_line(res), res.stderr
    script = tmp_path / "not-executable.sh"
    script.write_text("#!/bin/sh\necho hi\n")
    res = run_cli("run", "--store", str(tmp_path / "rs"), "--", str(script))
    assert res.returncode == 126
    assert "cannot run" in res.stderr and "Permission denied" in res.stderr and "Traceback" not in res.stderr
    res = run_cli("run", "--store", str(tmp_path / "rs"), "--", "sh", "-c", "kill -9 $$")
    assert res.returncode == 137 and "killed by signal 9" in res.stderr, res.stderr
