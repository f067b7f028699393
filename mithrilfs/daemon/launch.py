"""Mounting, as the ``mount`` command runs it: fork the daemon, wait until the mount answers, stay in the foreground.

``mount`` forks before any trio or FUSE state exists.  The child mounts,
starts its supervisor (``daemon.supervisor``: it holds a copy of the fd
and replaces a daemon that dies; it learns the session as soon as INIT is
answered), proves the mount answers by reading a control file from a
process of its own (which goes through the kernel to our own handlers),
and only then writes ``ok`` down a pipe; the parent exits 0 on ``ok``,
also when the pipe closes without it but a successor took the mount over
(the first daemon died after INIT), and prints the child's one-line error
otherwise.  With
``--foreground`` the parent stays instead, until the mount is gone,
passing SIGTERM/SIGINT to whichever daemon serves then: so a container or
a systemd unit sees one process whatever the daemons underneath do.

The child starts with no signal blocked, whatever its parent blocks.
The daemon the child becomes is ``daemon.serve``; the checks on the mount
point, made before forking, are ``daemon.mountpoint``'s.
"""

from __future__ import annotations

import errno
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any

from mithrilfs.control.files import CONTROL_NAME
from mithrilfs.daemon import ended
from mithrilfs.daemon.announce import READY_READ_ONLY
from mithrilfs.daemon.mountpoint import check_mountpoint, daemon_pid
from mithrilfs.daemon.options import MountOptions
from mithrilfs.daemon.process import call_within, pid_alive
from mithrilfs.daemon.serve import serve, setup_logging
from mithrilfs.daemon.umount import wait_store_free
from mithrilfs.errors import MountError
from mithrilfs.kernel.mount import FSTYPE, mount_entries
from mithrilfs.store.open import holder_record

READY_TIMEOUT = 60.0
#: How long ``--foreground`` waits, once the mount is gone, for its daemon and supervisor to close the store.
SHUTDOWN_TIMEOUT = 120.0


def mount(opts: MountOptions) -> int:
    """Mount and return the exit status for the CLI (0 once the mount answers)."""
    check_mountpoint(opts.mountpoint, opts.store, nonempty=opts.nonempty)
    # resolved before anything is mounted there: a path through a mount whose daemon is gone would wait
    target = os.path.realpath(opts.mountpoint)
    ended.clear(target)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the daemon
        # a daemon hears SIGTERM whatever its parent held blocked (``run`` holds it while it mounts)
        signal.pthread_sigmask(signal.SIG_SETMASK, ())
        os.close(r)
        if opts.foreground:
            setup_logging(None, opts.debug)  # stderr stays the terminal's (or the container's)
        else:
            os.setsid()
            _detach_stdio()
        code = 1
        try:

            def announce(msg: str) -> None:
                try:
                    os.write(w, (msg + "\n").encode())
                except OSError:
                    pass

            code = serve(opts, announce, log_in_store=not opts.foreground)
        finally:
            os._exit(code)
    os.close(w)
    asked: list[int] = []
    if opts.foreground:  # from now on a signal is for the daemon (passed on once it serves)
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(signum, lambda signum, _: asked.append(signum))
    msg = _read_line(r, READY_TIMEOUT)
    os.close(r)
    if msg is not None and msg.startswith("ok"):
        return _mounted(opts, target, pid, asked, read_only=msg == READY_READ_ONLY)
    if msg is None:
        os.kill(pid, signal.SIGTERM)
        raise MountError(f"the mount did not answer within {READY_TIMEOUT:.0f} s")
    successor = _successor_serving(target, opts.store, pid) if not msg else None
    if successor is not None:
        return _mounted(opts, target, pid, asked, read_only=bool(successor.get("read_only")),
                        note="its first daemon died at start; daemon "
                             f"{successor['pid']} took the mount over")
    os.waitpid(pid, 0)
    raise MountError(msg or ended.read(target) or "the daemon exited before the mount was ready")


