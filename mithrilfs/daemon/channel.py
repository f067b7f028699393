"""What a daemon tells its supervisor, and what a supervisor hands the daemon that takes over.

The daemon sends one message per datagram on a ``SOCK_SEQPACKET`` socket
whose other end the supervisor reads (``daemon.supervisor``):

- ``options JSON``: how to start a daemon like this one (``MountOptions``,
  secrets included: they never leave these two processes);
- ``lookups`` with a descriptor: the kernel's lookup counts
  (``cache.lookups``), shared with every daemon of the mount;
- ``creates`` with a descriptor: the journal of creates answered and not
  committed yet (``cache.create_journal``), likewise;
- ``session MINOR CAPS MAX_WRITE``: what INIT agreed, once it has;
- what is being written (``cache.write_watcher.WriteWatcher``): ``s INO
  PATH`` with a file descriptor attached (SCM_RIGHTS): the inode's
  staging content lives in that staging file; ``w INO``: it has
  uncommitted writes; ``x INO``: its uncommitted content was dropped; ``c
  INO``: nothing uncommitted is left (said of an inode only after one of
  those); content staged in memory is in mirrors (``daemon.mirrors``:
  ``mirror-slots``, ``mirrors SLOT...`` and ``unmirror SLOT``, with no
  message per file), and a message about an inode wins over a mirror's
  slot naming it.  The supervisor holds those descriptors, so the staging
  content outlives the daemon;
- ``ready PID``: the daemon serves;
- ``handoff``: a restart: the daemon committed everything, stopped reading
  and exits; the supervisor starts the successor at once.

The socket closing without ``handoff`` while the mount is still there
means the daemon died.  A successor gets a ``Handover`` as JSON on its
stdin and the descriptors it names.  Sends block (the supervisor always
drains the socket), so no message is ever dropped.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import select
import socket
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from mithrilfs.cache.write_watcher import NoWriteWatcher, WriteWatcher
from mithrilfs.daemon.mirrors import MirrorPool
from mithrilfs.kernel import SessionParameters

log = logging.getLogger(__name__)


@dataclass
class Restarts:
    """How often the mount's daemon was replaced, and the last time why (``stats``, ``status``)."""

    count: int = 0
    cause: str | None = None
    at: float | None = None

    def as_stats(self) -> dict[str, Any]:
        return {"restarts": self.count, "last_restart_cause": self.cause, "last_restart_at": self.at}


