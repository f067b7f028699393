"""Mount lifecycle: open the store, mount, daemonize once the mount answers, stop cleanly.

``mount`` forks before any trio or FUSE state exists.  The child mounts,
proves the mount answers by ``stat``-ing it from a worker thread (which goes
through the kernel to our own handlers), and only then writes ``ok`` down a
pipe; the parent exits 0 on ``ok`` and prints the child's one-line error
otherwise.  SIGTERM/SIGINT end the FUSE loop; the mount is then detached and
the store marked clean.
"""

from __future__ import annotations

import errno
import json
import logging
import logging.handlers
import os
import signal
import sqlite3
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import trio

from mithrilfs import kernel
from mithrilfs.cache.eviction import EvictionPolicy
from mithrilfs.control.files import CONTROL_NAME
from mithrilfs.daemon import wiring
from mithrilfs.daemon.wiring import TierOptions
from mithrilfs.errors import UsageError
from mithrilfs.kernel.mount import unescape_mount_field
from mithrilfs.observe.metrics import MetricsServer
from mithrilfs.shared.redis_wire import RemoteTier
from mithrilfs.store.open import HOLDER_FILE, RESERVE_BYTES, Store, StoreError, open_store, validate_store

log = logging.getLogger(__name__)

READY_TIMEOUT = 60.0
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
    remote_namespace: str = "default"
    remote_key: bytes | None = None
    #: Kept out of the URL (and so out of the process list and the logs).
    remote_password: str | None = None
    remote_cluster: bool = False
    #: Owner of entries materialized from the shared tier (default: the mount root's).
    remote_owner: tuple[int, int] | None = None
    #: The startup set this mount records its workload's first reads into.
    startup_set: str = "default"
    #: A startup set to prefetch once the mount serves.
    prefetch: str | None = None
    #: Mount over a directory that holds files (hiding them).
    nonempty: bool = False
    #: Settings (``settings.SETTINGS`` names) given on the command line: they beat the store's.
    fixed_settings: frozenset[str] = frozenset()


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
    outcome: list[str] = []

    def ask() -> None:
        try:
            os.statvfs(mountpoint)  # answered, zeroed, even to a user the mount refuses...
            os.stat(mountpoint)  # ...which this tells: EACCES
            outcome.append("live")
        except OSError as e:
            # ENOTCONN, or ECONNABORTED for a request that was queued as the daemon died
            outcome.append("dead" if e.errno in (errno.ENOTCONN, errno.ECONNABORTED)
                           else "forbidden" if e.errno in (errno.EACCES, errno.EPERM) else "live")

    t = threading.Thread(target=ask, daemon=True)
    t.start()
    t.join(timeout)
    return outcome[0] if outcome else "hung"


def clean_stale_mount(mountpoint: Path) -> bool:
    """Detach a mount whose daemon died (ENOTCONN); True when one was cleaned."""
    if probe_mount(mountpoint, timeout=5.0) != "dead":
        return False
    subprocess.run(["fusermount3", "-u", "-z", str(mountpoint)], capture_output=True)
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
    if opts.foreground:
        _setup_logging(None, opts.debug)

        def announce(msg: str) -> None:
            if msg.startswith("ok"):
                print(f"mithrilfs: mounted {opts.mountpoint} (store {opts.store})", file=sys.stderr, flush=True)
                if msg == READY_READ_ONLY:
                    print(read_only_notice(opts.store), file=sys.stderr, flush=True)
            else:
                print(f"mithrilfs: {msg}", file=sys.stderr, flush=True)

        return serve(opts, announce)

    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the daemon
        os.close(r)
        os.setsid()
        _detach_stdio()
        code = 1
        try:

            def announce(msg: str) -> None:
                try:
                    os.write(w, (msg + "\n").encode())
                except OSError:
                    pass

            code = serve(opts, announce, log_in_store=True)
        finally:
            os._exit(code)
    os.close(w)
    msg = _read_line(r, READY_TIMEOUT)
    os.close(r)
    if msg is not None and msg.startswith("ok"):
        if msg == READY_READ_ONLY:
            print(read_only_notice(opts.store), file=sys.stderr)
        return 0
    if msg is None:
        os.kill(pid, signal.SIGTERM)
        raise MountError(f"the mount did not answer within {READY_TIMEOUT:.0f} s")
    os.waitpid(pid, 0)
    raise MountError(msg or "the daemon exited before the mount was ready")


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


