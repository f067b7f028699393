"""Attach a FUSE session to a directory, and detach it again.

As root: open /dev/fuse and call mount(2) with ``fd=``, ``rootmode``,
``user_id``/``group_id`` and ``default_permissions`` (the kernel checks
permissions; ``allow_other`` when asked).  As anyone else: ``fusermount3``
(setuid root) opens /dev/fuse, mounts, and passes the fd back over the
``_FUSE_COMMFD`` socket.

What happens when the daemon dies is the daemon's business (its
supervisor holds a copy of the fd and takes over or detaches, see
``daemon.supervisor``); ``mount_entry`` names the mount so that only this
one is ever detached.  (fusermount3's own ``auto_unmount`` is not used: the
3.14 one probes the dead mount as root, which a mount without
``allow_other`` refuses, so it never unmounts.)

Mounts are always ``nosuid,nodev``: device nodes can be created and listed,
never opened.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import os
import shutil
import socket
import stat
import subprocess
import tempfile
from dataclasses import dataclass
from typing import NamedTuple

FSNAME = "mithrilfs"
FSTYPE = "fuse." + FSNAME
MS_RDONLY = 1
MS_NOSUID = 2
MS_NODEV = 4
MS_PRIVATE = 1 << 18
MNT_DETACH = 2

_libc = ctypes.CDLL(ctypes.util.find_library("c") or None, use_errno=True)


class MountError(Exception):
    """The mount could not be made; the message says why and what to do, in one line."""


def unescape_mount_field(field_: str) -> str:
    """A path as /proc/*/mounts and mountinfo write it (space, tab, newline, backslash escaped in octal)."""
    return field_.replace("\\040", " ").replace("\\011", "\t").replace("\\012", "\n").replace("\\134", "\\")


class MountInfo(NamedTuple):
    """One line of a mountinfo file."""

    mount_id: int
    device: str  # major:minor
    mountpoint: str
    fstype: str


def mountinfo(path: str = "/proc/self/mountinfo") -> list[MountInfo]:
    """The mounts a mountinfo file lists (this process's namespace's by default), oldest first; OSError when
    it cannot be read."""
    found = []
    with open(path) as f:
        for line in f:
            left, _, right = line.partition(" - ")
            parts = left.split()
            if len(parts) >= 5:
                found.append(MountInfo(int(parts[0]), parts[2], unescape_mount_field(parts[4]),
                                       right.split()[0] if right.split() else ""))
    return found


def mount_entries(target: str) -> list[tuple[int, str, str]]:
    """(mount id, major:minor, fstype) of every mount at the resolved path *target*, oldest first.

    Never touches the path itself: a stat of a FUSE mount whose daemon is
    not serving yet (or any more) would block or fail.
    """
    return [(m.mount_id, m.device, m.fstype) for m in mountinfo() if m.mountpoint == target]


def make_private(path: str) -> None:
    """mount(2) with MS_PRIVATE (root only): the mount at *path* leaves its peer group, so what is done to it
    no longer propagates; OSError with the errno on failure."""
    if _libc.mount(None, os.fsencode(path), None, MS_PRIVATE, None) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e), path)


def umount_path(path: str, *, lazy: bool = True) -> None:
    """umount2(2) (root only); OSError with the errno on failure."""
    if _libc.umount2(os.fsencode(path), MNT_DETACH if lazy else 0) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e), path)


def unmount(mountpoint: str, *, lazy: bool) -> str | None:
    """Unmount for the CLI (``umount``, a stale mount's clean-up); None, or the one-line reason it failed.

    As root umount2(2), the way root mounts: a GPU image or a slim container
    may have no fusermount3 at all, and root must unmount what it mounted
    there too.  As anyone else
    ``fusermount3 -u``, which checks that the mount is theirs.
    """
    if os.geteuid() == 0:
        try:
            umount_path(mountpoint, lazy=lazy)
        except OSError as e:
            return e.strerror
        return None
    if shutil.which("fusermount3") is None:
        return "fusermount3 is not installed (it comes with the fuse3 package)"
    res = subprocess.run(["fusermount3", "-u", *(["-z"] if lazy else []), "--", mountpoint], capture_output=True,
                         text=True, cwd="/")
    if res.returncode != 0:
        return (res.stderr.strip().splitlines() or ["fusermount3 failed"])[-1]
    return None


def detach(mountpoint: str, *, via_fusermount: bool) -> None:
    """Lazily unmount: umount2(2) as root, ``fusermount3 -u -z`` for a user's own mount."""
    if via_fusermount:
        subprocess.run(["fusermount3", "-u", "-z", "-q", "--", mountpoint], capture_output=True, cwd="/")
        return
    try:
        umount_path(mountpoint)
    except OSError as e:
        if e.errno not in (errno.EINVAL, errno.ENOENT):
            raise


@dataclass
class FuseMount:
    """A live mount: the /dev/fuse fd the session serves, and how to take the mount down."""

    fd: int
    mountpoint: str
    via_fusermount: bool

    def mount_entry(self) -> tuple[int, str] | None:
        """(mount id, major:minor) of the newest mithrilfs mount at the mount point: this one, just after mounting."""
        mine = [e for e in mount_entries(self.mountpoint) if e[2] == FSTYPE]
        return (mine[-1][0], mine[-1][1]) if mine else None

    def unmount(self) -> None:
        """Detach the mount (lazily: open files keep working until closed) and close the fd."""
        try:
            if any(fstype == FSTYPE for _, _, fstype in mount_entries(self.mountpoint)):
                detach(self.mountpoint, via_fusermount=self.via_fusermount)
        finally:
            self.close()

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def mount(mountpoint: str, *, allow_other: bool = False, read_only: bool = False,
          via_fusermount: bool | None = None) -> FuseMount:
    """Mount a new FUSE session at *mountpoint*; raises MountError with the cause."""
    mountpoint = os.path.realpath(mountpoint)
    if via_fusermount is None:
        via_fusermount = os.geteuid() != 0 or os.environ.get("MITHRILFS_MOUNT_VIA") == "fusermount3"
    if via_fusermount:
        return _mount_fusermount(mountpoint, allow_other, read_only)
    return _mount_root(mountpoint, allow_other, read_only)


def _open_dev_fuse() -> int:
    try:
        return os.open("/dev/fuse", os.O_RDWR | os.O_CLOEXEC)
    except FileNotFoundError:
        raise MountError("/dev/fuse does not exist: load the fuse module (modprobe fuse), or give the container "
                         "the device (--device /dev/fuse)") from None
    except PermissionError:
        raise MountError("no permission to open /dev/fuse") from None


def _mount_root(mountpoint: str, allow_other: bool, read_only: bool) -> FuseMount:
    fd = _open_dev_fuse()
    try:
        st = os.stat(mountpoint)
        opts = (f"fd={fd},rootmode={stat.S_IFMT(st.st_mode):o},user_id={os.getuid()},group_id={os.getgid()}"
                ",default_permissions" + (",allow_other" if allow_other else ""))
        flags = MS_NOSUID | MS_NODEV | (MS_RDONLY if read_only else 0)
        if _libc.mount(FSNAME.encode(), os.fsencode(mountpoint), FSTYPE.encode(), flags, opts.encode()) != 0:
            e = ctypes.get_errno()
            hint = " (in a container, mounting needs CAP_SYS_ADMIN)" if e == errno.EPERM else ""
            raise MountError(f"mount(2) of {mountpoint} failed: {os.strerror(e)}{hint}")
    except BaseException:
        os.close(fd)
        raise
    return FuseMount(fd, mountpoint, False)


def _mount_fusermount(mountpoint: str, allow_other: bool, read_only: bool) -> FuseMount:
    exe = shutil.which("fusermount3")
    if exe is None:
        raise MountError("fusermount3 is not installed (it comes with the fuse3 package); it is needed to mount "
                         "without root")
    opts = f"fsname={FSNAME},subtype={FSNAME},default_permissions,nosuid,nodev"
    opts += ",allow_other" if allow_other else ""
    opts += ",ro" if read_only else ""
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    errors = tempfile.TemporaryFile()
    try:
        proc = subprocess.Popen([exe, "-o", opts, "--", mountpoint], env=dict(os.environ, _FUSE_COMMFD=str(
            theirs.fileno())), pass_fds=(theirs.fileno(),), stdout=subprocess.DEVNULL, stderr=errors, cwd="/")
    except OSError as e:
        ours.close()
        errors.close()
        raise MountError(f"cannot run fusermount3: {e.strerror}") from None
    finally:
        theirs.close()
    fds: list[int] = []
    try:
        _, fds, _, _ = socket.recv_fds(ours, 1, 1)
    except OSError:
        pass
    finally:
        ours.close()
    proc.wait()
    errors.seek(0)
    err = errors.read().decode(errors="replace").strip()
    errors.close()
    if not fds:
        raise MountError(_fusermount_hint(err or f"fusermount3 exited with status {proc.returncode}"))
    os.set_inheritable(fds[0], False)
    return FuseMount(fds[0], mountpoint, True)


def _fusermount_hint(message: str) -> str:
    line = message.splitlines()[-1] if message else message
    if "/dev/fuse" in line:
        try:
            st = os.stat("/dev/fuse")
            here = f"here it is mode {stat.S_IMODE(st.st_mode):04o}, owner uid {st.st_uid}"
        except OSError:
            here = "here it is missing"
        return line + (f" (this user may not use /dev/fuse: {here}; non-root mounts need it mode 0666"
                       " (as root: chmod 0666 /dev/fuse), or mount as root; in a container, pass the device)")
    if "user_allow_other" in line:
        return line + " (add user_allow_other to /etc/fuse.conf, or mount without --allow-other)"
    if "Permission denied" in line or "Operation not permitted" in line:
        return line + " (non-root mounts need a mount point you own and a setuid fusermount3)"
    return line