@dataclass
class Handover:
    """What a successor daemon gets from the supervisor."""

    options: dict[str, Any]
    session: SessionParameters
    #: Inodes whose uncommitted content the previous daemon lost (``WritePath.torn``).
    torn: list[int] = field(default_factory=list)
    #: [inode, fd, staging path or None]: staging content the previous daemon left (``WritePath.adopt``).
    staged: list[list[Any]] = field(default_factory=list)
    restarts: Restarts = field(default_factory=Restarts)
    #: The inherited /dev/fuse fd, the store's lock (held by the supervisor for the life of the mount:
    #: a killed daemon may take a while to let go of its own), and the successor's end of its channel.
    fuse_fd: int = -1
    lock_fd: int = -1
    #: The kernel's lookup counts (``cache.lookups``).
    lookups_fd: int = -1
    #: Creates the previous daemon answered and had not committed (``cache.create_journal``).
    creates_fd: int = -1
    channel_fd: int = -1
    #: The supervisor reads mirror slots (``daemon.mirrors``); one of older code does not, and its successor
    #: stages in files what it would have staged in memory.
    mirror_slots: bool = True

    def dumps(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def loads(cls, text: str) -> Handover:
        d = json.loads(text)
        return cls(options=d["options"], session=SessionParameters(**d["session"]), torn=list(d["torn"]),
                   staged=list(d["staged"]), restarts=Restarts(**d["restarts"]), fuse_fd=int(d["fuse_fd"]), lock_fd=int(d["lock_fd"]),
                   lookups_fd=int(d["lookups_fd"]), creates_fd=int(d.get("creates_fd", -1)),
                   channel_fd=int(d["channel_fd"]),
                   mirror_slots=bool(d.get("mirror_slots", False)))


class Supervisor(WriteWatcher, Protocol):
    """The daemon's line to whoever keeps the mount alive across its death (see the module doc):
    told what is being written (``WriteWatcher``), the session once INIT is answered (``connected``),
    when the daemon serves, and when it hands over."""

    def connected(self, params: SessionParameters) -> None:
        """INIT is answered: from now on a successor can take the connection over, so say how."""

    def serving(self) -> None: ...

    def handing_over(self) -> None: ...

    def state(self) -> str:
        """'alive'; 'gone' (it died: a crash of this daemon now leaves a dead mount, and a restart has
        nobody to hand over to); 'none' (this mount never had one)."""
        ...

    def close(self) -> None: ...


class NoSupervisor(NoWriteWatcher):
    """No successor will come (its supervisor could not be started): nothing to tell."""

    def connected(self, params: SessionParameters) -> None:
        pass

    def serving(self) -> None:
        pass

    def handing_over(self) -> None:
        pass

    def state(self) -> str:
        return "none"

    def close(self) -> None:
        pass


class SupervisorLink:
    """The daemon's end of the socket to the supervisor."""

    def __init__(self, fd: int, options: dict[str, Any], lookups_fd: int | None = None,
                 creates_fd: int | None = None, *, mirror_slots: bool = True) -> None:
        """*lookups_fd* and *creates_fd*: the lookup counts and the journal of creates to share (a new
        mount's; a successor's supervisor has them).  *mirror_slots*: the supervisor reads mirror slots
        (``Handover.mirror_slots``)."""
        self.sock: socket.socket | None = socket.socket(fileno=fd)
        self.sock.setblocking(True)
        #: A crash of a daemon that detaches keeps nothing: no staging content to mirror.
        self.keeps_content = options.get("on_crash") != "detach"
        self.mirrors = MirrorPool(self._send) if mirror_slots and self.keeps_content else None
        #: Its death was logged (once).
        self.gone_noticed = False
        self._send("options " + json.dumps(options))
        if lookups_fd is not None:
            self._send("lookups", (lookups_fd,))
        if creates_fd is not None and self.keeps_content:
            self._send("creates", (creates_fd,))

    def _send(self, line: str, fds: Sequence[int] = ()) -> bool:
        """Send one message; False when the supervisor is gone."""
        if self.sock is None:
            return False
        try:
            if fds:
                socket.send_fds(self.sock, [line.encode()], list(fds))
            else:
                self.sock.send(line.encode())
        except OSError as e:  # the supervisor is gone: the mount no longer outlives this daemon
            log.warning("the supervisor stopped listening (%s): a crash of this daemon now leaves a dead mount", e)
            self.close()
            return False
        return True

    def staging(self, ino: int, fd: int, path: str) -> None:
        self._send(f"s {ino} {path}", (fd,))

    def mirror(self, ino: int, content: bytes | bytearray | memoryview = b"") -> int:
        if self.mirrors is None:
            raise OSError(errno.ENOTSUP, "this supervisor keeps no mirrors")
        return self.mirrors.take(ino, content)

    def unmirror(self, fd: int) -> None:
        if self.mirrors is not None:
            self.mirrors.give_back(fd)
        else:
            os.close(fd)

    def writing(self, ino: int) -> None:
        self._send(f"w {ino}")

    def lost(self, ino: int) -> None:
        self._send(f"x {ino}")

    def settled(self, ino: int) -> None:
        self._send(f"c {ino}")

    def connected(self, params: SessionParameters) -> None:
        self._send(f"session {params.proto_minor} {params.capabilities} {params.max_write}")

    def serving(self) -> None:
        self._send(f"ready {os.getpid()}")

    def handing_over(self) -> None:
        self._send("handoff")

    def state(self) -> str:
        """The supervisor never writes to this socket, so its end being readable means it closed: the
        supervisor is gone (killed: it never exits while the mount is there)."""
        if self.sock is None:
            return "gone"
        try:
            if not select.select([self.sock], [], [], 0)[0]:
                return "alive"
            if self.sock.recv(1, socket.MSG_PEEK | socket.MSG_DONTWAIT):
                return "alive"
        except BlockingIOError:
            return "alive"
        except OSError:
            pass
        if not self.gone_noticed:
            self.gone_noticed = True
            log.error("the supervisor of this mount is gone: a crash of this daemon now leaves a dead mount, "
                      "and restart is refused (unmount and mount again to get a new one)")
        return "gone"

    def close(self) -> None:
        """The line is closed: nobody keeps staging content from now on (mirrors in use stay until given back)."""
        self.keeps_content = False
        if self.sock is not None:
            self.sock.close()
            self.sock = None
