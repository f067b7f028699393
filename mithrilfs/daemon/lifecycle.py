"""Mount lifecycle: open the store, mount, daemonize once the mount answers, stop cleanly, hand over.

``mount`` forks before any trio or FUSE state exists.  The child mounts,
starts its supervisor (``daemon.supervisor``: it holds a copy of the fd
and replaces a daemon that dies; it learns the session as soon as INIT is
answered), proves the mount answers by reading a control file from a
process of its own (which goes through the kernel to our own handlers),
and only then writes ``ok`` down a pipe; the parent exits 0 on ``ok``,
also when the pipe closes without it but a successor took the mount over
(the first daemon died after INIT), and prints the child's one-line error
otherwise.  With
``--foreground`` the parent stays instead, until the mount is gone,
passing SIGTERM/SIGINT to whichever daemon serves then: so a container or
a systemd unit sees one process whatever the daemons underneath do.
SIGTERM/SIGINT end the FUSE loop; the mount is then detached and the store
marked clean.

A successor (``daemon.successor``) runs ``serve`` with the ``Handover``
its supervisor gives it: the same store and options, the inherited fd and
session instead of a new mount, a recovery that leaves what the kernel
still holds alone (``recover(live=True)``), the torn files marked, and the
kernel asked to resend what the dead daemon left unanswered
(``Session.adopt``).  ``restart`` (the control file) is the clean way
there: the daemon stops reading, finishes what it was doing, commits
every written file (unconfirmed, as at an unmount: a writer that goes on
writing continues from there), closes the store and tells the supervisor
``handoff`` instead of unmounting.
"""

from __future__ import annotations

import dataclasses
import errno
import fcntl
import json
import logging
import logging.handlers
import os
import signal
import socket
import sqlite3
import subprocess
import sys
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import trio

from mithrilfs import kernel
from mithrilfs.cache.eviction import EvictionPolicy
from mithrilfs.cache.lifetime import Removed
from mithrilfs.cache.lookups import LookupCounts
from mithrilfs.cache.writepath import crash_point
from mithrilfs.control.files import CONTROL_NAME
from mithrilfs.daemon import ended, upgrade, wiring
from mithrilfs.daemon.channel import Handover, NoSupervisor, Restarts, Supervisor, SupervisorLink
from mithrilfs.daemon.process import call_within, pid_alive, raise_fd_limit
from mithrilfs.daemon.wiring import TierOptions
from mithrilfs.errors import UsageError
from mithrilfs.jitcaches import catalog
from mithrilfs.kernel.mount import FSTYPE, mount_entries, unescape_mount_field
from mithrilfs.observe.metrics import MetricsServer
from mithrilfs.shared.connect import RemoteSpec, open_remote
from mithrilfs.shared.s3_settings import S3Settings
from mithrilfs.store.open import (
    HOLDER_FILE,
    RESERVE_BYTES,
    Store,
    StoreError,
    holder_record,
    open_store,
    validate_store,
)

log = logging.getLogger(__name__)

READY_TIMEOUT = 60.0
#: How long ``--foreground`` waits, once the mount is gone, for its daemon and supervisor to close the store.
SHUTDOWN_TIMEOUT = 120.0
LOG_FILE = "mithrilfs.log"


class MountError(Exception):
    """A mount that cannot proceed, described in one line."""


