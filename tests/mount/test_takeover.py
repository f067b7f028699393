"""A daemon crash or upgrade never takes the cache away: a successor takes the live mount over.

Real mounts, real processes, kill -9: the supervisor keeps a copy of the
/dev/fuse fd and of every file's staging content, starts a successor on
the same connection, and programs see a pause, never ENOTCONN.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
from conftest import (
    REPO,
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

from mithrilfs.cache.staging import MEM_STAGING_MAX
from mithrilfs.daemon.supervisor import CRASH_LOOP_LIMIT

K = 1024


def _events(m: Mount) -> list[dict]:
    return [json.loads(line) for line in (m.store / "events.jsonl").read_text().splitlines()]


def kill_and_wait_for_successor(m: Mount) -> int:
    """kill -9 the daemon; return the pid of the daemon that took over (the read waits for it)."""
    old = m.pid
    assert old is not None
    os.kill(old, signal.SIGKILL)
    wait_for(lambda: not pid_alive(old), timeout=10, what="the daemon died")
    new = daemon_pid(m.mountpoint)
    assert new is not None and new != old
    m.pid = new
    return new


class Killer:
    """Kills the mount's daemon every *every* seconds while a workload runs."""

    def __init__(self, m: Mount, every: float = 2.0) -> None:
        self.m = m
        self.every = every
        self.kills = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run)

    def _run(self) -> None:
        while not self._stop.wait(self.every):
            pid = daemon_pid(self.m.mountpoint)
            if pid is None:
                return
            os.kill(pid, signal.SIGKILL)
            self.kills += 1
            # the next kill counts from the successor's first answer (the read waits for it): killed
            # within QUICK_DEATH_SECONDS of serving, successors on a slow machine would make a crash loop
            while daemon_pid(self.m.mountpoint) == pid:
                time.sleep(0.02)

    def __enter__(self) -> Killer:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()
        self.m.pid = daemon_pid(self.m.mountpoint)


def _unmount_and_check(m: Mount) -> None:
    """Nothing was written beside the store (under the mount point itself), and fsck is clean."""
    m.umount()
    wait_unmounted(m.mountpoint)
    assert os.listdir(m.mountpoint) == []
    fsck = run_cli("fsck", "--store", str(m.store))
    assert fsck.returncode == 0, fsck.stdout + fsck.stderr