def _setup_logging(path: Path | None, debug: bool) -> None:
    handler: logging.Handler
    if path is None:
        handler = logging.StreamHandler(sys.stderr)
    else:
        handler = logging.handlers.RotatingFileHandler(path, maxBytes=10 << 20, backupCount=2)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s"))
    root = logging.getLogger()
    root.handlers[:] = [handler]
    root.setLevel(logging.DEBUG if debug else logging.INFO)


def serve(opts: MountOptions, announce: Callable[[str], None], *, log_in_store: bool = False) -> int:
    """Open the store, mount, serve until unmounted or signalled; returns the exit status.

    An unexpected failure is logged with its traceback (where a log exists)
    and announced in one line: before the mount is ready, that line is what
    the ``mount`` command prints instead of a bare "the daemon exited".
    """
    try:
        return _serve(opts, announce, log_in_store=log_in_store)
    except Exception as e:
        log.exception("the daemon failed")
        where = f"; see {opts.store / LOG_FILE}" if log_in_store and logging.getLogger().handlers else ""
        announce(f"the daemon failed: {type(e).__name__}: {e}{where}")
        return 1


def _serve(opts: MountOptions, announce: Callable[[str], None], *, log_in_store: bool = False) -> int:
    os.umask(0o077)  # the store's files (index, log, blobs) are the daemon's alone
    try:
        store = open_store(opts.store)
    except StoreError as e:
        announce(str(e))
        return 1
    if log_in_store and not store.read_only:
        _setup_logging(store.root / LOG_FILE, opts.debug)
    try:
        after_crash = not store.read_only and _repair_at_startup(store)
        tier_options = TierOptions(owner=opts.remote_owner, startup_set=opts.startup_set, prefetch=opts.prefetch)
        if opts.remote is not None:
            tier_options.remote = RemoteTier(opts.remote, opts.remote_namespace, opts.remote_key,
                                             password=opts.remote_password, cluster=opts.remote_cluster)
        try:
            fuse = kernel.mount(str(opts.mountpoint), allow_other=opts.allow_other, read_only=store.read_only)
        except kernel.MountError as e:
            announce(f"cannot mount {opts.mountpoint}: {e}")
            return 1
        # the kernel's INIT waits in the fd until the session reads (and the mount point with it): the
        # filesystem is built on the fd (its notifications need it); the mount goes if anything below fails
        notifier = kernel.Notifier(fuse.fd)
        failure = None
        try:
            mounted = wiring.build(store, opts.policy, notifier, tier_options, after_crash=after_crash,
                                   fixed_settings=opts.fixed_settings)
            metrics = None
            if opts.metrics_port is not None:
                try:
                    metrics = MetricsServer(opts.metrics_port, lambda: mounted.duties.cached_snapshot)
                except OSError as e:
                    failure = f"cannot serve metrics on 127.0.0.1:{opts.metrics_port}: {e.strerror}"
        except BaseException:
            notifier.close()
            fuse.unmount()
            raise
        if failure is not None:
            notifier.close()
            fuse.unmount()
            announce(failure)
            return 1
        session = kernel.Session(fuse.fd, mounted.ops, interruptible=mounted.tier.slow, debug=opts.debug,
                                 notifier=notifier)
        if not store.read_only:  # named in the error a second mount of this store gets
            (store.root / HOLDER_FILE).write_text(json.dumps({"pid": os.getpid(), "mountpoint": str(opts.mountpoint)}))
        log.info("serving %s (store %s%s, pid %d, budget %d bytes)", opts.mountpoint, opts.store,
                 ", read-only" if store.read_only else "", os.getpid(), opts.policy.max_bytes)
        mounted.duties.snapshot()
        if metrics is not None:
            metrics.start()
        try:
            trio.run(_run, session, mounted, opts.mountpoint, announce)
        except kernel.ProtocolError as e:
            announce(str(e))
            return 1
        finally:
            if metrics is not None:
                metrics.stop()
            session.close()
            fuse.unmount()
            (store.root / HOLDER_FILE).unlink(missing_ok=True)
            mounted.duties.shutdown()
            mounted.events.emit("unmount", mountpoint=str(opts.mountpoint), **{
                k: mounted.duties.cached_snapshot.get(k, 0) for k in ("hits", "misses", "commits", "evictions")})
            log.info("unmounted %s", opts.mountpoint)
        return 0
    finally:
        store.close()