@dataclass
class MountOptions:
    mountpoint: Path
    store: Path
    foreground: bool = False
    allow_other: bool = False
    debug: bool = False
    policy: EvictionPolicy = field(default_factory=EvictionPolicy)
    metrics_port: int | None = None
    remote: str | None = None
    #: A bucket behind the Redis of ``remote`` (``--remote redis://... --remote s3://...``).
    remote_behind: str | None = None
    #: The bucket's endpoint, region and credentials (``s3_settings.S3Settings.as_json``): secrets, like the
    #: password, travel only between the CLI, the daemon and its supervisor.
    remote_s3: dict[str, Any] | None = None
    remote_namespace: str = "default"
    remote_key: bytes | None = None
    #: Kept out of the URL (and so out of the process list and the logs).
    remote_password: str | None = None
    remote_cluster: bool = False
    #: Owner of entries materialized from the shared tier (default: the mount root's).
    remote_owner: tuple[int, int] | None = None
    #: The startup set this mount records its workload's first reads into.
    startup_set: str = "default"
    #: A startup set to prefetch once the mount serves (by default the recorded one; None: ``--no-prefetch``).
    prefetch: str | None = None
    #: Nobody waits for that prefetch (the default, not ``--prefetch``): it runs in the background.
    prefetch_background: bool = False
    #: Mount over a directory that holds files (hiding them).
    nonempty: bool = False
    #: Settings (``settings.SETTINGS`` names) given on the command line: they beat the store's.
    fixed_settings: frozenset[str] = frozenset()
    #: What the supervisor does when the daemon dies: start a successor ("takeover") or detach ("detach").
    on_crash: str = "takeover"

    def remote_spec(self) -> RemoteSpec:
        """The shared store these options name (``remote`` must be set)."""
        assert self.remote is not None
        return RemoteSpec(self.remote, self.remote_namespace, self.remote_key, self.remote_password,
                          self.remote_cluster, self.remote_behind,
                          S3Settings.from_json(self.remote_s3) if self.remote_s3 is not None else None)

    def as_json(self) -> dict[str, Any]:
        """Everything a successor needs to serve like this daemon (secrets included: see ``daemon.channel``)."""
        d = {k: v for k, v in vars(self).items() if k not in ("policy", "fixed_settings", "remote_key")}
        d.update(mountpoint=str(self.mountpoint), store=str(self.store), policy=dataclasses.asdict(self.policy),
                 fixed_settings=sorted(self.fixed_settings),
                 remote_key=self.remote_key.hex() if self.remote_key is not None else None)
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> MountOptions:
        d = dict(d)
        d.update(mountpoint=Path(d["mountpoint"]), store=Path(d["store"]), policy=EvictionPolicy(**d["policy"]),
                 fixed_settings=frozenset(d["fixed_settings"]),
                 remote_key=bytes.fromhex(d["remote_key"]) if d["remote_key"] is not None else None,
                 remote_owner=tuple(d["remote_owner"]) if d["remote_owner"] is not None else None)
        return cls(**{f.name: d[f.name] for f in dataclasses.fields(cls) if f.name in d})


# ----------------------------------------------------------------------
# checks on the mount point (run in the CLI process, before forking)
# ----------------------------------------------------------------------
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
    res = subprocess.run(["fusermount3", "-u", "-z", str(mountpoint)], capture_output=True, text=True)
    if res.returncode != 0:
        detail = (res.stderr.strip().splitlines() or ["fusermount3 failed"])[-1]
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


# ----------------------------------------------------------------------
# mount
# ----------------------------------------------------------------------
def mount(opts: MountOptions) -> int:
    """Mount and return the exit status for the CLI (0 once the mount answers)."""
    check_mountpoint(opts.mountpoint, opts.store, nonempty=opts.nonempty)
    # resolved before anything is mounted there: a path through a mount whose daemon is gone would wait
    target = os.path.realpath(opts.mountpoint)
    ended.clear(target)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the daemon
        os.close(r)
        if opts.foreground:
            setup_logging(None, opts.debug)  # stderr stays the terminal's (or the container's)
        else:
            os.setsid()
            _detach_stdio()
        code = 1
        try:

            def announce(msg: str) -> None:
                try:
                    os.write(w, (msg + "\n").encode())
                except OSError:
                    pass

            code = serve(opts, announce, log_in_store=not opts.foreground)
        finally:
            os._exit(code)
    os.close(w)
    asked: list[int] = []
    if opts.foreground:  # from now on a signal is for the daemon (passed on once it serves)
        for signum in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP):
            signal.signal(signum, lambda signum, _: asked.append(signum))
    msg = _read_line(r, READY_TIMEOUT)
    os.close(r)
    if msg is not None and msg.startswith("ok"):
        return _mounted(opts, target, pid, asked, read_only=msg == READY_READ_ONLY)
    if msg is None:
        os.kill(pid, signal.SIGTERM)
        raise MountError(f"the mount did not answer within {READY_TIMEOUT:.0f} s")
    successor = _successor_serving(target, opts.store, pid) if not msg else None
    if successor is not None:
        return _mounted(opts, target, pid, asked, read_only=bool(successor.get("read_only")),
                        note="its first daemon died at start; daemon "
                             f"{successor['pid']} took the mount over")
    os.waitpid(pid, 0)
    raise MountError(msg or ended.read(target) or "the daemon exited before the mount was ready")


