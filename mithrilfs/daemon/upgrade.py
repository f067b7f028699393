"""``restart``: hand the live mount to a new daemon of the installed code, but only to one that can start.

The successor is started by the supervisor with the interpreter and the
environment the mount was made with (this daemon's own: the supervisor
inherited them from it), from the code installed there now.  Before this
daemon stops reading, it runs that interpreter on that code in a check
mode (``daemon.successor --check``: every module a daemon serves with
imported, no mount touched).  A broken install (a syntax error, a missing
dependency) is then refused in one line, the check's output kept in the
store's log, and this daemon keeps serving: once it has handed over there
is no going back, and three successors dying at start would have the
supervisor give the mount up.  A restart is refused the same way when the
supervisor is gone (killed): nobody would start the successor.
"""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
from typing import Any

import trio

from mithrilfs import crash_points, kernel
from mithrilfs.daemon.channel import Supervisor

log = logging.getLogger(__name__)

#: How long the installed code may take to import (a loaded machine, a cold disk) before it counts as broken.
CHECK_TIMEOUT = 60.0


def check_installed() -> str | None:
    """None when the installed code starts as a successor would; else why not, in one line (the whole of
    what it said goes to the log)."""
    # the tests' crash points kill the daemon they are set for, never a check
    env = {k: v for k, v in os.environ.items() if k != crash_points.VARIABLE}
    try:
        res = subprocess.run([sys.executable, "-m", "mithrilfs.daemon.successor", "--check"], env=env, cwd="/",
                             stdin=subprocess.DEVNULL, capture_output=True, text=True, timeout=CHECK_TIMEOUT,
                             close_fds=True)
    except subprocess.TimeoutExpired:
        return f"{sys.executable} -m mithrilfs.daemon.successor did not start within {CHECK_TIMEOUT:.0f} s"
    except OSError as e:
        return f"cannot run {sys.executable}: {e.strerror}"
    if res.returncode == 0:
        return None
    log.error("the installed mithrilfs does not start (%s -m mithrilfs.daemon.successor --check, exit status %d):"
              "\n%s", sys.executable, res.returncode, (res.stdout + res.stderr).rstrip()[-20000:])
    last = ((res.stderr or res.stdout).strip().splitlines() or [f"exit status {res.returncode}"])[-1]
    return last[:300]


def _answer(doc: dict[str, Any]) -> bytes:
    return (json.dumps(doc) + "\n").encode()


class Restart:
    """The ``restart`` control command; ``requested`` is set once this daemon is to hand over."""

    def __init__(self, session: kernel.Session, supervisor: Supervisor, log_path: str) -> None:
        self.session = session
        self.supervisor = supervisor
        self.log_path = log_path
        self.requested = trio.Event()

    async def __call__(self, request: bytes) -> bytes:
        if self.supervisor.state() != "alive":
            return _answer({"restarting": False, "error": "its supervisor is gone (killed?), so no new daemon would "
                            "take over; this daemon serves on: unmount and mount again to restart it"})
        failed = await trio.to_thread.run_sync(check_installed)
        if failed is not None:
            return _answer({"restarting": False, "error": f"the installed mithrilfs does not start ({failed}; "
                            f"see {self.log_path}); this daemon serves on"})
        if self.requested.is_set():
            return _answer({"restarting": True, "pid": os.getpid()})
        self.requested.set()
        trio.lowlevel.current_trio_token().run_sync_soon(self.session.stop)
        log.info("restart: the installed mithrilfs starts; handing over")
        return _answer({"restarting": True, "pid": os.getpid()})
