"""``mithrilfs run`` stopped by a signal: SIGTERM and SIGHUP as SIGINT (the command stopped, then the mount,
the headers link and the temporary directory taken down), SIGKILL by the mount's supervisor; every time the
next ``run`` works with the same default store."""

from __future__ import annotations

import contextlib
import os
import pty
import select
import signal
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
from conftest import (
    CLI,
    Mount,
    MountFactory,
    daemon_pid,
    is_mounted,
    pid_alive,
    run_cli,
    supervisor_pid,
    wait_for,
)

from mithrilfs.jitcaches import catalog

pytestmark = pytest.mark.timeout(240)


@dataclass
class Started:
    """A ``run`` whose command is running, and what it set up."""

    proc: subprocess.Popen
    mountpoint: Path
    daemon: int
    supervisor: int
    command: int


def _isolated(tmp_path: Path) -> dict[str, str]:
    """An environment whose default store, temporary directory and headers link are the test's own, with
    a headers link there already (``run`` must put it back)."""
    (tmp_path / "home").mkdir()
    (tmp_path / "tmp").mkdir()
    env = dict(os.environ, HOME=str(tmp_path / "home"), XDG_CACHE_HOME=str(tmp_path / "home" / ".cache"),
               TMPDIR=str(tmp_path / "tmp"))
    link = catalog.headers_link(env)
    link.parent.mkdir(parents=True)
    link.symlink_to(tmp_path / "earlier-headers")
    return env


def _run_dirs(env: dict[str, str]) -> list[Path]:
    return sorted(Path(env["TMPDIR"]).glob("mithrilfs-run-*"))


def _track(factory: MountFactory, env: dict[str, str], mp: Path) -> int | None:
    """The pid of the daemon of ``run``'s mount at *mp*, which the factory cleans up whatever happens."""
    daemon = daemon_pid(mp)
    factory.mounts.append(Mount(mp, Path(env["XDG_CACHE_HOME"]) / "mithrilfs", pid=daemon))
    return daemon


def _dispositions(ignored: frozenset[signal.Signals]) -> Callable[[], None]:
    """In the child before its exec: the signals ``run`` relays at their default, but *ignored*, as a shell
    starts a foreground command (this suite may itself run ignoring some: under ``nohup``, in the
    background)."""
    def reset() -> None:
        for s in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
            signal.signal(s, signal.SIG_IGN if s in ignored else signal.SIG_DFL)

    return reset


def _start(argv: list[str], env: dict[str, str], tmp_path: Path, factory: MountFactory, *,
           ignored: frozenset[signal.Signals] = frozenset(),
           meanwhile: Callable[[subprocess.Popen], None] = lambda proc: None) -> Started:
    """Start *argv* (a ``run`` of a shell that writes its pid, then sleeps) with the relayed signals at their
    default but *ignored*, and wait until its command runs, calling *meanwhile* at each look."""
    pidfile = tmp_path / "command.pid"
    proc = subprocess.Popen([*argv, "sh", "-c", f'echo $$ > {pidfile}.tmp && mv {pidfile}.tmp {pidfile}; '
                             "exec sleep 300"], env=env, stderr=subprocess.PIPE, text=True,
                            preexec_fn=_dispositions(ignored))

    def started() -> bool:
        meanwhile(proc)
        return pidfile.exists() or proc.poll() is not None

    wait_for(started, 120, "the command to start under run")
    assert proc.poll() is None, proc.communicate()[1]
    (mp,) = _run_dirs(env)
    assert is_mounted(mp)
    daemon, supervisor = _track(factory, env, mp), supervisor_pid(mp)
    assert daemon is not None and supervisor is not None
    assert os.readlink(catalog.headers_link(env)) == str(mp / catalog.HEADERS.subdir)
    return Started(proc, mp, daemon, supervisor, int(pidfile.read_text()))