def _mounted(opts: MountOptions, target: str, first: int, asked: list[int], *, read_only: bool,
             note: str = "") -> int:
    """The mount serves: say so (in the foreground, or with a *note*) and, in the foreground, stay."""
    if opts.foreground or note:
        print(f"mithrilfs: mounted {opts.mountpoint} (store {opts.store}{'; ' + note if note else ''})",
              file=sys.stderr, flush=True)
    if read_only:
        print(read_only_notice(opts.store), file=sys.stderr, flush=True)
    return _stay_in_foreground(opts, target, first, asked) if opts.foreground else 0


def _successor_serving(target: str, store: Path, first: int) -> dict[str, Any] | None:
    """The first daemon died without announcing: the stats of the successor once one serves the mount
    of *store*; None when the mount is gone (its supervisor gave it up), dead (none was started) or
    unserved for READY_TIMEOUT.

    A daemon that dies after INIT leaves a mount that programs may already use; its supervisor
    takes it over like any other crash, so the mount command succeeds too.  Nothing here waits on
    the mount outside ``call_within``: until a successor reads, every request to it waits.
    """
    want = os.path.realpath(store)
    deadline = time.monotonic() + READY_TIMEOUT
    while time.monotonic() < deadline:
        if not any(fstype == FSTYPE for _, _, fstype in mount_entries(target)):
            return None
        answer = call_within(lambda: _serving_stats(target), 1.0)
        if answer == "dead":
            return None
        if (isinstance(answer, dict) and answer.get("pid") not in (first, None)
                and os.path.realpath(str(answer.get("store"))) == want):
            return answer
        time.sleep(0.05)
    return None


def _serving_stats(target: str) -> dict[str, Any] | str | None:
    """The stats of the daemon serving the mount at *target*; 'dead' when none ever will; None: not yet."""
    try:
        stats = json.loads((Path(target) / CONTROL_NAME.decode() / "stats.json").read_text())
    except OSError as e:
        # ENOTCONN: nobody holds the connection; ECONNABORTED: a request queued as it was lost
        return "dead" if e.errno in (errno.ENOTCONN, errno.ECONNABORTED) else None
    except ValueError:
        return None
    return stats if isinstance(stats, dict) else None


def _stay_in_foreground(opts: MountOptions, target: str, first: int, asked: list[int]) -> int:
    """``--foreground``: wait until the mount is gone and its store closed; SIGTERM/SIGINT/SIGHUP (*asked*)
    go to the daemon serving then.

    0 after an unmount, 1 when the supervisor gave the mount up (``status`` says why).
    """
    while True:
        try:
            os.waitpid(first, os.WNOHANG)  # the first daemon is our child: no zombie
        except ChildProcessError:
            pass
        if not any(fstype == FSTYPE for _, _, fstype in mount_entries(target)):
            # the daemon goes on closing the store (the last commits, recency, marked clean) and the
            # supervisor holds its lock a moment longer: a container's main process exiting now would
            # have the runtime kill them half-way, and the next start recover as after a crash
            if not _wait_store_free(opts.store, time.monotonic() + SHUTDOWN_TIMEOUT):
                print(f"mithrilfs: warning: the store {opts.store} is still locked {SHUTDOWN_TIMEOUT:.0f} s "
                      "after the unmount; exiting anyway", file=sys.stderr, flush=True)
            return 1 if ended.read(target) else 0
        if asked:
            held = holder_record(opts.store)
            # a read-only store keeps no holder file
            pid = held["pid"] if held is not None else daemon_pid(opts.mountpoint)
            # during a takeover the holder may still name the dead daemon: the signal waits for the next
            if pid is not None and pid_alive(pid):
                asked.clear()
                try:
                    os.kill(pid, signal.SIGTERM)
                except OSError:
                    pass
        time.sleep(0.1)


