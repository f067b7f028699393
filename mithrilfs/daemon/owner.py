"""A mount that lives for one process, ``run``'s: who that process is, how its supervisor sees it end,
and what is put right after it.

``run`` mounts, makes torch's headers link point into the mount and, for
a mount of its own temporary directory, made that directory.  It takes all
three down itself when its command ends or a signal it can catch stops it
(``cli.relay``).  SIGKILL it cannot catch, so its mount carries an
``Owner`` (``MountOptions.owner``): the supervisor, which outlives every
daemon of the mount, watches the owner through a pidfd (``watch``), and
when the owner is gone it sends the daemon SIGTERM (the clean unmount) and,
once the mount is gone, puts the link back and removes the directory
(``clean_up``).  The owner is named by its pid and its start time, so a
later process given the same pid is never taken for it.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from mithrilfs.daemon.process import pid_alive, start_time
from mithrilfs.jitcaches import catalog


@dataclass(frozen=True)
class Owner:
    """The process a mount is for, and what it made for the mount outside it."""

    pid: int
    #: Its start time (``process.start_time``).
    start: int
    #: The mount point is the owner's temporary directory: removed once the mount is gone.
    temp_dir: bool = False
    #: torch's precompiled-header link and what was there before (``catalog.headers_before``): put back.
    headers: tuple[str, str | None] | None = None

    @classmethod
    def this_process(cls, *, temp_dir: bool, headers: tuple[Path, str | None] | None) -> Owner:
        start = start_time(os.getpid())
        assert start is not None  # this very process
        return cls(os.getpid(), start, temp_dir, (str(headers[0]), headers[1]) if headers is not None else None)

    def as_json(self) -> dict[str, Any]:
        return {"pid": self.pid, "start": self.start, "temp_dir": self.temp_dir,
                "headers": list(self.headers) if self.headers is not None else None}

    @classmethod
    def from_json(cls, d: dict[str, Any] | None) -> Owner | None:
        """The owner in a mount's options or its store's holder record; None for a mount of no process."""
        if not d:
            return None
        headers = d.get("headers")
        return cls(int(d["pid"]), int(d["start"]), bool(d.get("temp_dir")),
                   (str(headers[0]), headers[1]) if headers else None)

    def alive(self) -> bool:
        return pid_alive(self.pid) and start_time(self.pid) == self.start

    def watch(self) -> int | None:
        """A descriptor that becomes readable when the owner ends (a pidfd); None when it has ended already."""
        try:
            fd = os.pidfd_open(self.pid)
        except OSError:  # ESRCH: gone (and reaped)
            return None
        if not self.alive():  # a zombie, or another process given its pid since
            os.close(fd)
            return None
        return fd

    def clean_up(self, mountpoint: Path) -> None:
        """Once the mount at *mountpoint* (the path the owner mounted) is gone: what the owner would have
        done at its end.  Best effort: whatever is no longer there, or changed since, is left alone."""
        if self.headers is not None:
            link, before = self.headers
            try:
                catalog.unlink_headers(mountpoint, (Path(link), before))
            except OSError:
                pass
        if self.temp_dir:
            try:
                mountpoint.rmdir()  # never what another mount covers, nor what is not empty
            except OSError:
                pass
