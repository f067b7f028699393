"""The supervisor: keeps a mount alive across its daemon's crash or upgrade.

``python -m mithrilfs.daemon.supervisor MOUNTPOINT MOUNT_ID DEV HOW FD LOCK PID``,
started by the daemon right after it mounts, with a duplicate of the
/dev/fuse fd as FD, one of the store's lock as LOCK, and its end of the daemon's channel as stdin
(``daemon.channel``), on which it also receives a descriptor of every
file's staging content (for content staged in memory, of the mirrors the
daemon reuses, and their slot table: ``daemon.mirrors``).  While any process holds that fd the kernel keeps
the connection: when the daemon dies, requests wait in the kernel instead
of failing with ENOTCONN, and the mount point never shows the directory
under it.

When the channel closes:

- the mount is gone (the daemon unmounted, or someone did): exit;
- the daemon said ``handoff`` (``mithrilfs restart``): start a successor
  from the code installed now, with the session and options it had;
- otherwise it died: start a successor the same way, with the staging
  content of every file being written (``WritePath.adopt``) and the
  inodes whose content was already lost (``WritePath.torn``).  The
  descriptors are held until the successor serves, so a successor that
  dies at start loses nothing either.  When ``CRASH_LOOP_LIMIT``
  successors in a row die before they served for ``QUICK_DEATH_SECONDS``
  (they fail at start, or on the first request they are resent), the
  mount is given up on: it is detached (programs then get ENOTCONN, as before
  this existed) and the reason goes to the log, the event log and
  ``status``.  So does a mount whose daemon asked for ``--on-crash detach``
  or died before INIT (nothing to take over).

A daemon is dead when its socket closes or when its main thread is gone:
a daemon killed while one of its threads waited on the mount itself (a
notification the kernel applies under a directory lock, say) cannot
finish exiting until someone answers that request, which only the
successor can do; so the supervisor does not wait for the whole process.

A mount made for one process (``run``'s: ``daemon.owner``) goes when that
process is gone: the supervisor watches it through a pidfd beside the
channel, sends the daemon SIGTERM (the clean unmount), starts no successor,
and puts right what the process left (``Owner.clean_up``) before it exits.

The mount to detach is matched by mount id and device, so a later mount at
the same path is never touched.  A successor is the supervisor's child;
its exit status names the cause of its death in the log, and its stdout
and stderr go there too (a successor that dies importing a broken install
says why only there).
"""

from __future__ import annotations

import array
import json
import logging
import os
import select
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

from mithrilfs import crash_points
from mithrilfs.daemon import ended, mirrors
from mithrilfs.daemon.channel import Handover, Restarts
from mithrilfs.daemon.owner import Owner
from mithrilfs.daemon.process import pid_alive, raise_fd_limit
from mithrilfs.kernel import SessionParameters
from mithrilfs.kernel.mount import FSTYPE, detach, mount_entries
from mithrilfs.observe.events import EventLog

log = logging.getLogger("mithrilfs.supervisor")

CRASH_LOOP_LIMIT = 3
QUICK_DEATH_SECONDS = 1.0
#: The longest message the daemon sends (its options), and the most descriptors one carries.
_MESSAGE_MAX = 1 << 20
_FDS_MAX = mirrors.BATCH


