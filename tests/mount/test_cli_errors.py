"""The command line as ccache users expect: one line and a non-zero exit, never a traceback (issue 12)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys

from conftest import (
    CLI,
    REPO,
    MountFactory,
    as_user,
    entry,
    is_mounted,
    make_archive,
    run_cli,
    supervisor_pid,
    traversable,
    wait_for,
)

from mithrilfs.daemon.umount import holders


def one_line_error(res: subprocess.CompletedProcess) -> None:
    assert res.returncode != 0, res
    assert "Traceback" not in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr


def test_commands_on_a_mount_whose_daemon_was_killed(mount_factory: MountFactory, tmp_path):
    m = mount_factory()
    supervisor = supervisor_pid(m.mountpoint)
    assert supervisor is not None
    os.kill(supervisor, signal.SIGKILL)  # else it would take the mount over
    os.kill(m.pid, signal.SIGKILL)
    for args in (["stats", str(m.mountpoint)], ["gc", str(m.mountpoint)], ["push", str(m.mountpoint)],
                 ["env", str(m.mountpoint)], ["export", str(m.mountpoint), str(tmp_path / "x.tar")],
                 ["prefetch", str(m.mountpoint)], ["forget", "--fleet", str(m.mountpoint), "x"]):
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
        wait_for(lambda: any(f"[{holder.pid}]" in h for h in holders(m.mountpoint)), 10,
                 "the holder to open its file")
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


# ----------------------------------------------------------------------
# hostile and broken archives
# ----------------------------------------------------------------------
def test_import_rejects_hostile_archives_with_one_line(tmp_path):
    from mithrilfs.store.cas import hash_bytes

    good = b"good kernel"
    h = hash_bytes(good).hex()
    cases = {
        "bad-json": ["{not json"],
        "nested": ["[" * 5000 + "]" * 5000],
        "unknown-key": [entry("a", blob=h, size=len(good), evil=1)],
        "bad-type": [entry("a", type="fifo")],
        "huge-mode": [entry("a", mode=2**64, blob=h, size=len(good))],
        "text-time": [entry("a", mtime_ns="yesterday", blob=h, size=len(good))],
    }
    for name, entries in cases.items():
        arc = tmp_path / f"{name}.tar"
        make_archive(arc, entries, {h: good})
        res = run_cli("import", str(arc), "--store", str(tmp_path / f"s-{name}"))
        one_line_error(res)
        assert "manifest line 1" in res.stderr, (name, res.stderr)


def test_import_masks_types_and_never_writes_past_the_manifest(tmp_path, mount_factory: MountFactory):
    from mithrilfs.store.cas import hash_bytes

    good = b"good kernel"
    h = hash_bytes(good).hex()
    big = "ab" * 32
    arc = tmp_path / "hostile.tar"
    make_archive(arc, [
        {"path": "dev", "type": "dir", "mode": 0o020644, "mtime_ns": 1, "atime_ns": 1},  # a char device's mode
        entry("dev/k.so", blob=h, size=len(good)),
        entry("big.so", blob=big, size=10),  # the member claims 10 GB
    ], {h: good}, sparse={big: 10 * 10**9})
    assert arc.stat().st_size < 100_000
    store = tmp_path / "s"
    res = run_cli("import", str(arc), "--store", str(store))
    assert res.returncode == 1 and "1 corrupt blobs skipped" in res.stdout, res.stdout + res.stderr
    used = sum(p.stat().st_size for p in store.rglob("*") if p.is_file())
    assert used < 50 << 20, used  # the 10 GB member was never written
    m = mount_factory("imp", store=store)
    st = os.stat(m.mountpoint / "dev")
    import stat as st_

    assert st_.S_ISDIR(st.st_mode)  # a directory, not a device node
    assert (m.mountpoint / "dev" / "k.so").read_bytes() == good
    assert not (m.mountpoint / "big.so").exists()
    m.umount()
    assert run_cli("fsck", "--store", str(store)).returncode == 0


def test_import_of_a_truncated_archive_imports_nothing(mount_factory: MountFactory, tmp_path):
    m = mount_factory()
    for i in range(5):
        (m.mountpoint / f"f{i}").write_bytes(os.urandom(200_000))
    m.umount()  # a clean unmount commits them
    arc = tmp_path / "full.tar"
    run_cli("export", "--store", str(m.store), str(arc), check=True)
    for cut in (arc.stat().st_size // 2, arc.stat().st_size - 12000):
        cut_arc = tmp_path / f"cut{cut}.tar"
        cut_arc.write_bytes(arc.read_bytes()[:cut])
        store = tmp_path / f"s{cut}"
        res = run_cli("import", str(cut_arc), "--store", str(store))
        one_line_error(res)
        assert "archive" in res.stderr
        assert not store.exists() or not [p for p in (store / "objects").rglob("*") if p.is_file()]


# ----------------------------------------------------------------------
# users, stores and daemons that cannot go on
# ----------------------------------------------------------------------
def test_non_root_mount_says_what_is_missing(tmp_path):
    """A user mounts through fusermount3: one line that names /dev/fuse's mode when it is root's alone."""
    mp, store = tmp_path / "user-mnt", tmp_path / "user-store"
    for d in (mp, store):
        d.mkdir()
        os.chown(d, 1000, 1000)
    traversable(tmp_path)
    res = as_user(1000, "-m", "mithrilfs", "mount", str(mp), "--store", str(store), env={"HOME": str(tmp_path)})
    if os.stat("/dev/fuse").st_mode & 0o006 == 0o006:  # usable by every user: the mount works
        try:
            assert res.returncode == 0, res.stderr
            assert is_mounted(mp)
        finally:
            as_user(1000, "-m", "mithrilfs", "umount", str(mp))
        return
    one_line_error(res)
    assert "/dev/fuse" in res.stderr and "mode 0600" in res.stderr and "0666" in res.stderr, res.stderr
    assert not is_mounted(mp)


def test_non_root_user_of_a_root_store_is_told_whose_it_is(tmp_path):
    store = tmp_path / "root-store"
    run_cli("config", str(store), check=True)  # made by root, private to root
    (tmp_path / "user-mnt").mkdir()
    os.chown(tmp_path / "user-mnt", 1000, 1000)
    traversable(tmp_path)
    for args in (["mount", str(tmp_path / "user-mnt"), "--store", str(store)], ["fsck", "--store", str(store)],
                 ["export", "--store", str(store), "/tmp/never-written.tar"], ["config", str(store), "--max-size", "1G"],
                 ["import", str(REPO / "LICENSE"), "--store", str(store)]):
        res = as_user(1000, "-m", "mithrilfs", *args, env={"HOME": str(tmp_path)})
        one_line_error(res)
        if args[0] != "import":  # import names the bad archive first
            assert "belongs to root (uid 0)" in res.stderr and "--store" in res.stderr, (args, res.stderr)
    assert not os.path.exists("/tmp/never-written.tar")


def test_a_daemon_that_fails_before_the_mount_is_ready_says_why(tmp_path):
    store, mp = tmp_path / "s", tmp_path / "mp"
    mp.mkdir()
    run_cli("config", str(store), check=True)
    (store / "mithrilfs.log").mkdir()  # the daemon cannot open its log
    res = run_cli("mount", str(mp), "--store", str(store))
    one_line_error(res)
    assert "the daemon failed" in res.stderr and "IsADirectoryError" in res.stderr and "mithrilfs.log" in res.stderr
    assert not is_mounted(mp)


def test_ctrl_c_during_export_leaves_no_archive(mount_factory: MountFactory, tmp_path):
    m = mount_factory()
    for i in range(400):
        (m.mountpoint / f"f{i}").write_bytes(os.urandom(100_000))
    m.umount()
    out = tmp_path / "x.tar"
    proc = subprocess.Popen([*CLI, "export", "--store", str(m.store), str(out)], stderr=subprocess.PIPE, text=True)
    wait_for(lambda: (tmp_path / ".x.tar.partial").exists() or proc.poll() is not None, 30, "the export to start")
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=30)
    assert proc.returncode in (130, 0), err  # 0: it finished first, and then the archive is whole
    assert "Traceback" not in err
    assert not (tmp_path / ".x.tar.partial").exists()
    if proc.returncode == 130:
        assert not out.exists()
    else:
        assert run_cli("import", str(out), "--store", str(tmp_path / "check")).returncode == 0


def test_fusermount_refusals_get_a_hint():
    """fusermount3's own refusals (a user without user_allow_other, without /dev/fuse) say what to do."""
    from mithrilfs.kernel.mount import _fusermount_hint

    hint = _fusermount_hint("fusermount3: option allow_other only allowed if 'user_allow_other' is set in "
                            "/etc/fuse.conf")
    assert "add user_allow_other to /etc/fuse.conf" in hint and "--allow-other" in hint
    hint = _fusermount_hint("fusermount3: failed to open /dev/fuse: Permission denied")
    assert f"mode {os.stat('/dev/fuse').st_mode & 0o7777:04o}" in hint and "0666" in hint
    hint = _fusermount_hint("fusermount3: user has no write access to mountpoint /x")
    assert hint.endswith("/x")  # nothing to add to a message that already says what is wrong