def _all_taken_down(started: Started, env: dict[str, str], tmp_path: Path) -> bool:
    return (not is_mounted(started.mountpoint) and not pid_alive(started.daemon)
            and not pid_alive(started.supervisor) and not _run_dirs(env)
            and os.readlink(catalog.headers_link(env)) == str(tmp_path / "earlier-headers"))


def _command_stopped_and_all_taken_down(started: Started, env: dict[str, str], tmp_path: Path) -> None:
    """The command ended before ``run`` did, nothing of the mount is left, and the next ``run`` works."""
    assert not pid_alive(started.command)
    wait_for(lambda: _all_taken_down(started, env, tmp_path), 30, "the mount, daemon, link and directory to go")
    res = run_cli("run", "--", "true", env=env)
    assert res.returncode == 0, res.stderr


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGHUP, signal.SIGINT])
def test_a_signal_stops_the_command_then_takes_everything_down(sig, mount_factory: MountFactory, tmp_path):
    """SIGTERM (``timeout``, Slurm, ``docker stop``, Kubernetes) and SIGHUP used to kill ``run`` outright: the
    mount, its daemon, the headers link into it and the directory stayed, the command ran on, and every later
    ``run`` failed "store is in use".  SIGINT took the mount down before too, but killed the command with
    SIGKILL 0.25 s later (``subprocess.run``'s KeyboardInterrupt) and said nothing of it."""
    env = _isolated(tmp_path)
    started = _start([*CLI, "run", "--"], env, tmp_path, mount_factory)
    os.kill(started.proc.pid, sig)
    _, err = started.proc.communicate(timeout=120)
    assert started.proc.returncode == 128 + sig, err
    assert f"killed by signal {int(sig)}" in err and "Traceback" not in err, err
    _command_stopped_and_all_taken_down(started, env, tmp_path)


def test_a_signal_run_was_started_ignoring_stops_nothing(mount_factory: MountFactory, tmp_path):
    """``nohup mithrilfs run -- CMD``: hangups sent all through the mount (a terminal closing) neither stop
    ``run`` nor keep the command from starting, and the command ignores them too; SIGTERM still stops it."""
    env = _isolated(tmp_path)
    hangups = []

    def hang_up(proc: subprocess.Popen) -> None:
        if proc.poll() is None:
            os.kill(proc.pid, signal.SIGHUP)
            hangups.append(1)

    started = _start([*CLI, "run", "--"], env, tmp_path, mount_factory, ignored=frozenset({signal.SIGHUP}),
                     meanwhile=hang_up)
    os.kill(started.proc.pid, signal.SIGHUP)
    assert len(hangups) >= 2 and started.proc.poll() is None and pid_alive(started.command)
    os.kill(started.proc.pid, signal.SIGTERM)
    _, err = started.proc.communicate(timeout=120)
    assert started.proc.returncode == 128 + signal.SIGTERM, err
    assert "came before the command started" not in err and "Traceback" not in err, err
    _command_stopped_and_all_taken_down(started, env, tmp_path)


def test_timeout_stops_run_cleanly(mount_factory: MountFactory, tmp_path):
    """The issue's own case, ``timeout N mithrilfs run -- sleep``: ``timeout`` signals ``run`` and its process
    group when N runs out."""
    env = _isolated(tmp_path)
    started = _start(["timeout", "20", *CLI, "run", "--"], env, tmp_path, mount_factory)
    _, err = started.proc.communicate(timeout=120)
    assert started.proc.returncode == 124, err  # timeout's own "timed out"
    assert "Traceback" not in err, err
    _command_stopped_and_all_taken_down(started, env, tmp_path)