@pytest.mark.timeout(120)
def test_kill9_mid_write_keeps_every_written_byte_and_the_mount(mnt: Mount):
    small = os.urandom(MEM_STAGING_MAX // 4)  # staged in memory: kept in a memfd the supervisor holds
    big = os.urandom(MEM_STAGING_MAX * 3)  # staged in a staging file: the supervisor holds its descriptor
    f_small = open(mnt.mountpoint / "small.tmp", "wb")
    f_big = open(mnt.mountpoint / "big.tmp", "wb")
    (mnt.mountpoint / "closed").write_bytes(b"written and closed, not yet committed")
    f_small.write(small[: len(small) // 2])
    f_small.flush()
    f_big.write(big[: len(big) // 2])
    f_big.flush()
    os.chdir(mnt.mountpoint)  # a working directory inside the mount, as a compile's
    try:
        old = mnt.pid
        kill_and_wait_for_successor(mnt)
        assert os.listdir(".")  # no ENOTCONN for the working directory
    finally:
        os.chdir("/")
    f_small.write(small[len(small) // 2:])
    f_small.close()
    f_big.write(big[len(big) // 2:])
    f_big.close()
    os.replace(mnt.mountpoint / "small.tmp", mnt.mountpoint / "small")
    os.replace(mnt.mountpoint / "big.tmp", mnt.mountpoint / "big")
    assert (mnt.mountpoint / "small").read_bytes() == small
    assert (mnt.mountpoint / "big").read_bytes() == big
    assert (mnt.mountpoint / "closed").read_bytes() == b"written and closed, not yet committed"
    stats = mnt.stats()
    assert stats["restarts"] == 1 and stats["last_restart_cause"] == "crash" and stats["pid"] != old
    status = run_cli("status", str(mnt.mountpoint))
    assert status.returncode == 0 and "restarted 1 times (last: crash" in status.stdout, status.stdout
    table = run_cli("stats", str(mnt.mountpoint)).stdout
    assert "replaced 1 times on the live mount (last: crash" in table, table
    restarted = [e for e in _events(mnt) if e["event"] == "daemon_restarted"]
    assert len(restarted) == 1 and restarted[0]["cause"] == "crash"
    mnt.remount()  # what the successor committed is the store's for good
    assert (mnt.mountpoint / "small").read_bytes() == small
    assert (mnt.mountpoint / "big").read_bytes() == big
    _unmount_and_check(mnt)


HOLDER = textwrap.dedent(
    """
    import ctypes, os, sys
    lib = ctypes.CDLL(sys.argv[1])
    fd = os.open(sys.argv[2], os.O_RDONLY)
    want = os.pread(fd, 1 << 20, 0)
    print("ready", flush=True)
    calls = 0
    while sys.stdin.readline().strip() == "again":
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)  # the next read goes to the daemon
        assert os.pread(fd, 1 << 20, 0) == want, "the unlinked file changed"
        assert lib.answer() == 42
        calls += 1
        print(calls, flush=True)
    """
)


@pytest.mark.timeout(120)
def test_unlinked_open_file_and_mmapped_library_survive_a_takeover(mnt: Mount, tmp_path: Path):
    src = tmp_path / "answer.c"
    src.write_text("int answer(void) { return 42; }\n")
    subprocess.run(["gcc", "-shared", "-fPIC", "-o", str(tmp_path / "libanswer.so"), str(src)], check=True)
    shutil.copy(tmp_path / "libanswer.so", mnt.mountpoint / "libanswer.so.tmp")
    os.replace(mnt.mountpoint / "libanswer.so.tmp", mnt.mountpoint / "libanswer.so")
    (mnt.mountpoint / "data.tmp").write_bytes(os.urandom(300 * K))
    os.replace(mnt.mountpoint / "data.tmp", mnt.mountpoint / "data")
    holder = subprocess.Popen([sys.executable, "-c", HOLDER, str(mnt.mountpoint / "libanswer.so"),
                               str(mnt.mountpoint / "data")], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True)
    try:
        assert holder.stdout.readline().strip() == "ready"
        blobs_before = mnt.stats()["blobs"]
        os.unlink(mnt.mountpoint / "data")  # kept alive by the holder's open file
        os.unlink(mnt.mountpoint / "libanswer.so")  # kept alive by its mapping
        for round_ in (1, 2):
            kill_and_wait_for_successor(mnt)
            holder.stdin.write("again\n")
            holder.stdin.flush()
            assert holder.stdout.readline().strip() == str(round_)
        holder.stdin.close()
        assert holder.wait(timeout=30) == 0
    finally:
        if holder.poll() is None:
            holder.kill()
    # the holder gone, the kernel forgets both inodes: the successor frees them though it never counted them
    wait_for(lambda: mnt.stats()["blobs"] == blobs_before - 2, timeout=20, what="the unlinked files' blobs freed")
    _unmount_and_check(mnt)


def until_three_kills(killer: Killer, procs: list[subprocess.Popen[str]], stop: Path) -> list[str]:
    """Let a workload's *procs* run until the daemon was killed three times under them (or one of them
    ended), then tell them to end (*stop* created); their stderr.  One still running after is killed."""
    try:
        wait_for(lambda: killer.kills >= 3 or any(p.poll() is not None for p in procs), 200,
                 "three kills under the workload")
        stop.touch()
        return [p.communicate(timeout=200)[1] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()


#: Rounds of fsx (a seed each, the file truncated at each round's start) until the file *stop* exists: the
#: daemon is killed under a workload that lasts as long as the kills take, on a fast machine or a slow one
#: (a fixed 12,000 operations took under 6 s on a quick machine: two kills, not three).
FSX_RUNNER = textwrap.dedent(
    """
    import sys
    from pathlib import Path
    sys.path[:0] = [sys.argv[1], str(Path(sys.argv[1]).parent)]  # test_fsx and the conftest it imports
    from test_fsx import exercise
    seed, stop = int(sys.argv[3]), Path(sys.argv[5])
    while True:
        exercise(Path(sys.argv[2]), seed, int(sys.argv[4]))
        if stop.exists():
            break
        seed += 1000
    """
)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("seed", [1, 2])
def test_fsx_while_the_daemon_is_killed_every_two_seconds(mnt: Mount, seed: int, tmp_path: Path):
    path = mnt.mountpoint / f"fsx-{seed}"
    stop = tmp_path / "stop"
    with Killer(mnt) as killer:
        fsx = subprocess.Popen([sys.executable, "-c", FSX_RUNNER, str(Path(__file__).parent), str(path), str(seed),
                                "4000", str(stop)], stderr=subprocess.PIPE, text=True)
        [err] = until_three_kills(killer, [fsx], stop)
    assert fsx.returncode == 0, err[-3000:]
    assert killer.kills >= 3, f"only {killer.kills} kills during fsx"
    _unmount_and_check(mnt)


RENAMER = textwrap.dedent(
    """
    import hashlib, os, sys
    mp, me, stop = sys.argv[1], sys.argv[2], sys.argv[3]
    i = 0
    while not os.path.exists(stop):  # as long as the kills take: a time of its own was too short when loaded
        i += 1
        for name in ("a", "b", "c", "d"):
            body = os.urandom(1000 + (i * 7919) % 400000)
            tmp = os.path.join(mp, f"{name}.{me}.tmp")
            with open(tmp, "wb") as f:
                f.write(hashlib.sha256(body).digest() + body)
            os.replace(tmp, os.path.join(mp, name))
    """
)


@pytest.mark.timeout(300)
def test_eight_writers_renaming_onto_the_same_names_while_the_daemon_is_killed(mnt: Mount, tmp_path: Path):
    stop = tmp_path / "stop"
    with Killer(mnt) as killer:
        procs = [subprocess.Popen([sys.executable, "-c", RENAMER, str(mnt.mountpoint), str(w), str(stop)],
                                  stderr=subprocess.PIPE, text=True) for w in range(8)]
        errors = until_three_kills(killer, procs, stop)
    assert [p.returncode for p in procs] == [0] * 8, [e[-500:] for e in errors]
    assert killer.kills >= 3, f"only {killer.kills} kills while the writers ran"
    for name in ("a", "b", "c", "d"):
        data = (mnt.mountpoint / name).read_bytes()
        assert hashlib.sha256(data[32:]).digest() == data[:32], f"{name} is not whole"
    assert sorted(os.listdir(mnt.mountpoint)) == ["a", "b", "c", "d"]
    _unmount_and_check(mnt)


LOAD = textwrap.dedent(
    """
    import os, sys
    mp, progress, stop = sys.argv[1:4]
    n = 0
    while not os.path.exists(stop):  # until the test has seen it go on through both restarts
        body = os.urandom(2000 + n % 5000)
        with open(os.path.join(mp, f"t{n % 50}.tmp"), "wb") as f:
            f.write(body)
        os.replace(os.path.join(mp, f"t{n % 50}.tmp"), os.path.join(mp, f"f{n % 50}"))
        assert open(os.path.join(mp, f"f{n % 50}"), "rb").read() == body
        os.listdir(mp)
        n += 1
        if n % 10 == 0:
            with open(progress + ".tmp", "w") as f:
                f.write(str(n))
            os.replace(progress + ".tmp", progress)
    print(n)
    """
)


@pytest.mark.timeout(180)
def test_restart_under_load_fails_nothing_and_runs_the_installed_code(mount_factory: MountFactory, tmp_path: Path):
    # the daemon runs from a copy of the package: "upgrading" it is editing that copy
    installed = tmp_path / "installed"
    shutil.copytree(REPO / "mithrilfs", installed / "mithrilfs", ignore=shutil.ignore_patterns("__pycache__"))
    m = mount_factory("up", env={"PYTHONPATH": str(installed)})
    version = json.loads(run_cli("status", "--json", str(m.mountpoint)).stdout)["version"]
    progress, stop = tmp_path / "progress", tmp_path / "stop"
    load = subprocess.Popen([sys.executable, "-c", LOAD, str(m.mountpoint), str(progress), str(stop)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)

    def done() -> int:
        try:
            return int(progress.read_text())
        except (OSError, ValueError):
            return 0

    def goes_on(what: str) -> None:  # a condition, not a time: 20 more round trips of the load
        at = done()
        wait_for(lambda: done() >= at + 20 or load.poll() is not None, 60, what)

    try:
        goes_on("the load running")
        init = installed / "mithrilfs" / "__init__.py"
        init.write_text(init.read_text().replace(f'__version__ = "{version}"', '__version__ = "99.0.0+upgraded"'))
        old = m.pid
        res = run_cli("restart", str(m.mountpoint), env=dict(os.environ, PYTHONPATH=str(installed)))
        assert res.returncode == 0, res.stderr
        assert "99.0.0+upgraded" in res.stdout, res.stdout
        goes_on("the load going on after the restart")
        assert run_cli("restart", str(m.mountpoint)).returncode == 0  # twice, under the same load
        goes_on("the load going on after the second restart")
        stop.touch()
        out, err = load.communicate(timeout=60)
    finally:
        if load.poll() is None:
            load.kill()
            load.wait()
    assert load.returncode == 0, err[-3000:]
    assert int(out) > 50  # it kept working throughout
    status = json.loads(run_cli("status", "--json", str(m.mountpoint)).stdout)
    assert status["version"] == "99.0.0+upgraded" and status["pid"] not in (old, None)
    assert status["restarts"] == 2 and status["last_restart_cause"] == "restart"
    m.pid = status["pid"]
    _unmount_and_check(m)


def _status(m: Mount) -> dict:
    return json.loads(run_cli("status", "--json", str(m.mountpoint)).stdout)


@pytest.mark.timeout(120)
def test_a_killed_supervisor_shows_in_status_and_restart_is_refused_losing_nothing(mnt: Mount):
    """kill -9 of the supervisor: nobody would start a successor.  ``status`` says so, ``restart`` is refused
    in one line while the daemon serves on, and a file written meanwhile survives the next mount."""
    supervisor = supervisor_pid(mnt.mountpoint)
    assert supervisor is not None and _status(mnt)["supervisor"] == "alive"
    os.kill(supervisor, signal.SIGKILL)
    wait_for(lambda: not pid_alive(supervisor), timeout=10, what="the supervisor died")
    wait_for(lambda: _status(mnt).get("supervisor") == "gone", timeout=10, what="status to say so")
    status = run_cli("status", str(mnt.mountpoint))
    assert status.returncode == 0 and "supervisor is gone" in status.stdout, status.stdout
    with open(mnt.mountpoint / "written", "wb") as f:  # not fsynced: unconfirmed until the unmount
        f.write(b"written after the supervisor died")
    res = run_cli("restart", str(mnt.mountpoint))
    assert res.returncode == 1, res.stdout + res.stderr
    assert "supervisor is gone" in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr
    # the daemon refuses too, whoever asks (an older CLI, a script writing the control file)
    control = mnt.mountpoint / ".mithrilfs" / "restart"
    control.write_text("restart")
    assert json.loads(control.read_text())["restarting"] is False
    assert daemon_pid(mnt.mountpoint) == mnt.pid
    assert (mnt.mountpoint / "written").read_bytes() == b"written after the supervisor died"
    assert "supervisor of this mount is gone" in (mnt.store / "mithrilfs.log").read_text()
    mnt.remount()
    assert (mnt.mountpoint / "written").read_bytes() == b"written after the supervisor died"


def _broken_copy(tmp_path: Path) -> Path:
    """A copy of the package to run the daemon from, and the path of its ``__init__.py`` (to break)."""
    installed = tmp_path / "installed"
    shutil.copytree(REPO / "mithrilfs", installed / "mithrilfs", ignore=shutil.ignore_patterns("__pycache__"))
    return installed


@pytest.mark.timeout(120)
def test_restart_onto_a_broken_install_is_refused_and_the_old_daemon_serves_on(mount_factory: MountFactory,
                                                                               tmp_path: Path):
    """The installed code is checked before the daemon hands over: a syntax error in it must never give the
    mount up (three successors dying at start would) nor lose a file written just before."""
    installed = _broken_copy(tmp_path)
    m = mount_factory("broken", env={"PYTHONPATH": str(installed)})
    write_committed(m.mountpoint / "committed", b"committed before")
    with open(m.mountpoint / "written", "wb") as f:  # not fsynced: a restart would commit it unconfirmed
        f.write(b"written just before the restart")
    init = installed / "mithrilfs" / "__init__.py"
    good = init.read_text()
    init.write_text(good + "\nthis is no python (\n")  # a broken upgrade of the daemon's install
    res = run_cli("restart", str(m.mountpoint))  # the CLI of this checkout: it runs, the install does not
    assert res.returncode == 1, res.stdout + res.stderr
    assert "does not start" in res.stderr and "SyntaxError" in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert daemon_pid(m.mountpoint) == m.pid and _status(m)["restarts"] == 0
    assert (m.mountpoint / "written").read_bytes() == b"written just before the restart"
    (m.mountpoint / "after").write_bytes(b"the old daemon serves on")
    assert "SyntaxError" in (m.store / "mithrilfs.log").read_text()
    init.write_text(good)
    m.remount()
    for name, data in (("committed", b"committed before"), ("written", b"written just before the restart"),
                       ("after", b"the old daemon serves on")):
        assert (m.mountpoint / name).read_bytes() == data
    _unmount_and_check(m)


@pytest.mark.timeout(120)
def test_a_successor_that_dies_at_import_leaves_its_traceback_in_the_log(mount_factory: MountFactory,
                                                                          tmp_path: Path):
    """A crash's successors start from the installed code: when it is broken, why they die is in the log."""
    installed = _broken_copy(tmp_path)
    m = mount_factory("tb", env={"PYTHONPATH": str(installed)})
    write_committed(m.mountpoint / "committed", b"committed before")
    init = installed / "mithrilfs" / "__init__.py"
    good = init.read_text()
    init.write_text(good + "\nthis is no python (\n")
    os.kill(m.pid, signal.SIGKILL)
    m.pid = None
    wait_unmounted(m.mountpoint, timeout=60)  # every successor dies at start: the mount is given up
    log = (m.store / "mithrilfs.log").read_text()
    assert "SyntaxError" in log and "Traceback" in log, log[-3000:]
    init.write_text(good)
    m.mount()
    assert (m.mountpoint / "committed").read_bytes() == b"committed before"


def test_restart_with_a_timeout_of_zero_is_bad_usage_and_restarts_nothing(mnt: Mount):
    res = run_cli("restart", str(mnt.mountpoint), "--timeout", "0")
    assert res.returncode == 2 and "more than 0" in res.stderr, res.stderr
    assert len(res.stderr.strip().splitlines()) == 1, res.stderr
    assert daemon_pid(mnt.mountpoint) == mnt.pid and _status(mnt)["restarts"] == 0


@pytest.mark.timeout(120)
def test_a_daemon_that_dies_at_every_start_is_given_up_and_status_says_why(mount_factory: MountFactory):
    m = mount_factory("loop", env={"MITHRILFS_TEST_CRASH_AT": "takeover"})
    (m.mountpoint / "kept").write_bytes(b"committed before the crash loop")
    os.replace(m.mountpoint / "kept", m.mountpoint / "kept2")
    os.kill(m.pid, signal.SIGKILL)
    m.pid = None
    wait_unmounted(m.mountpoint, timeout=60)
    status = run_cli("status", str(m.mountpoint))
    assert status.returncode == 1
    assert f"{CRASH_LOOP_LIMIT} new daemons in a row died" in status.stdout, status.stdout
    given_up = [e for e in _events(m) if e["event"] == "daemon_given_up"]
    assert len(given_up) == 1 and given_up[0]["restarts"] == CRASH_LOOP_LIMIT
    assert "new daemons in a row died" in (m.store / "mithrilfs.log").read_text()
    assert not is_mounted(m.mountpoint)
    m.env = None
    m.mount()  # a fresh mount after the loop: the store recovers as after any crash
    assert (m.mountpoint / "kept2").read_bytes() == b"committed before the crash loop"
    assert "detached" not in run_cli("status", str(m.mountpoint)).stdout


@pytest.mark.timeout(60)
def test_a_daemon_killed_between_init_and_its_announcement_is_taken_over(mount_factory: MountFactory):
    """Once INIT is answered programs may use the mount (CI found one that did): the first daemon dying
    before it said it serves must neither detach the mount nor fail the mount command."""
    m = mount_factory("early", env={"MITHRILFS_TEST_CRASH_AT": "before_announce"})  # the CLI exits 0
    stats = m.stats()
    assert stats["restarts"] == 1 and stats["last_restart_cause"] == "crash"
    (m.mountpoint / "after").write_bytes(b"served by the successor")
    assert (m.mountpoint / "after").read_bytes() == b"served by the successor"
    assert [e["event"] for e in _events(m)].count("daemon_given_up") == 0
    _unmount_and_check(m)


@pytest.mark.timeout(60)
def test_a_daemon_killed_before_init_fails_the_mount_at_once_with_the_reason(tmp_path: Path):
    """Nothing to take over: mount says why in one line, without waiting for a successor that never comes."""
    mp, store = tmp_path / "mnt", tmp_path / "store"
    mp.mkdir()
    start = time.monotonic()
    res = run_cli("mount", str(mp), "--store", str(store), env=dict(os.environ, MITHRILFS_TEST_CRASH_AT="before_init"))
    assert res.returncode == 1 and time.monotonic() - start < 30
    assert "before INIT was answered" in res.stderr and len(res.stderr.strip().splitlines()) == 1, res.stderr
    wait_unmounted(mp)


@pytest.mark.timeout(120)
def test_a_kill_inside_a_commit_never_lets_the_successor_write_into_a_blob(mount_factory: MountFactory):
    """The commit of a file staged on disk links the staging file into objects/; killed right after, the
    daemon hands its descriptor on.  The writer going on must not change the blob another file uses."""
    m = mount_factory("alias", env={"MITHRILFS_TEST_CRASH_AT": "after_set_content:2"})
    data = os.urandom(3 * MEM_STAGING_MAX)
    (m.mountpoint / "b.tmp").write_bytes(data)
    os.replace(m.mountpoint / "b.tmp", m.mountpoint / "b")  # commit 1: b's blob
    old = m.pid
    with open(m.mountpoint / "a", "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())  # commit 2: the same bytes; the daemon dies inside it
        wait_for(lambda: not pid_alive(old), timeout=10, what="the crash point")
        f.write(b"more")  # to the successor
    m.pid = daemon_pid(m.mountpoint)
    assert m.pid != old
    assert (m.mountpoint / "b").read_bytes() == data
    assert (m.mountpoint / "a").read_bytes() == data + b"more"
    _unmount_and_check(m)


@pytest.mark.timeout(120)
def test_a_kill_as_a_committed_file_is_written_again_keeps_its_content(mount_factory: MountFactory):
    """Writing into a committed file stages a copy of its content in memory, mirrored for a successor: a
    daemon killed as the mirror is handed out must leave the successor the whole copy, never a mirror
    named for the file before the copy is in it (the resent write would then land on nothing)."""
    m = mount_factory("mirror-copy", env={"MITHRILFS_TEST_CRASH_AT": "mirror_taken:2"})
    old_bytes = os.urandom(MEM_STAGING_MAX // 8)
    (m.mountpoint / "f.tmp").write_bytes(old_bytes)
    os.replace(m.mountpoint / "f.tmp", m.mountpoint / "f")  # committed: mirror 1
    old = m.pid
    with open(m.mountpoint / "f", "r+b") as f:
        f.write(b"Y")
        f.flush()  # its staging copy takes mirror 2: the daemon dies there, the successor gets the write again
        wait_for(lambda: not pid_alive(old), timeout=10, what="the crash point")
        os.fsync(f.fileno())
    m.pid = daemon_pid(m.mountpoint)
    assert m.pid != old
    assert (m.mountpoint / "f").read_bytes() == b"Y" + old_bytes[1:]
    _unmount_and_check(m)


@pytest.mark.timeout(120)
def test_a_file_renamed_as_its_daemon_died_survives_a_second_crash(mount_factory: MountFactory):
    """Killed after a rename's commit and before it let go of the file's mirror, the daemon hands the mirror
    on: the successor must not stage that committed content again, whose idle commit would be unconfirmed
    and dropped by the next unclean stop, taking a name the rename had published."""
    m = mount_factory("twice", env={"MITHRILFS_TEST_CRASH_AT": "after_set_content:1"})
    data = os.urandom(MEM_STAGING_MAX // 8)
    old = m.pid
    (m.mountpoint / "f.tmp").write_bytes(data)
    os.replace(m.mountpoint / "f.tmp", m.mountpoint / "f")  # the daemon dies inside; the successor answers it
    wait_for(lambda: not pid_alive(old), timeout=10, what="the crash point")
    m.pid = daemon_pid(m.mountpoint)
    assert m.pid not in (None, old)
    wait_for(lambda: m.stats()["written_files"] == 0, timeout=30, what="nothing left to commit")
    supervisor = supervisor_pid(m.mountpoint)
    assert supervisor is not None
    for pid in (supervisor, m.pid):  # an unclean stop: nobody takes over
        os.kill(pid, signal.SIGKILL)
        wait_for(lambda pid=pid: not pid_alive(pid), timeout=10, what="the kill")
    subprocess.run(["fusermount3", "-u", "-z", str(m.mountpoint)], capture_output=True)
    wait_unmounted(m.mountpoint)
    m.pid, m.env = None, None
    m.mount()
    assert (m.mountpoint / "f").read_bytes() == data
    assert not (m.mountpoint / "f.tmp").exists()
    _unmount_and_check(m)


@pytest.mark.timeout(120)
def test_a_daemon_with_a_low_descriptor_limit_stages_thousands_of_files(mount_factory: MountFactory,
                                                                         tmp_path: Path):
    """Each file staged in memory holds a memfd for a successor: the daemon raises its own descriptor
    limit, so thousands of small files written at once never fail with EMFILE."""
    import resource

    hard = resource.getrlimit(resource.RLIMIT_NOFILE)[1]
    mp, store = tmp_path / "low-mnt", tmp_path / "low-store"
    mp.mkdir()
    res = subprocess.run(["prlimit", f"--nofile=256:{hard}", sys.executable, "-m", "mithrilfs", "mount", str(mp),
                          "--store", str(store)], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    m = Mount(mp, store, pid=daemon_pid(mp))
    mount_factory.mounts.append(m)
    bodies = {f"f{i}": os.urandom(100 + i % 3000) for i in range(2000)}
    for name, body in bodies.items():
        (mp / name).write_bytes(body)
    for name, body in bodies.items():
        assert (mp / name).read_bytes() == body
    assert "no mirror" not in (store / "mithrilfs.log").read_text()
    _unmount_and_check(m)


@pytest.mark.timeout(180)
def test_eviction_after_a_takeover_frees_the_disk(mount_factory: MountFactory):
    """A successor knows exactly which inodes the kernel holds (the counts are in shared memory): what it
    evicts and nobody holds leaves the disk at once, so the budget holds after a takeover too."""
    budget = 4 << 20
    m = mount_factory("evict", "--max-size", str(budget), "--min-age", "0")
    for i in range(12):
        (m.mountpoint / f"old{i}.tmp").write_bytes(os.urandom(256 * K))
        os.replace(m.mountpoint / f"old{i}.tmp", m.mountpoint / f"old{i}")
    m.remount()  # the kernel forgets them all; the new daemon never hands them out
    kill_and_wait_for_successor(m)
    for i in range(40):
        (m.mountpoint / f"new{i}.tmp").write_bytes(os.urandom(256 * K))
        os.replace(m.mountpoint / f"new{i}.tmp", m.mountpoint / f"new{i}")
    wait_for(lambda: m.stats()["physical_bytes"] <= budget, timeout=30, what="the budget kept")
    assert sum(p.stat().st_size for p in (m.store / "objects").rglob("*") if p.is_file()) <= budget
    _unmount_and_check(m)


@pytest.mark.timeout(120)
def test_a_file_created_as_its_daemon_died_is_put_back_by_the_successor(mount_factory: MountFactory):
    """A CREATE is answered before its transaction commits (with the next one, or when the daemon is idle):
    killed before that commit, the daemon leaves the create in the journal its supervisor holds, and the
    successor puts the file back under the inode the kernel was given, so the writer writes, closes and
    renames it as if nothing happened; ids are never handed out twice."""
    m = mount_factory("created", env={"MITHRILFS_TEST_CRASH_AT": "before_deferred_commit"})
    data = os.urandom(3 * K)
    old = m.pid
    with open(m.mountpoint / "k.tmp", "wb") as f:  # the daemon dies at its first idle moment after this
        wait_for(lambda: not pid_alive(old), timeout=10, what="the crash point")
        f.write(data)
    os.replace(m.mountpoint / "k.tmp", m.mountpoint / "k")
    m.pid = daemon_pid(m.mountpoint)
    assert m.pid not in (None, old)
    assert sorted(os.listdir(m.mountpoint)) == ["k"]
    assert (m.mountpoint / "k").read_bytes() == data
    (m.mountpoint / "other").write_bytes(b"x")  # a new inode: never the id the kernel holds for k
    assert os.stat(m.mountpoint / "other").st_ino != os.stat(m.mountpoint / "k").st_ino
    assert (m.mountpoint / "k").read_bytes() == data
    _unmount_and_check(m)
