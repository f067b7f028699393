"""A mount point seen from outside its daemon: is it a FUSE mount, does it answer, may it be mounted on.

Run in the CLI's processes (``mount`` checks before it forks).  A mount
whose daemon may be hung is probed from a thread given up after a timeout
(``probe_mount``), and one whose daemon died is told from /proc/self/mounts
and a statfs, so neither can hang the command that asks.
"""

from __future__ import annotations

import errno
import os
import sys
from pathlib import Path

from mithrilfs.control.files import CONTROL_NAME
from mithrilfs.daemon.process import call_within
from mithrilfs.errors import MountError, UsageError
from mithrilfs.kernel.mount import unescape_mount_field, unmount
from mithrilfs.store.open import StoreError, validate_store


def fuse_mount_options(path: Path) -> dict[str, str] | None:
    """The mount options of the FUSE mount at *path* (``user_id``, ``allow_other``...), None if there is none."""
    target = os.path.realpath(path)
    found = None
    with open("/proc/self/mounts") as f:
        for line in f:
            parts = line.split()
            if len(parts) > 3 and unescape_mount_field(parts[1]) == target and parts[2].startswith("fuse"):
                found = dict(opt.partition("=")[::2] for opt in parts[3].split(","))  # the topmost wins
    return found


def is_fuse_mount(path: Path) -> bool:
    return fuse_mount_options(path) is not None


def forbidden_message(mountpoint: Path) -> str:
    """Why this user cannot enter a FUSE mount: it is another user's, mounted without --allow-other."""
    opts = fuse_mount_options(mountpoint) or {}
    owner = opts.get("user_id", "?")
    if "allow_other" in opts:
        return f"{mountpoint}: uid {os.getuid()} may not enter this mount (mounted by uid {owner})"
    return (f"{mountpoint}: uid {os.getuid()} cannot enter this mount: uid {owner} mounted it without "
            "--allow-other (mount it with --allow-other to let other users in)")


def probe_mount(mountpoint: Path, timeout: float = 1.0) -> str:
    """'live', 'dead' (daemon gone: ENOTCONN), 'hung' (no answer in *timeout*), 'unmounted', or
    'forbidden' (another user's mount this user may not enter: ``forbidden_message`` says why).

    statfs always reaches the daemon (a stat may be answered from the
    kernel's attribute cache even after the daemon died), and it runs in a
    thread so a hung daemon cannot hang the caller.
    """
    if not is_fuse_mount(mountpoint):
        return "unmounted"

    def ask() -> str:
        try:
            os.statvfs(mountpoint)  # answered, zeroed, even to a user the mount refuses...
            os.stat(mountpoint)  # ...which this tells: EACCES
            return "live"
        except OSError as e:
            # ENOTCONN, or ECONNABORTED for a request that was queued as the daemon died
            return ("dead" if e.errno in (errno.ENOTCONN, errno.ECONNABORTED)
                    else "forbidden" if e.errno in (errno.EACCES, errno.EPERM) else "live")

    return call_within(ask, timeout) or "hung"


def clean_stale_mount(mountpoint: Path) -> bool:
    """Detach a mount whose daemon died (ENOTCONN); True when one was cleaned, a one-line MountError when
    it could not be."""
    if probe_mount(mountpoint, timeout=5.0) != "dead":
        return False
    detail = unmount(str(mountpoint), lazy=True)
    if detail is not None:
        raise MountError(f"cannot detach the dead mount at {mountpoint}: {detail}")
    return True


def check_mountpoint(mountpoint: Path, store: Path, *, nonempty: bool = False) -> None:
    if clean_stale_mount(mountpoint):
        print(f"mithrilfs: cleaned up a stale mount at {mountpoint} (its daemon had died)", file=sys.stderr)
    if not mountpoint.exists():
        raise UsageError(f"mount point {mountpoint} does not exist")
    if not mountpoint.is_dir():
        raise UsageError(f"mount point {mountpoint} is not a directory")
    if os.path.ismount(mountpoint) and is_fuse_mount(mountpoint):
        raise UsageError(f"{mountpoint} is already mounted")
    if not nonempty:
        try:
            hidden = sum(1 for _ in zip(os.scandir(mountpoint), range(1000)))
        except OSError:
            hidden = 0
        if hidden:
            raise UsageError(f"mount point {mountpoint} is not empty ({hidden}{'+' if hidden == 1000 else ''} entries"
                             " the mount would hide); empty it, or pass --nonempty to mount over it")
    mp, st = os.path.realpath(mountpoint), os.path.realpath(store)
    if st == mp or st.startswith(mp.rstrip("/") + "/"):
        raise UsageError(f"store {store} is inside the mount point {mountpoint}")
    if mp.startswith(st.rstrip("/") + "/"):
        raise UsageError(f"mount point {mountpoint} is inside the store {store}")
    try:
        validate_store(store)
    except StoreError as e:
        raise UsageError(str(e)) from None


def daemon_pid(mountpoint: Path) -> int | None:
    try:
        return int((mountpoint / CONTROL_NAME.decode() / "pid").read_text())
    except (OSError, ValueError):
        return None