def _mounted(opts: MountOptions, target: str, first: int, asked: list[int], *, read_only: bool,
             note: str = "") -> int:
    """The mount serves: say so (in the foreground, or with a *note*) and, in the foreground, stay."""
    if opts.foreground or note:
        print(f"mithrilfs: mounted {opts.mountpoint} (store {opts.store}{'; ' + note if note else ''})",
              file=sys.stderr, flush=True)
    if read_only:
        print(read_only_notice(opts.store), file=sys.stderr, flush=True)
    return _stay_in_foreground(opts, target, first, asked) if opts.foreground else 0


def _successor_serving(target: str, store: Path, first: int) -> dict[str, Any] | None:
    """The first daemon died without announcing: the stats of the successor once one serves the mount
    of *store*; None when the mount is gone (its supervisor gave it up), dead (none was started) or
    unserved for READY_TIMEOUT.

    A daemon that dies after INIT leaves a mount that programs may already use; its supervisor
    takes it over like any other crash, so the mount command succeeds too.  Nothing here waits on
    the mount outside ``call_within``: until a successor reads, every request to it waits.
    """
    want = os.path.realpath(store)
    deadline = time.monotonic() + READY_TIMEOUT
    while time.monotonic() < deadline:
        if not any(fstype == FSTYPE for _, _, fstype in mount_entries(target)):
            return None
        answer = call_within(lambda: _serving_stats(target), 1.0)
        if answer == "dead":
            return None
        if (isinstance(answer, dict) and answer.get("pid") not in (first, None)
                and os.path.realpath(str(answer.get("store"))) == want):
            return answer
        time.sleep(0.05)
    return None


def _serving_stats(target: str) -> dict[str, Any] | str | None:
    """The stats of the daemon serving the mount at *target*; 'dead' when none ever will; None: not yet."""
    try:
        stats = json.loads((Path(target) / CONTROL_NAME.decode() / "stats.json").read_text())
    except OSError as e:
        # ENOTCONN: nobody holds the connection; ECONNABORTED: a request queued as it was lost
        return "dead" if e.errno in (errno.ENOTCONN, errno.ECONNABORTED) else None
    except ValueError:
        return None
    return stats if isinstance(stats, dict) else None


def _stay_in_foreground(opts: MountOptions, target: str, first: int, asked: list[int]) -> int:
    """``--foreground``: wait until the mount is gone and its store closed; SIGTERM/SIGINT/SIGHUP (*asked*)
    go to the daemon serving then.

    0 after an unmount, 1 when the supervisor gave the mount up (``status`` says why).
    """
    while True:
        try:
            os.waitpid(first, os.WNOHANG)  # the first daemon is our child: no zombie
        except ChildProcessError:
            pass
        if not any(fstype == FSTYPE for _, _, fstype in mount_entries(target)):
            # the daemon goes on closing the store (the last commits, recency, marked clean) and the
            # supervisor holds its lock a moment longer: a container's main process exiting now would
            # have the runtime kill them half-way, and the next start recover as after a crash
            if not wait_store_free(opts.store, time.monotonic() + SHUTDOWN_TIMEOUT):
                print(f"mithrilfs: warning: the store {opts.store} is still locked {SHUTDOWN_TIMEOUT:.0f} s "
                      "after the unmount; exiting anyway", file=sys.stderr, flush=True)
            return 1 if ended.read(target) else 0
        if asked:
            held = holder_record(opts.store)
            # a read-only store keeps no holder file
            pid = held["pid"] if held is not None else daemon_pid(opts.mountpoint)
            # during a takeover the holder may still name the dead daemon: the signal waits for the next
            if pid is not None and pid_alive(pid):
                asked.clear()
                try:
                    os.kill(pid, signal.SIGTERM)
                except OSError:
                    pass
        time.sleep(0.1)


def read_only_notice(store: Path) -> str:
    return (f"mithrilfs: note: the store {store} is on a read-only filesystem: mounted read-only"
            " (cached files are served; writes fail with EROFS)")


def _read_line(fd: int, timeout: float) -> str | None:
    """The first line from *fd*; '' on EOF, None on timeout."""
    import select

    deadline = time.monotonic() + timeout
    buf = b""
    while b"\n" not in buf:
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        ready, _, _ = select.select([fd], [], [], left)
        if not ready:
            continue
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        buf += chunk
    return buf.split(b"\n", 1)[0].decode(errors="replace")


def _detach_stdio() -> None:
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    os.close(devnull)