def test_after_sigkill_the_supervisor_takes_the_mount_down(mount_factory: MountFactory, tmp_path):
    """SIGKILL cannot be caught: the mount's supervisor sees ``run`` end and takes down what it set up, and
    a next ``run`` that comes first waits for the store instead of failing "store is in use" (the supervisor
    is held stopped until it does).  The command runs on, as any process whose parent is killed does."""
    env = _isolated(tmp_path)
    started = _start([*CLI, "run", "--"], env, tmp_path, mount_factory)
    following = None
    try:
        os.kill(started.supervisor, signal.SIGSTOP)
        os.kill(started.proc.pid, signal.SIGKILL)
        started.proc.wait(timeout=60)  # not its stderr: the command holds that open
        started.proc.stderr.close()
        with open(tmp_path / "next.err", "w") as err:
            following = subprocess.Popen([*CLI, "run", "--", "true"], env=env, stderr=err)
        said = lambda: "waiting for the mount of an ended run" in (tmp_path / "next.err").read_text()  # noqa: E731
        wait_for(lambda: said() or following.poll() is not None, 120, "the next run to wait for the store")
        assert said(), (tmp_path / "next.err").read_text()
        os.kill(started.supervisor, signal.SIGCONT)
        assert following.wait(timeout=120) == 0, (tmp_path / "next.err").read_text()
        wait_for(lambda: _all_taken_down(started, env, tmp_path), 30, "the mount, daemon, link and directory to go")
        assert pid_alive(started.command)
    finally:
        for pid, sig in ((started.supervisor, signal.SIGCONT), (started.command, signal.SIGKILL)):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, sig)
        if following is not None and following.poll() is None:
            following.kill()
            following.wait()


#: A command that cleans up for a while on SIGINT, counting each it gets, then exits 7.
_CAREFUL = """
import signal, sys, time
got = []
signal.signal(signal.SIGINT, lambda *_: got.append(print(f"command got SIGINT #{len(got) + 1}", flush=True)))
print("command ready", flush=True)
while not got:
    time.sleep(0.01)
end = time.monotonic() + 1.0  # its clean-up, which a second SIGINT would interrupt
while time.monotonic() < end:
    time.sleep(0.01)
print(f"command done after {len(got)} SIGINT", flush=True)
sys.exit(7)
"""


def test_ctrl_c_on_a_terminal_reaches_the_command_once(mount_factory: MountFactory, tmp_path):
    """A terminal's Ctrl-C goes to its whole foreground process group, the command included: ``run`` sends
    no second SIGINT, waits for the command's own clean-up and exits with its status.  (Before, ``run``
    killed the command with SIGKILL 0.25 s after the Ctrl-C.)"""
    env = _isolated(tmp_path)
    (tmp_path / "careful.py").write_text(_CAREFUL)
    pid, fd = pty.fork()
    if pid == 0:  # on a terminal of its own, as a user's shell runs it
        os.execve(sys.executable, [*CLI, "run", "--", sys.executable, str(tmp_path / "careful.py")], env)
    out = bytearray()
    ended: list[int] = []  # run's wait status, once it has exited

    def drain() -> None:
        """What the terminal has shown since, and whether run has exited."""
        while select.select([fd], [], [], 0)[0]:
            try:
                chunk = os.read(fd, 4096)
            except OSError:  # EIO: the terminal's last process is gone
                break
            if not chunk:
                break
            out.extend(chunk)
        if not ended:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                ended.append(status)

    try:
        wait_for(lambda: drain() or b"command ready" in out or bool(ended), 120, "the command to start under run")
        assert not ended, out.decode(errors="replace")
        (mp,) = _run_dirs(env)
        _track(mount_factory, env, mp)
        os.write(fd, b"\x03")  # Ctrl-C, typed
        wait_for(lambda: drain() or bool(ended), 60, "run to end")
        drain()
    finally:
        if not ended:
            os.kill(pid, signal.SIGKILL)
            os.waitpid(pid, 0)
        os.close(fd)
    text = out.decode(errors="replace")
    assert "command done after 1 SIGINT" in text, text  # one SIGINT, and its clean-up not cut short
    assert "exit status 7" in text and os.waitstatus_to_exitcode(ended[0]) == 7, text
    wait_for(lambda: not is_mounted(mp) and not _run_dirs(env), 30, "the mount and directory to go")