#: What the daemon announces once its mount answers; the read-only store's variant makes the CLI say so.
READY, READY_READ_ONLY = "ok", "ok read-only"


def read_only_notice(store: Path) -> str:
    return (f"mithrilfs: note: the store {store} is on a read-only filesystem: mounted read-only"
            " (cached files are served; writes fail with EROFS)")


def _read_line(fd: int, timeout: float) -> str | None:
    """The first line from *fd*; '' on EOF, None on timeout."""
    import select

    deadline = time.monotonic() + timeout
    buf = b""
    while b"\n" not in buf:
        left = deadline - time.monotonic()
        if left <= 0:
            return None
        ready, _, _ = select.select([fd], [], [], left)
        if not ready:
            continue
        chunk = os.read(fd, 4096)
        if not chunk:
            break
        buf += chunk
    return buf.split(b"\n", 1)[0].decode(errors="replace")


def _detach_stdio() -> None:
    devnull = os.open(os.devnull, os.O_RDWR)
    for fd in (0, 1, 2):
        os.dup2(devnull, fd)
    os.close(devnull)


def setup_logging(path: Path | None, debug: bool) -> None:
    handler: logging.Handler
    if path is None:
        handler = logging.StreamHandler(sys.stderr)
    else:
        handler = logging.handlers.RotatingFileHandler(path, maxBytes=10 << 20, backupCount=2)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.DEBUG if debug else logging.INFO)


def serve(opts: MountOptions, announce: Callable[[str], None], *, log_in_store: bool = False,
          handover: Handover | None = None) -> int:
    """Open the store, mount (or take over, with *handover*), serve until unmounted, signalled or
    restarted; returns the exit status.

    An unexpected failure is logged with its traceback (where a log exists)
    and announced in one line: before the mount is ready, that line is what
    the ``mount`` command prints instead of a bare "the daemon exited".
    """
    try:
        return _serve(opts, announce, log_in_store=log_in_store, handover=handover)
    except Exception as e:
        log.exception("the daemon failed")
        where = f"; see {opts.store / LOG_FILE}" if log_in_store and logging.getLogger().handlers else ""
        announce(f"the daemon failed: {type(e).__name__}: {e}{where}")
        return 1


