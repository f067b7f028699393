"""A command in a mount namespace of its own that holds none of its parent's FUSE mounts but those it keeps.

``unshare -m`` copies every mount of the parent's namespace.  Where the
copies are private (a root mount without shared propagation, as on this
project's VMs), unmounting a filesystem in the parent does not reach its
copy, and the copy keeps the filesystem alive: its daemon serves on and
``mithrilfs umount`` says which namespace holds it.  A test that makes a
namespace while other tests' mounts exist (an application container, a
node at another node's path) would hold them for as long as it runs, so it
runs its command through this module::

    unshare -m --propagation P python -m mithrilfs.testing.own_namespace [--keep PATH]... -- CMD [ARG]...

(``argv`` builds that line).  Every FUSE mount of the new namespace at or
under a kept path, or above one, stays; every other is made private (so
detaching it cannot propagate to a peer outside) and detached lazily; then
CMD replaces this process.  A mount it cannot detach is a one-line error
and exit status 1.
"""

from __future__ import annotations

import argparse
import errno
import os
import sys
from collections.abc import Iterable, Sequence

from mithrilfs.kernel.mount import make_private, mountinfo, umount_path


def argv(command: Sequence[str], *, keep: Iterable[str | os.PathLike[str]] = (),
         propagation: str = "private") -> list[str]:
    """The command line that runs *command* in a namespace of its own (``unshare -m --propagation
    *propagation*``) holding only the FUSE mounts at, under or above the *keep* paths."""
    kept = [arg for path in keep for arg in ("--keep", os.fspath(path))]
    return ["unshare", "-m", "--propagation", propagation, sys.executable, "-m", __name__, *kept, "--", *command]


def fuse_mounts() -> list[str]:
    """The mount points of this namespace's FUSE mounts, in mountinfo's order (a parent before its children)."""
    return [m.mountpoint for m in mountinfo() if m.fstype.startswith("fuse")]


def _related(path: str, kept: str) -> bool:
    """*path* is *kept*, under it or above it."""
    return path == kept or path.startswith(kept.rstrip("/") + "/") or kept.startswith(path.rstrip("/") + "/")


def drop_fuse_mounts(keep: Iterable[str]) -> None:
    """Detach every FUSE mount of this namespace not related to a kept path (see the module doc)."""
    kept = [os.path.realpath(path) for path in keep]
    for path in reversed(fuse_mounts()):  # children first: a parent's detach would take them along anyway
        if any(_related(path, k) for k in kept):
            continue
        try:
            make_private(path)
            umount_path(path, lazy=True)
        except OSError as e:
            if e.errno not in (errno.EINVAL, errno.ENOENT):  # gone with a parent detached before it
                raise


def main(args: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m mithrilfs.testing.own_namespace", description=__doc__.split("\n")[0])
    parser.add_argument("--keep", action="append", default=[], metavar="PATH", help="a FUSE mount to keep")
    parser.add_argument("command", nargs=argparse.REMAINDER, help="-- CMD [ARG]...")
    opts = parser.parse_args(args)
    command = opts.command[1:] if opts.command[:1] == ["--"] else opts.command
    if not command:
        parser.error("no command given")
    try:
        drop_fuse_mounts(opts.keep)
    except OSError as e:
        print(f"own_namespace: cannot detach {e.filename}: {e.strerror}", file=sys.stderr)
        return 1
    try:
        os.execvp(command[0], command)
    except OSError as e:
        print(f"own_namespace: cannot run {command[0]}: {e.strerror}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
