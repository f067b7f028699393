"""The daemon: open the store, mount (or take over a live mount), serve until unmounted, signalled or restarted.

A new mount's daemon (forked by ``daemon.launch.mount``) runs ``serve``.
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

What the daemon puts right before serving is ``daemon.repair``'s; the proof
that the mount answers, ``daemon.announce``'s.
"""

from __future__ import annotations

import json
import logging
import logging.handlers
import os
import signal
import socket
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import trio

from mithrilfs import kernel
from mithrilfs.cache.create_journal import CreateJournal
from mithrilfs.cache.lifetime import Removed
from mithrilfs.cache.lookups import LookupCounts
from mithrilfs.crash_points import crash_point
from mithrilfs.daemon import upgrade, wiring
from mithrilfs.daemon.announce import announce_when_live
from mithrilfs.daemon.channel import Handover, NoSupervisor, Restarts, Supervisor, SupervisorLink
from mithrilfs.daemon.options import MountOptions
from mithrilfs.daemon.process import raise_fd_limit
from mithrilfs.daemon.repair import repair_at_startup, take_over
from mithrilfs.daemon.wiring import TierOptions
from mithrilfs.fs.passthrough import held_table
from mithrilfs.jitcaches import catalog
from mithrilfs.observe.metrics import MetricsServer
from mithrilfs.shared.stores.connect import open_remote
from mithrilfs.store.blank_files import BlankFiles
from mithrilfs.store.open import HOLDER_FILE, Store, StoreError, open_store

log = logging.getLogger(__name__)

LOG_FILE = "mithrilfs.log"


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
        # creates not committed yet: shared with the supervisor, for a successor (``cache.create_journal``); a
        # supervisor of older code passes none on, and would pass on none of ours: nothing is deferred then
        if handover is None:
            journal = CreateJournal()
        elif handover.creates_fd >= 0:
            journal = CreateJournal(handover.creates_fd)
        else:
            journal = CreateJournal(defers=False)
        if handover is not None:
            crash_point("takeover")
            after_crash = handover.restarts.cause == "crash"
            if not store.read_only:
                # the creates the previous daemon answered and never committed: the kernel holds them
                if put_back := journal.put_back(store.ns, commit=True):
                    log.info("put back %d files created just before the previous daemon died", put_back)
                repair_at_startup(store, live=True, keep={path for _, _, path in handover.staged if path})
        else:
            after_crash = not store.read_only and repair_at_startup(store)
        if not store.read_only:
            store.cas.blanks = BlankFiles(store.cas.staging, burst=store.cas.make_shards)
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
        supervisor = _supervisor(fuse, opts, store, handover, lookups, journal)
        # the kernel's INIT waits in the fd until the session reads (and the mount point with it): the
        # filesystem is built on the fd (its notifications need it); the mount goes if anything below fails
        notifier = kernel.Notifier(fuse.fd)
        failure = None
        try:
            mounted = wiring.build(store, opts.policy, notifier, tier_options, after_crash=after_crash,
                                   fixed_settings=opts.fixed_settings, supervisor=supervisor,
                                   restarts=handover.restarts if handover is not None else Restarts(),
                                   lookups=lookups, journal=journal, passthrough=opts.passthrough,
                                   backing=kernel.BackingFiles(fuse.fd),
                                   held=held_table(store.root, fresh=handover is None, read_only=store.read_only)
                                   if opts.passthrough != "off" else None)
            removed = take_over(store, mounted, handover) if handover is not None else []
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
                                 after_reply=mounted.after_reply, polls=lambda: not mounted.tier.streaming,
                                 uring=os.environ.get(kernel.URING_VARIABLE) == "1",
                                 passthrough=mounted.passthrough.asks)
        # what INIT agreed (a successor: what its predecessor's INIT agreed, ``Session.adopt``)
        mounted.passthrough.agreed = lambda: bool(session.capabilities & kernel.PASSTHROUGH)
        mounted.control.add(b"passthrough", lambda: (mounted.passthrough.describe() + "\n").encode())
        if not store.read_only:  # named in the error a second mount of this store gets
            (store.root / HOLDER_FILE).write_text(json.dumps({
                "pid": os.getpid(), "mountpoint": str(opts.mountpoint),
                "owner": opts.owner.as_json() if opts.owner is not None else None}))
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
                lookups: LookupCounts, journal: CreateJournal) -> Supervisor:
    """The daemon's line to its supervisor: a successor inherits one; a new mount starts it (best effort:
    without one, a crash leaves a dead mount that the next mount of the path cleans up)."""
    options = opts.as_json() | {"via_fusermount": fuse.via_fusermount, "read_only": store.read_only,
                                "mount_path": fuse.mountpoint}
    if handover is not None:
        return SupervisorLink(handover.channel_fd, options, mirror_slots=handover.mirror_slots)
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
    return SupervisorLink(w.detach(), options, lookups.fd, journal.fd)


async def _run(session: kernel.Session, mounted: wiring.Mounted, mountpoint: Path,
               announce: Callable[[str], None], supervisor: Supervisor, handover: Handover | None,
               restart: trio.Event, dev: str | None, removed: list[Removed]) -> None:
    if handover is not None:
        await session.adopt(handover.session)
        mounted.ops.lifetimes.tell_kernel(removed)  # only now does the kernel take notifications
    async with trio.open_nursery() as nursery:
        nursery.start_soon(_stop_on_signal, session)
        nursery.start_soon(mounted.duties.background)
        nursery.start_soon(announce_when_live, session, mounted, mountpoint, announce, supervisor, handover, dev)
        await session.serve()
        nursery.cancel_scope.cancel()
    await mounted.duties.unmounting()


async def _stop_on_signal(session: kernel.Session) -> None:
    with trio.open_signal_receiver(signal.SIGTERM, signal.SIGINT, signal.SIGHUP) as signals:
        async for signum in signals:
            log.info("signal %d: unmounting", signum)
            session.stop()
            return
