"""The command line as ccache users expect: one line and a non-zero exit, never a traceback (issue 12)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from conftest import CLI, REPO, MountFactory, is_mounted, run_cli
from mithrilfs.daemon import holders


def one_line_error(res: subprocess.CompletedProcess) -> None:
    assert res.returncode != 0, res
    assert "Traceback" not in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr


def test_commands_on_a_mount_whose_daemon_was_killed(mount_factory: MountFactory, tmp_path):
    m = mount_factory()
    os.kill(m.pid, signal.SIGKILL)
    for args in (["stats", str(m.mountpoint)], ["gc", str(m.mountpoint)], ["push", str(m.mountpoint)],
                 ["env", str(m.mountpoint)], ["export", str(m.mountpoint), str(tmp_path / "x.tar")],
                 ["prefetch", str(m.mountpoint)]):
        res = run_cli(*args, timeout=30)
        one_line_error(res)
        assert "stale mount" in res.stderr or "not a mithrilfs mount" in res.stderr, res.stderr
    m.pid = None


def test_stats_watch_into_head_ends_quietly(mount_factory: MountFactory):
    m = mount_factory()
    res = subprocess.run(f"{' '.join(CLI)} stats --watch 0.1 {m.mountpoint} | head -3", shell=True,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 0 and len(res.stdout.splitlines()) == 3
    assert "Traceback" not in res.stderr and "BrokenPipe" not in res.stderr, res.stderr


def test_version_help_and_license():
    from mithrilfs import __version__

    res = run_cli("--version")
    assert res.returncode == 0 and res.stdout.strip() == f"mithrilfs {__version__}"
    res = run_cli()
    assert res.returncode == 2 and "usage: mithrilfs" in res.stdout and "prefetch" in res.stdout
    assert "MIT License" in (REPO / "LICENSE").read_text()


def test_mount_over_a_nonempty_directory_is_refused_unless_asked(mount_factory: MountFactory, tmp_path):
    mp = tmp_path / "full"
    mp.mkdir()
    (mp / "precious.txt").write_text("hidden by a mount")
    res = run_cli("mount", str(mp), "--store", str(tmp_path / "s"))
    one_line_error(res)
    assert "not empty" in res.stderr and "--nonempty" in res.stderr
    m = mount_factory("over", "--nonempty")
    m.umount()
    (m.mountpoint / "file").write_text("x")
    m.mount()  # allowed when asked
    assert not (m.mountpoint / "file").exists()


def test_store_in_use_names_its_mount_and_pid(mount_factory: MountFactory, tmp_path):
    m = mount_factory()
    other = tmp_path / "other"
    other.mkdir()
    res = run_cli("mount", str(other), "--store", str(m.store))
    one_line_error(res)
    assert f"pid {m.pid}" in res.stderr and str(m.mountpoint) in res.stderr and "--mount" in res.stderr
    res = run_cli("run", "--store", str(m.store), "--", "true")
    one_line_error(res)
    assert f"pid {m.pid}" in res.stderr


def test_umount_of_a_busy_mount_names_the_holders_and_offers_lazy(mount_factory: MountFactory):
    m = mount_factory()
    (m.mountpoint / "held").write_bytes(b"x")
    holder = subprocess.Popen([sys.executable, "-c", f"f = open({str(m.mountpoint / 'held')!r}); input()"],
                              stdin=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 10
        while not any(f"[{holder.pid}]" in h for h in holders(m.mountpoint)):
            assert time.monotonic() < deadline, "the holder did not open its file"
            time.sleep(0.05)
        res = run_cli("umount", str(m.mountpoint))
        one_line_error(res)
        assert f"[{holder.pid}]" in res.stderr and "--lazy" in res.stderr
        res = run_cli("umount", "--lazy", str(m.mountpoint))
        assert res.returncode == 0, res.stderr
    finally:
        holder.communicate("\n", timeout=10)
    assert not is_mounted(m.mountpoint)


def test_mount_warns_when_redis_cannot_be_reached(mount_factory: MountFactory, tmp_path):
    from conftest import free_port

    mp = tmp_path / "r"
    mp.mkdir()
    res = run_cli("mount", str(mp), "--store", str(tmp_path / "rs"), "--remote", f"redis://127.0.0.1:{free_port()}/0")
    try:
        assert res.returncode == 0, res.stderr
        assert "warning" in res.stderr and "cannot be reached" in res.stderr and "Traceback" not in res.stderr
    finally:
        run_cli("umount", str(mp))


def test_bad_port_and_export_to_a_missing_directory(mount_factory: MountFactory, tmp_path):
    (tmp_path / "mp").mkdir()
    res = run_cli("mount", str(tmp_path / "mp"), "--store", str(tmp_path / "s"), "--remote",
                  "redis://host:notaport/0")
    one_line_error(res)
    assert res.returncode == 2 and "port" in res.stderr
    m = mount_factory()
    res = run_cli("export", str(m.mountpoint), str(tmp_path / "missing-dir" / "x.tar"))
    one_line_error(res)
    assert "does not exist" in res.stderr
    res = run_cli("export", str(m.mountpoint), str(tmp_path / "ok.tar"))
    assert res.returncode == 0 and (tmp_path / "ok.tar").exists()
    assert not list(tmp_path.glob(".*.partial"))
