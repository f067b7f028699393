"""``mount``, ``umount``, ``restart`` and ``status``: a mount's life, from the command line.

``mount`` checks its options (the shared tier's ``--remote`` ones among
them: a bucket that cannot work is refused before anything mounts) and
hands them to ``daemon.launch``; the others act on a mount by its control
files and its mount point.  User mistakes end with one line on stderr and
exit status 2 (bad usage) or 1 (the operation failed); never a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mithrilfs.cli.client import (
    control_command,
    control_file,
    read_stats,
    usage_error,
)
from mithrilfs.cli.parser import given_settings
from mithrilfs.cli.store_settings import store_policy
from mithrilfs.cli.tier_commands import follow_prefetch
from mithrilfs.daemon import ended
from mithrilfs.daemon.mountpoint import clean_stale_mount, daemon_pid, forbidden_message, is_fuse_mount, probe_mount
from mithrilfs.daemon.options import MountOptions
from mithrilfs.daemon.process import call_within, in_child
from mithrilfs.daemon.umount import pending_uploads, umount
from mithrilfs.errors import MountError, UsageError
from mithrilfs.jitcaches import catalog, leaks
from mithrilfs.shared.stores.redis.url import url_password, without_password
from mithrilfs.store.open import default_store
from mithrilfs.units import format_size

if TYPE_CHECKING:  # imported where used: a CLI command without a remote starts without them
    from mithrilfs.shared.stores.s3.settings import S3Settings


def remote_key(args: argparse.Namespace) -> bytes | None:
    """The signing key of ``--remote-key-file`` (``mount``, ``fleet gc``): a one-line error when it cannot be read
    or is too short to sign with."""
    if args.remote_key_file is None:
        return None
    try:
        key: bytes = args.remote_key_file.read_bytes().strip()
    except OSError as e:
        usage_error(f"cannot read key file {args.remote_key_file}: {e.strerror}")
    if len(key) < 16:
        usage_error(f"key file {args.remote_key_file} holds fewer than 16 bytes")
    return key


def check_namespace(args: argparse.Namespace) -> None:
    """``--remote-namespace`` is a key prefix and a bucket's path component: letters, digits, - _ . only, and
    neither ``.`` nor ``..``."""
    ns = args.remote_namespace
    if not ns or ns in (".", "..") or not all(c.isalnum() or c in "-_." for c in ns):
        usage_error(f"invalid namespace {ns!r} (letters, digits, - _ .)")


def _cmd_mount(args: argparse.Namespace) -> int:
    behind, s3 = _remote_stores(args)
    store = (args.store or default_store()).expanduser().absolute()
    given = given_settings(args)
    policy = store_policy(store, given)
    if args.remote_key_file is not None and args.remote is None:
        usage_error("--remote-key-file needs --remote")
    key = remote_key(args)
    check_namespace(args)
    password = _remote_password(args)
    opts = MountOptions(
        policy=policy,
        metrics_port=args.metrics_port,
        remote=without_password(args.remote) if args.remote else None,
        remote_behind=behind,
        remote_s3=s3.as_json() if s3 is not None else None,
        remote_namespace=args.remote_namespace,
        remote_key=key,
        remote_password=password,
        remote_cluster=args.remote_cluster,
        remote_owner=args.remote_owner,
        startup_set=args.startup_set,
        # by default the recorded set streams in the background; --prefetch waits for it
        prefetch=None if args.no_prefetch or args.remote is None and args.prefetch is None else (
            args.prefetch or args.startup_set),
        prefetch_background=args.prefetch is None,
        mountpoint=args.mountpoint.expanduser().absolute(),
        store=store,
        foreground=args.foreground,
        allow_other=args.allow_other,
        debug=args.debug,
        passthrough=args.passthrough,
        nonempty=args.nonempty,
        fixed_settings=frozenset(given),
        on_crash=args.on_crash,
    )
    if args.prefetch is not None and args.remote is None:
        usage_error("--prefetch needs --remote")
    if args.prefetch is not None and args.no_prefetch:
        usage_error("--prefetch and --no-prefetch contradict each other")
    if s3 is not None:
        _refuse_misconfigured_bucket(opts)
    outside = leaks.measure(dict(os.environ))
    # the daemon's modules (trio, the write path, the tier) load for mount alone: every other command
    # starts without them
    from mithrilfs.daemon.launch import mount

    status = mount(opts)
    if status == 0 and not opts.foreground:
        leaks.save_at_mount(store, outside)  # status reports what the mount's users write outside it
    if status == 0 and opts.remote is not None and not opts.foreground:
        _warn_if_unreachable(opts)
    if status == 0 and args.prefetch is not None and not opts.foreground:
        follow_prefetch(opts.mountpoint, f"set={opts.prefetch}", warn_only=True)
    return status


def _remote_stores(args: argparse.Namespace) -> tuple[str | None, S3Settings | None]:
    """Check ``--remote`` (once, or Redis then a bucket); leave the first in ``args.remote``.

    Returns the bucket behind Redis (or None) and, when a bucket is named,
    its endpoint and credentials by the AWS conventions.
    """
    from mithrilfs.shared.stores.connect import check_remotes, is_s3
    from mithrilfs.shared.stores.s3.layout import nested_in
    from mithrilfs.shared.stores.s3.settings import S3Location, from_environment

    urls = args.remote or []
    try:
        check_remotes(urls)
    except ValueError as e:
        usage_error(str(e))
    args.remote = urls[0] if urls else None
    behind = urls[1] if len(urls) > 1 else None
    if not any(is_s3(u) for u in urls):
        if args.remote_endpoint is not None:
            usage_error("--remote-endpoint needs an s3:// --remote")
        return behind, None
    if is_s3(urls[0]):
        for opt in ("remote_password_file", "remote_cluster"):
            if getattr(args, opt):
                usage_error(f"--{opt.replace('_', '-')} needs a Redis --remote")
    nested = nested_in(S3Location.parse(next(u for u in urls if is_s3(u))), args.remote_namespace)
    if nested:  # that fleet's gc and pruning delete what they find there
        usage_error(nested)
    try:
        return behind, from_environment(args.remote_endpoint)
    except ValueError as e:
        usage_error(str(e))


def _refuse_misconfigured_bucket(opts: MountOptions) -> None:
    """A missing bucket or refused credentials will not mend themselves: an error before anything mounts.

    An endpoint that does not answer may (the mount then works alone and
    sends its queue later): ``_warn_if_unreachable`` says so after mounting.
    """
    def probe() -> str:
        from mithrilfs.shared.stores.connect import RemoteError, open_bucket

        bucket = open_bucket(opts.remote_spec())
        try:
            bucket.ping()
        except RemoteError as e:
            if str(e).startswith(("bucket ", "access to bucket")):
                return f"{bucket.url}: {e}"
        return ""

    problem = in_child(probe)
    if problem:
        usage_error(problem)


def _warn_if_unreachable(opts: MountOptions) -> None:
    """The mount works as a local cache without its shared store, but the user should know it is alone."""
    def probe() -> str:
        from mithrilfs.shared.stores.connect import RemoteError, open_remote

        store = open_remote(opts.remote_spec())
        try:
            store.ping()
        except RemoteError as e:
            return (f"the shared tier {store.url} cannot be reached ({e}); mounted as a local cache,"
                    " changes are queued and sent when it answers")
        finally:
            store.close()
        return ""

    problem = in_child(probe)
    if problem:
        print(f"mithrilfs: warning: {problem}", file=sys.stderr)


def _remote_password(args: argparse.Namespace) -> str | None:
    """The Redis password: from --remote-password-file, $MITHRILFS_REMOTE_PASSWORD, or the URL.

    One given in the URL would sit in the daemon's command line, which every
    user can read (``ps``): the command runs itself again with the URL
    redacted and the password in its environment, which only its owner can
    read.
    """
    if args.remote is None:
        for opt in ("remote_password_file", "remote_cluster", "remote_owner"):
            if getattr(args, opt):
                usage_error(f"--{opt.replace('_', '-')} needs --remote")
        return None
    if args.remote_password_file is not None:
        try:
            password = args.remote_password_file.read_text().strip()
        except (OSError, UnicodeDecodeError) as e:
            usage_error(f"cannot read password file {args.remote_password_file}: {getattr(e, 'strerror', e)}")
        if not password:
            usage_error(f"password file {args.remote_password_file} is empty")
        return password
    in_url = url_password(args.remote)
    if in_url and any(args.remote in a for a in sys.argv) and not os.environ.get(_PASSWORD_ENV):
        argv = [a.replace(args.remote, without_password(args.remote)) for a in sys.argv[1:]]
        os.execve(sys.executable, [sys.executable, "-m", "mithrilfs", *argv],
                  dict(os.environ, **{_PASSWORD_ENV: in_url}))
    password = os.environ.pop(_PASSWORD_ENV, None) or in_url
    return password or None


_PASSWORD_ENV = "MITHRILFS_REMOTE_PASSWORD"


def _cmd_umount(args: argparse.Namespace) -> int:
    mp = args.mountpoint.expanduser().absolute()
    if clean_stale_mount(mp):  # nothing to flush: its daemon and supervisor are gone (ENOTCONN)
        print(f"mithrilfs: {mp} was a dead mount (its daemon is gone): detached it", file=sys.stderr)
        return 0
    try:
        before = read_stats(mp)
    except (OSError, ValueError, UsageError):
        before = None
    umount(mp, lazy=args.lazy)
    catalog.drop_headers_link(mp, dict(os.environ))
    if before is not None and "upload_queue" in before:
        pending = pending_uploads(Path(before["store"]))
        if pending:
            why = before.get("remote_last_error") or "still queued"
            print(f"mithrilfs: {pending} changes not yet in the shared tier ({why}); kept in the store"
                  " and sent at its next mount with --remote", file=sys.stderr)
    return 0


def _cmd_restart(args: argparse.Namespace) -> int:
    mp = args.mountpoint.expanduser().absolute()
    before = read_stats(mp)
    if not (mp / ".mithrilfs" / "restart").exists():
        raise MountError(f"{mp}: this mount has no supervisor to hand it over to (its daemon could not start"
                         " one, or is older than restarts): unmount and mount it again instead")
    if before.get("supervisor") == "gone":
        raise MountError(f"{mp}: restart refused: its supervisor is gone (killed?), so no new daemon would"
                         " take over; the daemon serves on: unmount and mount again to restart it")
    path = control_file(mp, "restart")
    deadline = time.monotonic() + args.timeout
    control_command(path, "restart", answered=False)
    # the daemon checks that the installed code starts before it hands over; its refusal is the answer the
    # file reads back (a daemon that handed over answers nothing: the read then waits for the new one)
    answer = call_within(path.read_bytes, deadline - time.monotonic())
    try:
        refused = json.loads(answer) if answer else {}
    except ValueError:
        refused = {}
    if isinstance(refused, dict) and refused.get("restarting") is False:
        raise MountError(f"{mp}: restart refused: {refused.get('error')}")
    while True:
        # reads wait in the kernel while the daemons change places: the answer comes from the new one,
        # in a thread of its own, so a successor that never serves cannot hold this past the timeout
        pid = call_within(lambda: daemon_pid(mp), deadline - time.monotonic())
        if pid is not None and pid != before["pid"]:
            break
        if time.monotonic() > deadline or (pid is None and not is_fuse_mount(mp)):
            raise MountError(f"{mp}: no new daemon took over within {args.timeout:g} s"
                             + (" (the handover was asked for and may still complete: see 'mithrilfs "
                                "status')" if is_fuse_mount(mp) else " (the mount is gone)"))
        time.sleep(0.05)
    after = read_stats(mp)
    print(f"{mp}: restarted: daemon {before['pid']} (mithrilfs {before.get('version', '?')}) handed over to "
          f"{after['pid']} (mithrilfs {after.get('version', '?')})")
    return 0


def _restarts_line(snap: dict[str, Any]) -> str:
    if not snap.get("restarts"):
        return ""
    at = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(snap["last_restart_at"]))
    return f", restarted {snap['restarts']} times (last: {snap['last_restart_cause']}, {at})"


def _passthrough_line(mp: Path) -> str:
    """What the daemon says of FUSE passthrough (empty from a daemon that does not say)."""
    try:
        return control_file(mp, "passthrough").read_text().strip()
    except OSError:
        return ""


def _cmd_status(args: argparse.Namespace) -> int:
    mp = args.mountpoint.expanduser().absolute()
    state = probe_mount(mp, timeout=1.0)
    snap: dict[str, Any] = {}
    if state == "live":
        try:
            snap = read_stats(mp)
        except (OSError, ValueError, UsageError, MountError):
            state = "foreign"
    prefetch = snap.get("prefetch") or {}
    if state == "live" and args.ready and prefetch.get("state") == "running" and not prefetch.get("background"):
        state = "prefetching"
    status = 0 if state == "live" else 1
    if args.json:
        keys = ("pid", "store", "files", "physical_bytes", "max_bytes", "hit_rate", "read_only", "upload_queue",
                "remote_last_error", "remote_levels", "version", "restarts", "last_restart_cause", "last_restart_at",
                "supervisor")
        gone = ended.read(os.path.realpath(mp)) if state == "unmounted" else None
        outside = leaks.since_mount(Path(snap["store"]), dict(os.environ)) if "store" in snap else []
        print(json.dumps({"mountpoint": str(mp), "state": state, "ready": status == 0,
                          **{k: snap[k] for k in keys if k in snap}, "prefetch": prefetch or None,
                          "passthrough": _passthrough_line(mp) if state == "live" else None,
                          "ended": gone, "outside_since_mount": [leaks.as_json(x) for x in outside]},
                         sort_keys=True))
        return status
    if state == "live":
        print(f"{mp}: live{' (read-only store: serves cached files, writes fail)' if snap.get('read_only') else ''}, "
              f"pid {snap['pid']}, {snap['files']} files, {format_size(snap['physical_bytes'])} of "
              f"{format_size(snap['max_bytes'])}, hit rate {snap['hit_rate']:.0%} of lookups{_restarts_line(snap)}")
        from mithrilfs.observe.stats import format_levels

        passthrough = _passthrough_line(mp)
        print(f"  requests served over {snap.get('transport', '/dev/fuse read/write')}"
              f"{'; ' + passthrough if passthrough else ''}")
        for line in format_levels(snap):
            print(line)
        for leak in leaks.since_mount(Path(snap["store"]), dict(os.environ)):
            print(f"  since the mount: {leaks.describe(leak)}")
        if snap.get("supervisor") == "gone":
            print(f"{mp}: warning: its supervisor is gone: a crash of the daemon now leaves a dead mount and "
                  "restart is refused; unmount and mount again to get a new one")
    elif state == "prefetching":
        print(f"{mp}: live, prefetching ({prefetch.get('files', 0)} of {prefetch.get('total_files', '?')} files)")
    elif state == "forbidden":
        print(forbidden_message(mp))
    elif state == "unmounted" and (gone := ended.read(os.path.realpath(mp))) is not None:
        at = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(gone["at"]))
        print(f"{mp}: not mounted: detached at {at}: {gone['reason']}")
    else:
        print(f"{mp}: " + {"unmounted": "not mounted", "dead": "daemon is gone (stale mount)",
                           "hung": "mounted but not answering within 1 s",
                           "foreign": "mounted, but not a mithrilfs mount"}[state])
    return status


#: Each command's function, by the name the parser gives it.
COMMANDS = {"mount": _cmd_mount, "umount": _cmd_umount, "unmount": _cmd_umount, "status": _cmd_status,
            "restart": _cmd_restart, "reload": _cmd_restart}