def _open_and_close(path: Path) -> None:
    try:
        os.close(os.open(path, os.O_RDONLY))
    except OSError as e:
        log.debug("cannot open %s: %s", path, e)


READAHEAD_KB = 1024


def _raise_readahead(mountpoint: Path) -> None:
    """Let the kernel read ahead 1 MiB per FUSE request instead of 128 KiB (root only; best effort).

    Large sequential reads (big .so files, 256 MiB benchmarks) then cost a
    quarter as many round trips to the daemon.
    """
    dev = os.stat(mountpoint).st_dev
    path = f"/sys/class/bdi/{os.major(dev)}:{os.minor(dev)}/read_ahead_kb"
    try:
        with open(path, "w") as f:
            f.write(str(READAHEAD_KB))
    except OSError as e:
        log.debug("cannot raise readahead (%s): %s", path, e)


def _repair_at_startup(store: Store) -> bool:
    """Undo what an unclean stop can leave: staging files, unlinked inodes, unreferenced blobs.

    True when the last stop was unclean.
    """
    after_crash = store.ns.get_meta("clean") != "1"
    stale = store.cas.clear_staging()
    repaired = store.ns.recover()
    freed = store.collect_garbage()
    if not store.ensure_reserve():
        log.warning("could not reserve %d bytes on the store's disk", RESERVE_BYTES)
    if stale or any(repaired.values()) or freed:
        log.info("startup repair: %d staging files, %s, %d unreferenced blobs", stale, repaired, freed)
    return after_crash


async def _run(session: kernel.Session, mounted: wiring.Mounted, mountpoint: Path,
               announce: Callable[[str], None]) -> None:
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_stop_on_signal, session)
        nursery.start_soon(mounted.duties.background)
        nursery.start_soon(_announce_when_live, session, mounted, mountpoint, announce)
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
                              announce: Callable[[str], None]) -> None:
    # stat goes through the kernel to our own getattr/lookup: proof that we answer.
    # These threads wait on our own mount: if a signal ends the FUSE loop
    # first, they must be abandoned (the unmount then fails their call)
    # rather than waited for, or the daemon would wait on itself forever.
    try:
        await trio.to_thread.run_sync(os.stat, mountpoint / CONTROL_NAME.decode(), abandon_on_cancel=True)
    except OSError as e:
        announce(f"the new mount at {mountpoint} does not answer: {e.strerror}")
        session.stop()
        return
    # the first OPEN and FLUSH are answered ENOSYS, after which the kernel opens and closes
    # every file itself; make them happen now, so even a workload that only creates files
    # is spared RELEASE and FLUSH from its first file on
    await trio.to_thread.run_sync(_open_and_close, mountpoint / CONTROL_NAME.decode() / "pid",
                                  abandon_on_cancel=True)
    await trio.to_thread.run_sync(_raise_readahead, mountpoint, abandon_on_cancel=True)
    ops = mounted.ops
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


def pid_alive(pid: int) -> bool:
    """True while *pid* runs (a zombie has exited)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


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
