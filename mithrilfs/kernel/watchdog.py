"""Detach a mount whose daemon died: ``python -m mithrilfs.kernel.watchdog MOUNTPOINT MOUNT_ID DEV HOW``.

Started by ``kernel.mount`` with the daemon's end of a pipe as stdin; HOW
is ``umount2`` (root) or ``fusermount3`` (a user's own mount).  EOF on stdin means the daemon exited; if it did so without
unmounting (killed, crashed), the mount it made (matched by mount id and
device, so a later mount at the same path is never touched) is detached,
and programs using it get ENOTCONN instead of a dead mount lingering.
"""

from __future__ import annotations

import signal
import sys

from .mount import FSTYPE, detach, mount_entries


def main(argv: list[str]) -> int:
    mountpoint, mount_id, dev, how = argv[0], int(argv[1]), argv[2], argv[3]
    # a terminal's Ctrl-C reaches the whole process group: outlive the daemon, not die with it
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    while sys.stdin.buffer.read(4096):
        pass
    try:
        if (mount_id, dev, FSTYPE) in mount_entries(mountpoint):
            detach(mountpoint, via_fusermount=how == "fusermount3")
    except OSError:
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