def _serve(opts: MountOptions, announce: Callable[[str], None], *, log_in_store: bool = False,
           handover: Handover | None = None) -> int:
    os.umask(0o077)  # the store's files (index, log, blobs) are the daemon's alone
    raise_fd_limit()  # a memfd per file being written (``cache.writepath``): thousands during a compile
    try:
        store = open_store(opts.store, lock_fd=handover.lock_fd if handover is not None else None)
    except StoreError as e:
        announce(str(e))
        return 1
    if log_in_store and not store.read_only:
        setup_logging(store.root / LOG_FILE, opts.debug)
    try:
        if handover is not None:
            crash_point("takeover")
            after_crash = handover.restarts.cause == "crash"
            if not store.read_only:
                _repair_at_startup(store, live=True, keep={path for _, _, path in handover.staged if path})
        else:
            after_crash = not store.read_only and _repair_at_startup(store)
        # a successor's mount was prefetched already: the startup set is fetched once per mount
        tier_options = TierOptions(owner=opts.remote_owner, startup_set=opts.startup_set,
                                   prefetch=opts.prefetch if handover is None else None,
                                   prefetch_background=opts.prefetch_background)
        if opts.remote is not None:
            tier_options.remote = open_remote(opts.remote_spec())
        if handover is not None:
            # the resolved path the first daemon mounted: resolving it here would wait on our own mount
            fuse = kernel.FuseMount(handover.fuse_fd, handover.options["mount_path"],
                                    bool(handover.options["via_fusermount"]))
        else:
            try:
                fuse = kernel.mount(str(opts.mountpoint), allow_other=opts.allow_other, read_only=store.read_only)
            except kernel.MountError as e:
                announce(f"cannot mount {opts.mountpoint}: {e}")
                return 1
        # shared with the supervisor: a successor must know exactly which inodes the kernel holds
        lookups = LookupCounts(handover.lookups_fd if handover is not None and handover.lookups_fd >= 0 else None)
        supervisor = _supervisor(fuse, opts, store, handover, lookups)
        # the kernel's INIT waits in the fd until the session reads (and the mount point with it): the
        # filesystem is built on the fd (its notifications need it); the mount goes if anything below fails
        notifier = kernel.Notifier(fuse.fd)
        failure = None
        try:
            mounted = wiring.build(store, opts.policy, notifier, tier_options, after_crash=after_crash,
                                   fixed_settings=opts.fixed_settings, supervisor=supervisor,
                                   restarts=handover.restarts if handover is not None else Restarts(),
                                   lookups=lookups)
            removed = _take_over(store, mounted, handover) if handover is not None else []
            metrics = None
            if opts.metrics_port is not None:
                try:
                    metrics = MetricsServer(opts.metrics_port, lambda: mounted.duties.cached_snapshot)
                except OSError as e:
                    failure = f"cannot serve metrics on 127.0.0.1:{opts.metrics_port}: {e.strerror}"
                    if handover is not None:  # a half-dead predecessor may hold the port: never fatal here
                        log.warning("%s; serving the mount without them", failure)
                        failure = None
        except BaseException:
            notifier.close()
            if handover is None:
                fuse.unmount()
            raise
        if failure is not None:
            notifier.close()
            if handover is None:
                fuse.unmount()
            announce(failure)
            return 1
        session = kernel.Session(fuse.fd, mounted.ops, interruptible=mounted.tier.slow, debug=opts.debug,
                                 notifier=notifier, request_times=mounted.request_times,
                                 after_reply=mounted.after_reply)
        if not store.read_only:  # named in the error a second mount of this store gets
            (store.root / HOLDER_FILE).write_text(json.dumps({"pid": os.getpid(), "mountpoint": str(opts.mountpoint)}))
        log.info("serving %s (store %s%s, pid %d, budget %d bytes%s)", opts.mountpoint, opts.store,
                 ", read-only" if store.read_only else "", os.getpid(), opts.policy.max_bytes,
                 f", taking over after a {handover.restarts.cause}" if handover is not None else "")
        mounted.duties.snapshot()
        if metrics is not None:
            metrics.start()
        restarter = upgrade.Restart(session, supervisor, str(store.root / LOG_FILE))
        restart = restarter.requested
        if isinstance(supervisor, SupervisorLink):  # without one, nobody would take over
            mounted.control.add_command(b"restart", restarter)
        # what an app container with no mithrilfs evaluates to put its JIT caches here (mithrilfs.jitcaches)
        mounted.control.add(b"env", lambda: catalog.shell_env(opts.mountpoint).encode())
        try:
            entry = fuse.mount_entry()
            if handover is None:
                crash_point("before_init")
            trio.run(_run, session, mounted, opts.mountpoint, announce, supervisor, handover, restart,
                     entry[1] if entry is not None else None, removed)
        except kernel.ProtocolError as e:
            announce(str(e))
            return 1
        finally:
            if metrics is not None:
                metrics.stop()
            session.close()
            if restart.is_set():
                mounted.duties.hand_over()
                log.info("handing %s over to a new daemon", opts.mountpoint)
            else:
                fuse.unmount()
                (store.root / HOLDER_FILE).unlink(missing_ok=True)
                mounted.duties.shutdown()
                mounted.events.emit("unmount", mountpoint=str(opts.mountpoint), **{
                    k: mounted.duties.cached_snapshot.get(k, 0) for k in ("hits", "misses", "commits", "evictions")})
                log.info("unmounted %s", opts.mountpoint)
        if restart.is_set():
            store.close()  # the index closed before the successor opens it (the lock is the supervisor's)
            supervisor.handing_over()
        supervisor.close()
        return 0
    finally:
        store.close()


