"""Telling ``mount`` that the mount serves: only once it answers, proved from a process of its own.

The CLI that ran ``mount`` waits for one line (``READY``, or the reason the
mount failed); the supervisor learns the session as soon as the kernel has
INIT's answer, so a daemon that dies during the proof is taken over.
"""

from __future__ import annotations

import logging
import os
import subprocess
from collections.abc import Callable
from pathlib import Path

import trio

from mithrilfs import kernel
from mithrilfs.control.files import CONTROL_NAME
from mithrilfs.crash_points import crash_point
from mithrilfs.daemon import wiring
from mithrilfs.daemon.channel import Handover, Supervisor

log = logging.getLogger(__name__)


#: What the daemon announces once its mount answers; the read-only store's variant makes the CLI say so.
READY, READY_READ_ONLY = "ok", "ok read-only"


async def announce_when_live(session: kernel.Session, mounted: wiring.Mounted, mountpoint: Path,
                              announce: Callable[[str], None], supervisor: Supervisor,
                              handover: Handover | None, dev: str | None) -> None:
    # from the moment the kernel has INIT's answer, programs may use the mount: a death of this
    # daemon during the probe below must find its supervisor able to start a successor
    await session.initialized.wait()
    supervisor.connected(session.parameters)
    if handover is None:
        crash_point("before_announce")
        # a read of a control file goes through the kernel to our own handlers: proof that we
        # answer; and the first OPEN and FLUSH are answered ENOSYS, after which the kernel opens
        # and closes every file itself, so even a workload that only creates files is spared
        # RELEASE and FLUSH from its first file on.  (A successor needs neither: the kernel
        # remembers.)  The thread waits on another process: if a signal ends the FUSE loop
        # first, it is abandoned rather than waited for.
        failed = await trio.to_thread.run_sync(_probe, mountpoint / CONTROL_NAME.decode() / "pid",
                                               abandon_on_cancel=True)
        if failed is not None:
            announce(f"the new mount at {mountpoint} does not answer: {failed}")
            session.stop()
            return
    if dev is not None:  # a successor too: the first daemon may have died before it did this
        _raise_readahead(dev)
    ops = mounted.ops
    supervisor.serving()
    if handover is not None:
        mounted.events.emit("daemon_restarted", mountpoint=str(mountpoint), pid=os.getpid(),
                            cause=handover.restarts.cause, restarts=handover.restarts.count,
                            torn_files=len(handover.torn))
    else:
        mounted.events.emit("mount", mountpoint=str(mountpoint), store=str(ops.store.root), pid=os.getpid(),
                            max_bytes=ops.policy.max_bytes, read_only=ops.store.read_only)
    announce(READY_READ_ONLY if ops.store.read_only else READY)


def _probe(path: Path) -> str | None:
    """Open and read *path* on our own mount from another process; None if it worked, else why not.

    Never from a thread of the daemon: a thread waiting on its own mount
    when the daemon is killed can never finish (the kernel waits for an
    answer to a request the daemon had read), so the dying daemon would
    never close its descriptors and its supervisor would wait for ever.
    A process of its own waits harmlessly for the successor instead.
    """
    try:
        res = subprocess.run(["cat", "--", str(path)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                             text=True, cwd="/", close_fds=True)
    except OSError as e:
        return f"cannot run cat: {e.strerror}"
    return None if res.returncode == 0 else (res.stderr.strip().splitlines() or ["cat failed"])[-1]


READAHEAD_KB = 1024


def _raise_readahead(dev: str) -> None:
    """Let the kernel read ahead 1 MiB per FUSE request instead of 128 KiB (root only; best effort).

    Large sequential reads (big .so files, model weights) then cost a
    quarter as many round trips to the daemon.  *dev*: the mount's
    major:minor (from mountinfo: never a stat of our own mount, see ``_probe``).
    """
    path = f"/sys/class/bdi/{dev}/read_ahead_kb"
    try:
        with open(path, "w") as f:
            f.write(str(READAHEAD_KB))
    except OSError as e:
        log.debug("cannot raise readahead (%s): %s", path, e)
