"""The CLI's side of the control directory: find a live mount's control files, run commands, draw progress.

A mount is asked through ``MOUNT/.mithrilfs/`` (files any user who sees the
mount may read; commands its owner writes), never over a socket, so the
CLI works from any container that sees the mount.
"""

from __future__ import annotations

import fcntl
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import NoReturn

from mithrilfs.control.files import CONTROL_NAME
from mithrilfs.daemon.mountpoint import forbidden_message, probe_mount
from mithrilfs.errors import MountError, UsageError
from mithrilfs.units import format_size


def usage_error(message: str) -> NoReturn:
    print(f"mithrilfs: error: {message}", file=sys.stderr)
    sys.exit(2)


def control_file(mountpoint: Path, name: str) -> Path:
    """A file of the mount's control directory, or a one-line error when it is not a live mount."""
    mp = mountpoint.expanduser().absolute()
    state = probe_mount(mp, timeout=5.0)
    if state == "forbidden":
        raise MountError(forbidden_message(mp))
    if state in ("dead", "hung"):
        raise UsageError(f"{mp}: " + ("its daemon is gone (stale mount); run 'mithrilfs umount " + str(mp) + "'"
                                      " and mount again" if state == "dead" else "the mount does not answer"))
    if not mp.is_dir():
        raise UsageError(f"{mp} is not a directory")
    path = mp / CONTROL_NAME.decode() / name
    if not path.exists():
        raise UsageError(f"{mp} is not a mithrilfs mount")
    return path


class DaemonChanged(MountError):
    """The daemon that took a command died before its answer was read: its successor never saw the command.

    Only a command that is safe to ask twice (``prefetch``) asks again; the
    others report it in one line.
    """


def control_command(path: Path, request: str, *, answered: bool = True) -> dict:
    """Run a command through its control file: write the request, read the JSON answer back (unless not
    *answered*: ``restart``, whose answer dies with the daemon that gave it).

    Commands change the mount, so only its owner may run them; anyone who sees the mount reads.  A command
    file holds one answer, the last: the command is asked and its answer read under the file's lock
    (``flock``, kept by the kernel: every container that sees the mount shares it), so clients asking at
    once each read their own.
    """
    try:
        try:
            fd = os.open(path, os.O_RDWR)
        except PermissionError:
            owner = path.stat().st_uid
            raise MountError(f"{path.parent.parent}: '{path.name}' needs the rights of the mount's owner "
                             f"(uid {owner}; this is uid {os.getuid()}): run it as uid {owner}") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)  # released by the close
            os.write(fd, request.encode())
            if not answered:
                return {}
            answer = os.pread(fd, 1 << 16, 0)
        finally:
            os.close(fd)
    except OSError as e:  # the mount went away under us
        raise MountError(f"{path.parent.parent}: the mount stopped answering ({e.strerror})") from None
    try:
        return json.loads(answer)
    except ValueError:
        raise DaemonChanged(f"{path.parent.parent}: '{path.name}' gave no answer (the daemon changed meanwhile?)"
                            ) from None


def while_drawing(command: Callable[[], dict], mountpoint: Path, draw: Callable[[int, int], None] | None,
                   total: int) -> dict:
    """Run a blocking control command; meanwhile draw the eviction's progress from ``stats``."""
    if draw is None:
        return command()
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        running = pool.submit(command)
        while not running.done():
            try:
                current = read_stats(mountpoint).get("eviction") or {}
            except (UsageError, MountError):
                break
            draw(min(current.get("bytes", 0), total), total)
            concurrent.futures.wait([running], timeout=0.1)
        answer = running.result()
    draw(total, total)
    return answer


def progress_bar(label: str, *, sizes: bool = False) -> Callable[[int, int], None] | None:
    """A progress callback drawing a bar on stderr when it is a terminal, else nothing.

    It draws counts (every 64th) or, with *sizes*, bytes (every call).
    """
    if not sys.stderr.isatty():
        return None

    def draw(done: int, total: int) -> None:
        if not sizes and done != total and done % 64:
            return
        width = 30
        filled = width * done // max(total, 1)
        shown = f"{format_size(done)} of {format_size(total)}" if sizes else f"{done}/{total}"
        sys.stderr.write(f"\r{label} [{'#' * filled}{'.' * (width - filled)}] {shown}\x1b[K")
        if done == total:
            sys.stderr.write("\n")
        sys.stderr.flush()

    return draw


def read_stats(mountpoint: Path) -> dict:
    return read_json(mountpoint, control_file(mountpoint, "stats.json"))


def read_json(mountpoint: Path, path: Path) -> dict:
    """A JSON control file's content (read again if a read tore: see ``control.files.ControlFiles.padded``)."""
    for _ in range(3):
        try:
            text = path.read_text()
        except OSError as e:  # the mount went away under us
            raise MountError(f"{mountpoint}: the mount stopped answering ({e.strerror})") from None
        try:
            return json.loads(text)
        except ValueError:
            continue
    raise MountError(f"{mountpoint}: {path.name} did not read as one JSON document in three reads")


def tier_command(mp: Path, name: str, request: str) -> dict:
    """Run a command that needs the shared tier; a one-line usage error for a mount without one."""
    try:
        path = control_file(mp, name)
    except UsageError:
        control_file(mp, "pid")  # a mount, but without a remote
        raise UsageError(f"{mp} was mounted without --remote") from None
    return control_command(path, request)

