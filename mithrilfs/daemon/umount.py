"""Unmounting, as the ``umount`` command runs it: detach, then wait until the daemon and the store's lock are gone.

A busy mount is named with the processes that hold it (``holders``), and
the store is free when ``umount`` returns (``store_free``): its daemon has
exited and its supervisor released the lock, so the next mount or ``fsck``
of the store can start at once.

A mount namespace made while the filesystem was mounted (``unshare -m``, a
container) holds a copy of the mount; where the copy is private, the
unmount here does not reach it, and the kernel ends the session only when
the last copy goes.  The daemon then serves on, rightly: ``umount`` names a
process of each such namespace (``namespaces_holding``) in its error rather
than waiting out its timeout for a daemon that does not exit.
"""

from __future__ import annotations

import fcntl
import json
import os
import sqlite3
import time
from pathlib import Path

from mithrilfs.control.files import CONTROL_NAME
from mithrilfs.daemon.mountpoint import daemon_pid, is_fuse_mount
from mithrilfs.daemon.process import pid_alive
from mithrilfs.errors import MountError, UsageError
from mithrilfs.kernel.mount import mount_entries, mountinfo, unmount

#: Seconds after the unmount before ``umount`` first looks for copies in other mount namespaces, then between
#: looks: a daemon whose last mount this was has usually exited by then, and a namespace only being made
#: (a container starting) has dropped the copies it does not keep.
NAMESPACE_CHECK_SECONDS = 0.5


def pending_uploads(store: Path) -> int:
    """Changes queued for the shared tier in an unmounted store's index (0 when it cannot tell)."""
    from mithrilfs.store.namespace import Namespace
    from mithrilfs.store.tier_queue import TierQueue

    try:
        ns = Namespace(str(store / "index.sqlite3"), read_only=True, immutable=False)
        try:
            return TierQueue(ns).length()
        finally:
            ns.close()
    except (sqlite3.Error, OSError):  # an index of an older format, or gone: nothing to report
        return 0


def holders(mountpoint: Path) -> list[str]:
    """'NAME[PID]' of every process with a file, mapping or working directory under *mountpoint* (as fuser -m)."""
    root = os.path.realpath(mountpoint)
    inside = lambda p: p == root or p.startswith(root.rstrip("/") + "/")  # noqa: E731
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            paths = [os.readlink(f"/proc/{entry.name}/cwd")]
            paths += [os.readlink(f"/proc/{entry.name}/fd/{fd}") for fd in os.listdir(f"/proc/{entry.name}/fd")]
            with open(f"/proc/{entry.name}/maps") as f:
                paths += [line.split(None, 5)[5].strip() for line in f if len(line.split(None, 5)) == 6]
            if any(inside(p) for p in paths):
                with open(f"/proc/{entry.name}/comm") as f:
                    found.append(f"{f.read().strip()}[{entry.name}]")
        except (OSError, IndexError):
            continue
    return found


def namespaces_holding(device: str) -> list[str]:
    """'NAME[PID]' of one process in each mount namespace but this one that has the filesystem *device*
    ('major:minor', as mountinfo writes it) mounted."""
    try:
        seen = {os.readlink("/proc/self/ns/mnt")}
    except OSError:
        return []
    found = []
    for entry in os.scandir("/proc"):
        if not entry.name.isdigit():
            continue
        try:
            namespace = os.readlink(f"/proc/{entry.name}/ns/mnt")
            if namespace in seen:
                continue
            seen.add(namespace)
            if not any(m.device == device for m in mountinfo(f"/proc/{entry.name}/mountinfo")):
                continue
            with open(f"/proc/{entry.name}/comm") as f:
                found.append(f"{f.read().strip()}[{entry.name}]")
        except (OSError, ValueError):
            continue
    return found


def umount(mountpoint: Path, timeout: float = 60.0, *, lazy: bool = False) -> None:
    if not mountpoint.is_dir() and not is_fuse_mount(mountpoint):
        raise UsageError(f"{mountpoint} is not a directory")
    if not is_fuse_mount(mountpoint):
        raise UsageError(f"{mountpoint} is not mounted")
    pid = daemon_pid(mountpoint)
    entries = mount_entries(os.path.realpath(mountpoint))
    device = entries[-1][1] if entries else None
    try:
        store: Path | None = Path(json.loads((mountpoint / CONTROL_NAME.decode() / "stats.json").read_text())["store"])
    except (OSError, ValueError, KeyError):
        store = None
    detail = unmount(str(mountpoint), lazy=lazy)
    if detail is not None:
        if "busy" in detail.lower():
            users = holders(mountpoint)
            raise MountError(f"cannot unmount {mountpoint}: in use by {', '.join(users) or 'a process'}; "
                             "stop them, or pass --lazy to detach it now and finish when they are done")
        raise MountError(f"cannot unmount {mountpoint}: {detail}")
    if lazy:
        return  # the daemon serves the processes still using it, and exits when they are done
    if pid is None:
        return
    deadline = time.monotonic() + timeout
    next_check = time.monotonic() + NAMESPACE_CHECK_SECONDS
    while pid_alive(pid):
        now = time.monotonic()
        if device is not None and now > next_check:
            next_check = now + NAMESPACE_CHECK_SECONDS
            if held := namespaces_holding(device):
                raise MountError(f"unmounted {mountpoint} here, but other mount namespaces still hold it "
                                 f"({', '.join(held)}): daemon {pid} serves them until they unmount it or exit"
                                 + (f", and {store} stays locked until then" if store is not None else ""))
        if now > deadline:
            raise MountError(f"unmounted {mountpoint}, but daemon {pid} did not exit within {timeout:.0f} s")
        time.sleep(0.02)
    # and its supervisor, which holds the store's lock: the store is free when this returns
    if store is not None and not wait_store_free(store, deadline):
        raise MountError(f"unmounted {mountpoint}, but its store {store} is still locked after {timeout:.0f} s")


def wait_store_free(store: Path, deadline: float) -> bool:
    """Wait until no process holds *store*'s lock (``store_free``); False if one still does at *deadline*."""
    while not store_free(store):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def store_free(store: Path) -> bool:
    """No process holds the store's lock (best effort: True when it cannot tell)."""
    try:
        fd = os.open(store / "lock", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:
        return True
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
