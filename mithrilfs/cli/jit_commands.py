"""``env`` and ``run``: a program's JIT caches on a mount (the catalog in ``mithrilfs.jitcaches``)."""

from __future__ import annotations

import argparse
import os
import signal
import sys
import tempfile
import time
from pathlib import Path

from mithrilfs.cli.client import control_command, control_file, read_stats
from mithrilfs.cli.relay import Relay
from mithrilfs.cli.store_settings import store_policy
from mithrilfs.daemon.mountpoint import forbidden_message, probe_mount
from mithrilfs.daemon.options import MountOptions
from mithrilfs.daemon.owner import Owner
from mithrilfs.daemon.umount import store_free, umount, wait_store_free
from mithrilfs.errors import MountError, UsageError
from mithrilfs.jitcaches import catalog, leaks
from mithrilfs.store.open import default_store, holder_record
from mithrilfs.units import format_size

#: How long ``run`` waits for a store whose mount was a killed ``run``'s (``_wait_released``).
RELEASE_TIMEOUT = 60.0


def _cmd_env(args: argparse.Namespace) -> int:
    if args.list:
        _print_catalog(args.mountpoint.expanduser().absolute() if args.mountpoint else Path("MOUNT"))
        return 0
    if args.mountpoint is None:
        raise UsageError("env needs a mount point: mithrilfs env MOUNT (or mithrilfs env --list)")
    mp = args.mountpoint.expanduser().absolute()
    control_file(mp, "pid")  # a one-line error unless it is a live mount
    catalog.make_dirs(mp)
    print(catalog.shell_env(mp), end="")
    return 0


def _print_catalog(mp: Path) -> None:
    """``env --list``: each tool, where its cache goes, how, and what it holds."""
    for c in catalog.CATALOG:
        how = (" ".join(c.variables) if c.variables
               else f"link {catalog.HEADERS.defaults[0]} (no variable exists)")
        print(f"{c.tool}\n    {mp / c.subdir}  via {how}\n    holds {c.holds}; default "
              f"{', '.join(c.defaults) or 'none (off)'}\n    source: {c.source}; checked: {c.verified}")


def _cmd_run(args: argparse.Namespace) -> int:
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        raise UsageError("run needs a command: mithrilfs run [--mount DIR] -- CMD ARGS...")
    with Relay() as relay:  # from here to the last clean-up, SIGTERM and SIGHUP end us as SIGINT does
        return _run(args, cmd, relay)


def _run(args: argparse.Namespace, cmd: list[str], relay: Relay) -> int:
    temp = None
    if args.mount is None:
        temp = Path(tempfile.mkdtemp(prefix="mithrilfs-run-"))
    mp = (args.mount or temp).expanduser().absolute()  # type: ignore[union-attr]
    state = probe_mount(mp)
    if state == "forbidden":
        raise MountError(forbidden_message(mp))
    mounted_here = state != "live"
    if mounted_here:
        from mithrilfs.daemon.launch import mount  # the daemon's modules, for a mount of its own alone

        store = (args.store or default_store()).expanduser().absolute()
        # what we set up is taken down by the mount's supervisor should we be killed (``daemon.owner``)
        owner = Owner.this_process(temp_dir=temp is not None, headers=catalog.headers_before(dict(os.environ)))
        try:
            _wait_released(store)
            mount(MountOptions(mountpoint=mp, store=store, policy=store_policy(store, {}), owner=owner))
        except BaseException:
            if temp is not None:
                temp.rmdir()
            raise
    headers = None
    try:
        before = read_stats(mp)
        env = dict(os.environ, **catalog.variables(mp))
        outside = leaks.measure(env)
        headers = catalog.link_headers(mp, env)
        stopped = relay.received()
        if stopped is not None:
            print(f"mithrilfs: {signal.Signals(stopped).name} came before the command started; it was not run",
                  file=sys.stderr)
            return 128 + stopped
        status = _run_command(relay, cmd, env)
        # the kernel does not tell the daemon about closes: commit what the command left written
        control_command(control_file(mp, "commit"), "run")
        after = read_stats(mp)
        d = {k: after[k] - before[k] for k in ("hits", "misses", "writes", "write_bytes", "commits", "dedup_hits")}
        ended = f"killed by signal {-status}" if status < 0 else f"exit status {status}"
        print(f"mithrilfs: {d['hits']} lookups found a file, {d['misses']} did not, {d['commits']} files written "
              f"({format_size(d['write_bytes'])}, {d['dedup_hits']} deduplicated); {ended}",
              file=sys.stderr)
        for leak in leaks.grown(outside, leaks.measure(env), env):
            print(f"mithrilfs: {leaks.describe(leak)}", file=sys.stderr)
    finally:
        catalog.unlink_headers(mp, headers)
        if mounted_here:
            umount(mp)
        if temp is not None:
            temp.rmdir()
    return status if status >= 0 else 128 - status


def _run_command(relay: Relay, cmd: list[str], env: dict[str, str]) -> int:
    """The command's exit status (-N: killed by signal N), 127 or 126 when it cannot start, as a shell says."""
    try:
        return relay.run(cmd, env)
    except FileNotFoundError:
        print(f"mithrilfs: error: command not found: {cmd[0]}", file=sys.stderr)
        return 127
    except OSError as e:  # as a shell says it: not executable, a directory, a bad binary
        print(f"mithrilfs: error: cannot run {cmd[0]}: {e.strerror}", file=sys.stderr)
        return 126


def _wait_released(store: Path) -> None:
    """A store held by the mount of a ``run`` that was killed is let go once that mount's supervisor has
    taken it down: wait for that (at most ``RELEASE_TIMEOUT``) rather than fail with "store is in use"."""
    held = holder_record(store)
    try:
        owner = Owner.from_json(held["owner"]) if held is not None else None
    except (KeyError, TypeError, ValueError, IndexError):
        return
    if owner is None or owner.alive() or store_free(store):
        return
    print(f"mithrilfs: waiting for the mount of an ended run (pid {owner.pid}) to let go of {store}",
          file=sys.stderr, flush=True)
    wait_store_free(store, time.monotonic() + RELEASE_TIMEOUT)


COMMANDS = {"env": _cmd_env, "run": _cmd_run}