def _supervisor(fuse: kernel.FuseMount, opts: MountOptions, store: Store, handover: Handover | None,
                lookups: LookupCounts) -> Supervisor:
    """The daemon's line to its supervisor: a successor inherits one; a new mount starts it (best effort:
    without one, a crash leaves a dead mount that the next mount of the path cleans up)."""
    options = opts.as_json() | {"via_fusermount": fuse.via_fusermount, "read_only": store.read_only,
                                "mount_path": fuse.mountpoint}
    if handover is not None:
        return SupervisorLink(handover.channel_fd, options)
    entry = fuse.mount_entry()
    if entry is None:
        return NoSupervisor()
    r, w = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    # the supervisor holds the connection and the store's lock for the life of the mount
    dup, lock = os.dup(fuse.fd), os.dup(store.lock_fd)
    try:
        subprocess.Popen(
            [sys.executable, "-m", "mithrilfs.daemon.supervisor", str(fuse.mountpoint), str(entry[0]), entry[1],
             "fusermount3" if fuse.via_fusermount else "umount2", str(dup), str(lock), str(os.getpid())],
            stdin=r.fileno(), stdout=None if opts.foreground else subprocess.DEVNULL,
            stderr=None if opts.foreground else subprocess.DEVNULL, cwd="/",
            pass_fds=(dup, lock), start_new_session=not opts.foreground)
    except OSError as e:
        log.warning("cannot start the supervisor (%s): a crash of the daemon will leave a dead mount", e)
        w.close()
        return NoSupervisor()
    finally:
        r.close()
        os.close(dup)
        os.close(lock)
    return SupervisorLink(w.detach(), options, lookups.fd)