class Supervisor:
    def __init__(self, mountpoint: str, mount_id: int, dev: str, how: str, fuse_fd: int, lock_fd: int,
                 daemon: int) -> None:
        self.mountpoint = mountpoint
        #: The store's lock: the mount's, whichever daemon serves.
        self.lock_fd = lock_fd
        #: The kernel's lookup counts (``cache.lookups``), shared by every daemon of the mount.
        self.lookups_fd = -1
        #: The journal of creates not committed yet (``cache.create_journal``), likewise.
        self.creates_fd = -1
        #: The daemon serving now (the first one is our parent; later ones our children).
        self.daemon = daemon
        #: Successors that died with a thread still stuck on the mount: reaped once they can be.
        self.dying: list[subprocess.Popen] = []
        #: The duplicate of the mount's /dev/fuse fd that keeps the connection alive.
        self.fuse_fd = fuse_fd
        self.mount_id = mount_id
        self.dev = dev
        self.via_fusermount = how == "fusermount3"
        self.options: dict[str, Any] | None = None
        self.session: SessionParameters | None = None
        #: Inodes being written: (descriptor of the staging content or -1 when it was lost, staging path).
        self.written: dict[int, tuple[int, str | None]] = {}
        #: What the current daemon inherited, held until it says it serves.
        self.inherited: dict[int, tuple[int, str | None]] = {}
        #: The current daemon's mirrors (slot -> descriptor) and their slot table (``daemon.mirrors``).
        self.mirrors: dict[int, int] = {}
        self.mirror_table = -1
        #: One buffer for every message (a fresh megabyte per message cost more than the rest of its handling).
        self._buffer = bytearray(_MESSAGE_MAX)
        self.restarts = Restarts()
        #: Successors in a row that died before serving for ``QUICK_DEATH_SECONDS``.
        self.quick_deaths = 0
        #: When the current daemon began to serve (None: not yet).
        self.serving_since: float | None = None
        self.child: subprocess.Popen | None = None
        self.events = EventLog(None)
        #: The process the mount is for (``daemon.owner``), watched through ``owner_fd`` until it ends.
        self.owner: Owner | None = None
        self.owner_fd = -1
        self.owner_gone = False

    # -- the channel ---------------------------------------------------------
    def _keep(self, ino: int, fd: int, path: str | None) -> None:
        old = self.written.get(ino)
        if old is not None and old[0] >= 0:
            os.close(old[0])
        self.written[ino] = (fd, path)

    def _settle(self, ino: int) -> None:
        old = self.written.pop(ino, None)
        if old is not None and old[0] >= 0:
            os.close(old[0])

    def _serving(self) -> None:
        """The current daemon serves: it has told us anew what it adopted, so what it inherited can go."""
        for fd, _ in self.inherited.values():
            if fd >= 0:
                os.close(fd)
        self.inherited = {}

    def _claim_mirrors(self) -> None:
        """The daemon is gone: the mirrors whose slot names an inode hold its staged content, unless a message
        about that inode came (``daemon.channel``)."""
        for ino, fd in mirrors.claimed(self.mirror_table, self.mirrors).items():
            if ino in self.written:
                os.close(fd)
            else:
                self.written[ino] = (fd, None)
        self.mirrors, self.mirror_table = {}, -1

    def _receive(self, channel: socket.socket) -> tuple[str, list[int], int]:
        """One message: its text, its descriptors and the flags (``MSG_CTRUNC``: descriptors were lost)."""
        n, ancdata, flags, _ = channel.recvmsg_into([self._buffer], socket.CMSG_SPACE(_FDS_MAX * 4))
        fds: list[int] = []
        for level, kind, data in ancdata:
            if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
                fds += array.array("i", data[:len(data) - len(data) % 4])
        return self._buffer[:n].decode(errors="replace"), fds, flags

    def listen(self, channel: socket.socket) -> bool:
        """Read the daemon's messages until it closes the socket or dies; True if it asked for a handoff."""
        try:
            return self._listen(channel)
        finally:
            self._claim_mirrors()

    def _listen(self, channel: socket.socket) -> bool:
        handoff = False
        while True:
            ready = select.select([channel.fileno(), *([self.owner_fd] if self.owner_fd >= 0 else [])], [], [],
                                  0.5)[0]
            if self.owner_fd in ready:
                self._owner_ended()
            if channel.fileno() not in ready:
                self.dying = [p for p in self.dying if p.poll() is None]
                if not not pid_alive(self.daemon):
                    continue
                channel.setblocking(False)  # what it sent before it died, then the end
                try:
                    text, fds, flags = self._receive(channel)
                except BlockingIOError:
                    return handoff
            else:
                text, fds, flags = self._receive(channel)
            if not text and not fds:
                return handoff
            verb, _, rest = text.partition(" ")
            if verb == "s":
                ino, _, path = rest.partition(" ")
                for extra in fds[1:]:
                    os.close(extra)
                if fds and not flags & socket.MSG_CTRUNC:
                    self._keep(int(ino), fds[0], path or None)
                else:  # the descriptor did not reach us: what we hold is stale, the file counts as lost
                    for fd in fds[:1]:
                        os.close(fd)
                    log.warning("the staging of inode %s reached us without its descriptor", ino)
                    self._keep(int(ino), -1, None)
                continue
            if verb == "lookups" and fds and self.lookups_fd < 0:
                self.lookups_fd, fds = fds[0], fds[1:]
            elif verb == "creates" and fds and self.creates_fd < 0:
                self.creates_fd, fds = fds[0], fds[1:]
            elif verb == "mirror-slots" and fds and self.mirror_table < 0:
                self.mirror_table, fds = fds[0], fds[1:]
            elif verb == "mirrors":
                for slot, fd in zip(map(int, rest.split()), fds):
                    self.mirrors[slot] = fd
                fds = fds[len(rest.split()):]
            for extra in fds:
                os.close(extra)
            if verb == "w":
                if int(rest) not in self.written:
                    self.written[int(rest)] = (-1, None)
            elif verb == "x":
                self._keep(int(rest), -1, None)
            elif verb == "c":
                self._settle(int(rest))
            elif verb == "unmirror":
                fd = self.mirrors.pop(int(rest), -1)
                if fd >= 0:
                    os.close(fd)
            elif verb == "ready":
                self.serving_since = time.monotonic()
                self._serving()
            elif verb == "options":
                self._configure(rest)
            elif verb == "session":
                minor, caps, max_write = (int(x) for x in rest.split())
                self.session = SessionParameters(minor, caps, max_write)
            elif verb == "handoff":
                handoff = True

    def _configure(self, text: str) -> None:
        self.options = json.loads(text)
        if self.owner is None:
            self.owner = Owner.from_json(self.options.get("owner"))
            if self.owner is not None:
                fd = self.owner.watch()
                if fd is None:
                    self._owner_ended()
                else:
                    self.owner_fd = fd
        store = Path(self.options["store"])
        self.events = EventLog(None if self.options.get("read_only") else store / "events.jsonl")
        if not self.options.get("foreground") and not logging.getLogger().handlers:
            try:
                handler: logging.Handler = logging.FileHandler(store / "mithrilfs.log")
            except OSError:
                handler = logging.StreamHandler(sys.stderr)
            handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
            logging.getLogger().addHandler(handler)
            logging.getLogger().setLevel(logging.INFO)
        elif not logging.getLogger().handlers:
            logging.basicConfig(stream=sys.stderr, level=logging.INFO,
                                format="%(asctime)s %(levelname)s %(name)s: %(message)s")

    def _owner_ended(self) -> None:
        """The process the mount is for is gone without taking it down (SIGKILL): the daemon unmounts, as
        at SIGTERM; ``run`` then starts no successor, and ``main`` cleans up after the owner."""
        if self.owner_fd >= 0:
            os.close(self.owner_fd)
            self.owner_fd = -1
        self.owner_gone = True
        assert self.owner is not None
        log.warning("process %d, which %s was mounted for, is gone: unmounting", self.owner.pid, self.mountpoint)
        try:
            os.kill(self.daemon, signal.SIGTERM)
        except OSError:
            pass

    # -- after the daemon ----------------------------------------------------
    def mounted(self) -> bool:
        try:
            return (self.mount_id, self.dev, FSTYPE) in mount_entries(self.mountpoint)
        except OSError:
            return False

    def how_it_ended(self) -> str:
        """The dead daemon's exit, when it was our child (a successor); the first daemon is our parent."""
        if self.child is None:
            return "the daemon exited"
        child, self.child = self.child, None
        try:
            code = child.wait(timeout=1)
        except subprocess.TimeoutExpired:
            self.dying.append(child)
            return "the daemon died (a thread of it still waits on the mount)"
        if code < 0:
            return f"the daemon was killed by signal {-code} ({signal.Signals(-code).name})"
        return f"the daemon exited with status {code}"

    def give_up(self, reason: str) -> int:
        log.error("%s: detaching %s (programs using it now get ENOTCONN)", reason, self.mountpoint)
        self.events.emit("daemon_given_up", mountpoint=self.mountpoint, reason=reason, restarts=self.restarts.count)
        ended.record(self.mountpoint, reason)
        try:
            if self.mounted():
                detach(self.mountpoint, via_fusermount=self.via_fusermount)
        except OSError as e:
            log.error("could not detach %s: %s", self.mountpoint, e)
            return 1
        return 1

    def start_successor(self, cause: str) -> socket.socket:
        """Start a daemon from the installed code on the same fd; returns our end of its channel."""
        assert self.options is not None and self.session is not None
        self.restarts = Restarts(self.restarts.count + 1, cause, round(time.time(), 3))
        # what an earlier successor inherited and never took up (it died before serving) is still due
        for ino, kept in self.inherited.items():
            if ino not in self.written:
                self.written[ino] = kept
            elif kept[0] >= 0:
                os.close(kept[0])
        self.inherited = {}
        ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        staged: list[list[Any]] = [[ino, fd, path] for ino, (fd, path) in sorted(self.written.items()) if fd >= 0]
        staged_fds = [fd for _, (fd, _) in self.written.items() if fd >= 0]
        handover = Handover(options=self.options, session=self.session,
                            torn=sorted(ino for ino, (fd, _) in self.written.items() if fd < 0), staged=staged,
                            restarts=self.restarts, fuse_fd=self.fuse_fd, lock_fd=self.lock_fd,
                            lookups_fd=self.lookups_fd, creates_fd=self.creates_fd, channel_fd=theirs.fileno())
        foreground = bool(self.options.get("foreground"))
        env = dict(os.environ)
        if not env.get(crash_points.VARIABLE, "takeover").startswith("takeover"):
            del env[crash_points.VARIABLE]  # the tests' crash points kill the first daemon only (but the one at takeover)
        output = None if foreground else self._successor_output()
        try:
            self.child = subprocess.Popen(
                [sys.executable, "-m", "mithrilfs.daemon.successor"], stdin=subprocess.PIPE,
                stdout=output, stderr=output,
                pass_fds=(self.fuse_fd, self.lock_fd, theirs.fileno(), *staged_fds,
                          *(fd for fd in (self.lookups_fd, self.creates_fd) if fd >= 0)), cwd="/",
                start_new_session=not foreground, env=env)
            assert self.child.stdin is not None
            self.child.stdin.write(handover.dumps().encode())
            self.child.stdin.close()
        finally:
            theirs.close()
            if output is not None and output != subprocess.DEVNULL:
                os.close(output)
        # the successor tells us anew what it adopts; until it serves, we hold what it inherited
        self.inherited, self.written = self.written, {}
        self.serving_since = None
        self.daemon = self.child.pid
        log.info("started daemon %d on the live mount %s (%s; %d files being written handed on, %d lost)",
                 self.child.pid, self.mountpoint, cause, len(staged), len(handover.torn))
        return ours

    def _successor_output(self) -> int:
        """Where a successor's stdout and stderr go: the store's log, so that what a successor that dies
        before its logging is set up says (an import's traceback) is kept; /dev/null for a read-only store."""
        assert self.options is not None
        if not self.options.get("read_only"):
            try:
                return os.open(Path(self.options["store"]) / "mithrilfs.log",
                               os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
            except OSError as e:
                log.warning("cannot open the store's log for the new daemon's output: %s", e)
        return subprocess.DEVNULL

    def _wait_gone(self, seconds: float | None) -> bool:
        """Wait until the daemon's main thread is gone (for ever when *seconds* is None); True if it is."""
        deadline = None if seconds is None else time.monotonic() + seconds
        while not not pid_alive(self.daemon):
            if deadline is not None and time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True

    def run(self, channel: socket.socket) -> int:
        while True:
            handoff = self.listen(channel)
            channel.close()
            # a daemon that closed its line and lives on (it could no longer send) must never get a
            # second daemon beside it on the same connection; when it dies, what we know is stale
            lost_line = not handoff and not self._wait_gone(5.0)
            if lost_line:
                log.error("daemon %d closed its line to the supervisor but runs on: a crash of it will detach "
                          "the mount", self.daemon)
                self._wait_gone(None)
            how = self.how_it_ended()
            if not self.mounted():
                return 0
            if self.owner_gone:  # the mount was for a process that is gone: no successor
                log.warning("%s; the process the mount was for is gone: detaching %s", how, self.mountpoint)
                detach(self.mountpoint, via_fusermount=self.via_fusermount)
                return 0
            if lost_line:
                return self.give_up(f"{how}, after it had lost its line to the supervisor")
            if handoff:
                cause = "restart"
            else:
                cause = "crash"
                if self.restarts.count:  # a successor (the first daemon's death is no loop)
                    served = time.monotonic() - self.serving_since if self.serving_since is not None else 0.0
                    self.quick_deaths = self.quick_deaths + 1 if served < QUICK_DEATH_SECONDS else 0
                log.warning("%s without unmounting %s", how, self.mountpoint)
                if self.options is None or self.session is None:
                    return self.give_up(f"{how} before INIT was answered (nothing to take over)")
                if self.options.get("on_crash") == "detach":
                    return self.give_up(f"{how} (mounted with --on-crash detach)")
                if self.quick_deaths >= CRASH_LOOP_LIMIT:
                    return self.give_up(f"{self.quick_deaths} new daemons in a row died within "
                                        f"{QUICK_DEATH_SECONDS:.0f} s of their start (last: {how})")
            try:
                channel = self.start_successor(cause)
            except OSError as e:
                return self.give_up(f"cannot start a new daemon: {e}")


def main(argv: list[str]) -> int:
    mountpoint, mount_id, dev, how = argv[0], int(argv[1]), argv[2], argv[3]
    fuse_fd, lock_fd, daemon = int(argv[4]), int(argv[5]), int(argv[6])  # the daemon may be gone by now
    # a terminal's Ctrl-C reaches the whole process group: outlive the daemon, not die with it
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    raise_fd_limit()  # one descriptor per file being written: thousands while a compile writes its cache
    supervisor = Supervisor(mountpoint, mount_id, dev, how, fuse_fd, lock_fd, daemon)
    code = supervisor.run(socket.socket(fileno=0))
    if supervisor.owner_gone and supervisor.owner is not None and supervisor.options is not None:
        supervisor.owner.clean_up(Path(supervisor.options["mountpoint"]))  # before the store's lock goes
    return code



if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