def _take_over(store: Store, mounted: wiring.Mounted, handover: Handover) -> list[Removed]:
    """What a successor inherits from the kernel and from the daemon before it (see the module doc).

    Returns the names it removed, for the kernel once the session can tell it (after the resend).
    """
    ops = mounted.ops
    if not store.read_only:
        for ino_id in store.ns.unlinked_inodes():  # those the kernel no longer holds go now
            ops.lifetimes.delete_if_unused(ino_id)
    adopted = 0
    for ino_id, fd, path in handover.staged:
        ino = store.ns.get(ino_id)
        if ino is None or not ino.is_reg or store.read_only:
            os.close(fd)
            continue
        ops.writes.adopt(ino, ops.tops.of_file(ino_id), fd, path)
        adopted += 1
    torn = set(handover.torn)
    removed: list[Removed] = []
    if torn and not store.read_only:
        # a snapshot the idle timer took of a file that was written further since is no whole file:
        # its names go, as after any crash (the writer learns it from its next write)
        with store.ns.txn():
            for ino_id in torn & store.ns.unconfirmed:
                ino = store.ns.get(ino_id)
                if ino is not None:
                    ops.lifetimes.remove_all_names([ino], removed, keep_content=True)
    ops.writes.torn(torn)
    log.info("took over the live mount after a %s: %d files being written go on, %d lost their uncommitted "
             "writes", handover.restarts.cause, adopted, len(torn))
    return removed


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

    Large sequential reads (big .so files, 256 MiB benchmarks) then cost a
    quarter as many round trips to the daemon.  *dev*: the mount's
    major:minor (from mountinfo: never a stat of our own mount, see ``_probe``).
    """
    path = f"/sys/class/bdi/{dev}/read_ahead_kb"
    try:
        with open(path, "w") as f:
            f.write(str(READAHEAD_KB))
    except OSError as e:
        log.debug("cannot raise readahead (%s): %s", path, e)


def _repair_at_startup(store: Store, *, live: bool = False, keep: Collection[str] = ()) -> bool:
    """Undo what an unclean stop can leave: staging files, unlinked inodes, unreferenced blobs.

    True when the last stop was unclean.  *live*: a takeover, where the
    kernel still holds inodes (``Namespace.recover``) and the staging files
    in *keep* are adopted.
    """
    after_crash = store.ns.get_meta("clean") != "1"
    stale = store.cas.clear_staging(keep)
    repaired = store.ns.recover(live=live)
    freed = store.collect_garbage()
    if not store.ensure_reserve():
        log.warning("could not reserve %d bytes on the store's disk", RESERVE_BYTES)
    if stale or any(repaired.values()) or freed:
        log.info("startup repair: %d staging files, %s, %d unreferenced blobs", stale, repaired, freed)
    return after_crash


async def _run(session: kernel.Session, mounted: wiring.Mounted, mountpoint: Path,
               announce: Callable[[str], None], supervisor: Supervisor, handover: Handover | None,
               restart: trio.Event, dev: str | None, removed: list[Removed]) -> None:
    if handover is not None:
        await session.adopt(handover.session)
        mounted.ops.lifetimes.tell_kernel(removed)  # only now does the kernel take notifications
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_stop_on_signal, session)
        nursery.start_soon(mounted.duties.background)
        nursery.start_soon(_announce_when_live, session, mounted, mountpoint, announce, supervisor, handover, dev)
        await session.serve()
        nursery.cancel_scope.cancel()
    await mounted.duties.unmounting()


async def _stop_on_signal(session: kernel.Session) -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
        async for signum in signals:
            log.info("signal %d: unmounting", signum)
            session.stop()
            return


async def _announce_when_live(session: kernel.Session, mounted: wiring.Mounted, mountpoint: Path,
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


# ----------------------------------------------------------------------
# umount
# ----------------------------------------------------------------------
def daemon_pid(mountpoint: Path) -> int | None:
    try:
        return int((mountpoint / CONTROL_NAME.decode() / "pid").read_text())
    except (OSError, ValueError):
        return None


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


def umount(mountpoint: Path, timeout: float = 60.0, *, lazy: bool = False) -> None:
    if not mountpoint.is_dir() and not is_fuse_mount(mountpoint):
        raise UsageError(f"{mountpoint} is not a directory")
    if not is_fuse_mount(mountpoint):
        raise UsageError(f"{mountpoint} is not mounted")
    pid = daemon_pid(mountpoint)
    try:
        store: Path | None = Path(json.loads((mountpoint / CONTROL_NAME.decode() / "stats.json").read_text())["store"])
    except (OSError, ValueError, KeyError):
        store = None
    res = subprocess.run(["fusermount3", "-u", *(["-z"] if lazy else []), str(mountpoint)],
                         capture_output=True, text=True)
    if res.returncode != 0:
        detail = (res.stderr.strip().splitlines() or ["fusermount3 failed"])[-1]
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
    while pid_alive(pid):
        if time.monotonic() > deadline:
            raise MountError(f"unmounted {mountpoint}, but daemon {pid} did not exit within {timeout:.0f} s")
        time.sleep(0.02)
    # and its supervisor, which holds the store's lock: the store is free when this returns
    if store is not None and not _wait_store_free(store, deadline):
        raise MountError(f"unmounted {mountpoint}, but its store {store} is still locked after {timeout:.0f} s")


def _wait_store_free(store: Path, deadline: float) -> bool:
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
