"""The commands themselves: what each does, in the words users read.

User mistakes end with one line on stderr and exit status 2 (bad usage) or
1 (the operation failed); never a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from mithrilfs.cache.eviction import EvictionPolicy
from mithrilfs.cli.client import (
    DaemonChanged,
    control_command,
    control_file,
    progress_bar,
    read_json,
    read_stats,
    tier_command,
    usage_error,
    while_drawing,
)
from mithrilfs.cli.parser import given_settings
from mithrilfs.daemon import ended
from mithrilfs.daemon import lifecycle as daemon
from mithrilfs.daemon.process import call_within, in_child
from mithrilfs.errors import UsageError
from mithrilfs.jitcaches import catalog, leaks
from mithrilfs.shared.redis_wire import url_password, without_password
from mithrilfs.store.open import StoreError, default_store
from mithrilfs.terminal import shown
from mithrilfs.units import format_size

if TYPE_CHECKING:  # imported where used: a CLI command without a remote starts without them
    from mithrilfs.shared.s3_settings import S3Settings


def _stored_settings(store: Path) -> dict[str, Any]:
    """The settings *store* keeps ({} for a store not made yet); a one-line error when it cannot tell."""
    from mithrilfs import settings
    from mithrilfs.store.open import validate_store

    try:
        validate_store(store)
        return settings.load(store) if store.exists() else {}
    except StoreError as e:
        raise UsageError(str(e)) from None


def _policy(store: Path, settings_: dict[str, Any], given: dict[str, Any]) -> EvictionPolicy:
    """*settings_* with *given* (the command line's) on top; a one-line error when they conflict."""
    from mithrilfs import settings

    try:
        return settings.policy(settings_, given)
    except ValueError as e:
        raise UsageError(f"{e} (settings of {store} with this command line's)") from None


def store_policy(store: Path, given: dict[str, Any]) -> EvictionPolicy:
    """The store's settings with *given* (the command line's) on top."""
    return _policy(store, _stored_settings(store), given)


def _cmd_mount(args: argparse.Namespace) -> int:
    behind, s3 = _remote_stores(args)
    store = (args.store or default_store()).expanduser().absolute()
    given = given_settings(args)
    policy = store_policy(store, given)
    key = None
    if args.remote_key_file is not None:
        if args.remote is None:
            usage_error("--remote-key-file needs --remote")
        try:
            key = args.remote_key_file.read_bytes().strip()
        except OSError as e:
            usage_error(f"cannot read key file {args.remote_key_file}: {e.strerror}")
        if len(key) < 16:
            usage_error(f"key file {args.remote_key_file} holds fewer than 16 bytes")
    if not args.remote_namespace or not all(c.isalnum() or c in "-_." for c in args.remote_namespace):
        usage_error(f"invalid namespace {args.remote_namespace!r} (letters, digits, - _ .)")
    password = _remote_password(args)
    opts = daemon.MountOptions(
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
    status = daemon.mount(opts)
    if status == 0 and not opts.foreground:
        leaks.save_at_mount(store, outside)  # status reports what the mount's users write outside it
    if status == 0 and opts.remote is not None and not opts.foreground:
        _warn_if_unreachable(opts)
    if status == 0 and args.prefetch is not None and not opts.foreground:
        _follow_prefetch(opts.mountpoint, f"set={opts.prefetch}", warn_only=True)
    return status


def _remote_stores(args: argparse.Namespace) -> tuple[str | None, S3Settings | None]:
    """Check ``--remote`` (once, or Redis then a bucket); leave the first in ``args.remote``.

    Returns the bucket behind Redis (or None) and, when a bucket is named,
    its endpoint and credentials by the AWS conventions.
    """
    from mithrilfs.shared.connect import check_remotes, is_s3
    from mithrilfs.shared.s3_settings import from_environment

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
    try:
        return behind, from_environment(args.remote_endpoint)
    except ValueError as e:
        usage_error(str(e))


def _refuse_misconfigured_bucket(opts: daemon.MountOptions) -> None:
    """A missing bucket or refused credentials will not mend themselves: an error before anything mounts.

    An endpoint that does not answer may (the mount then works alone and
    sends its queue later): ``_warn_if_unreachable`` says so after mounting.
    """
    def probe() -> str:
        from mithrilfs.shared.connect import RemoteError, open_bucket

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


def _warn_if_unreachable(opts: daemon.MountOptions) -> None:
    """The mount works as a local cache without its shared store, but the user should know it is alone."""
    def probe() -> str:
        from mithrilfs.shared.connect import RemoteError, open_remote

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
    if daemon.clean_stale_mount(mp):  # nothing to flush: its daemon and supervisor are gone (ENOTCONN)
        print(f"mithrilfs: {mp} was a dead mount (its daemon is gone): detached it", file=sys.stderr)
        return 0
    try:
        before = read_stats(mp)
    except (OSError, ValueError, UsageError):
        before = None
    daemon.umount(mp, lazy=args.lazy)
    catalog.drop_headers_link(mp, dict(os.environ))
    if before is not None and "upload_queue" in before:
        pending = daemon.pending_uploads(Path(before["store"]))
        if pending:
            why = before.get("remote_last_error") or "still queued"
            print(f"mithrilfs: {pending} changes not yet in the shared tier ({why}); kept in the store"
                  " and sent at its next mount with --remote", file=sys.stderr)
    return 0


def _cmd_gc(args: argparse.Namespace) -> int:
    return _evict(args, "gc", f"to={args.to}" if args.to is not None else "run", args.to)


def _cmd_clear(args: argparse.Namespace) -> int:
    return _evict(args, "clear", "run", 0)


def _evict(args: argparse.Namespace, command: str, request: str, target: int | None) -> int:
    """Run an eviction command (``gc``, ``clear``) down to *target* bytes (None: the low watermark),
    drawing its progress, and say what it freed in words."""
    path = control_file(args.mountpoint, command)
    before = read_stats(args.mountpoint)
    if target is None:
        target = before["low_bytes"]
    to_free = max(0, before["physical_bytes"] - target)
    draw = progress_bar("evicting", sizes=True) if to_free and not args.json else None
    answer = while_drawing(lambda: control_command(path, request), args.mountpoint, draw, to_free)
    if args.json:
        print(json.dumps(answer, sort_keys=True))
        return 0
    kept = answer["skipped_pinned"]
    units = f" in {answer['units']:,} entries" if answer["units"] != answer["files"] else ""
    print(f"evicted {answer['files']:,} {'file' if answer['files'] == 1 else 'files'}{units}, "
          f"{format_size(answer['bytes'])}; the cache now holds {format_size(answer['physical_bytes'])} of its "
          f"{format_size(answer['max_bytes'])} budget"
          + (f"; {kept:,} {'entry' if kept == 1 else 'entries'} in use or too young, kept" if kept else ""))
    return 0


# fsck's exit statuses, as fsck(8): problems repaired, problems left, could not check
FSCK_REPAIRED, FSCK_UNREPAIRED, FSCK_OPERATIONAL_ERROR = 1, 4, 8


def _cmd_fsck(args: argparse.Namespace) -> int:
    from mithrilfs.store.open import open_store
    from mithrilfs.tools import fsck

    root = _existing_store(args.store)
    try:
        store = open_store(root)
    except StoreError as e:
        msg = f"{root}: store is mounted or in use; unmount it before fsck" if "in use" in str(e) else str(e)
        print(f"mithrilfs: error: {msg}", file=sys.stderr)
        return FSCK_OPERATIONAL_ERROR
    try:
        report = fsck.check(store, None if args.json else progress_bar("verifying blobs"))
        found = bool(report.problems())
        after = None
        if found and args.repair:
            fsck.repair(store, report)
            after = fsck.check(store)
    finally:
        store.close()
    status = 0 if not found else FSCK_UNREPAIRED if after is None or after.problems() else FSCK_REPAIRED
    if args.json:
        doc = fsck.as_json(report) | {"store": str(root), "exit_status": status}
        if after is not None:
            doc["left_after_repair"] = after.problems()
        print(json.dumps(doc, sort_keys=True))
        return status
    if after is None:
        print(f"fsck {root}: {report.summary()}" + ("; run with --repair to fix" if found else ""))
    elif not after.problems():
        print(f"fsck {root}: {report.summary()}; repaired")
    else:
        print(f"fsck {root}: {report.summary()}; repair left: {after.summary()}")
    for name in report.corrupt_files:
        print(f"  corrupt: {shown(name)}" + (" (removed: a cache miss from now on)" if after is not None else ""))
    for name in report.bad_names:
        print(f"  name the mount cannot serve: {shown(name)}" + (" (removed)" if after is not None else ""))
    return status


def _cmd_stats(args: argparse.Namespace) -> int:
    from mithrilfs.observe.stats import format_table, format_usage

    if args.zero:
        control_command(control_file(args.mountpoint, "zero"), "zero")
        if not args.json and args.watch is None:
            print(f"statistics zeroed ({args.mountpoint.expanduser().absolute()})")
            return 0
    # the largest files are a command (the owner's); bytes per directory anyone who sees the mount reads
    usage_file = control_file(args.mountpoint, "usage" if args.top else "usage.json")
    while True:
        snap = read_stats(args.mountpoint)
        snap["usage"] = (control_command(usage_file, f"top={args.top}") if args.top
                         else read_json(args.mountpoint, usage_file) | {"largest": []})
        if args.json:
            print(json.dumps(snap, sort_keys=True), flush=True)
        else:
            if args.watch and sys.stdout.isatty():
                sys.stdout.write("\x1b[H\x1b[2J")
            print(format_table(snap) + "\n\n" + format_usage(snap["usage"], top=args.top is not None), flush=True)
        if not args.watch:
            return 0
        time.sleep(args.watch)


def _cmd_why(args: argparse.Namespace) -> int:
    from mithrilfs.tools import why

    if args.store is not None and args.mountpoint is not None and args.path is None:
        args.mountpoint, args.path = None, args.mountpoint  # ``why --store DIR PATH``
    if (args.mountpoint is None) == (args.store is None):
        raise UsageError("why needs either MOUNTPOINT or --store DIR")
    mount = counters = None
    if args.mountpoint is not None:
        mount = args.mountpoint.expanduser().absolute()
        snap = read_stats(mount)
        store, counters = Path(snap["store"]), snap.get("all_mounts")
    else:
        store = _existing_store(args.store)
    under = None
    if args.path is not None:
        # through a mount, PATH is relative to it or absolute inside it; with --store, relative to the store's root
        under = str(args.path) if mount is None else os.path.relpath(mount / args.path, mount)
        if under == ".." or under.startswith("../"):
            raise UsageError(f"{args.path} is not inside {mount}")
        under = "" if under == "." else under
    if not os.access(store, os.R_OK | os.X_OK):
        raise daemon.MountError(f"cannot read the events of {store}: permission denied")
    groups = why.report(store, mount, under)
    if args.json:
        # the counters come from the mount's stats; without a mount, the events alone
        kept = None if counters is None else {k: counters.get(k, 0) for k in (
            "identical_recompiles", "identical_recompile_bytes", "fleet_identical_recompiles")}
        print(json.dumps({"store": str(store), "counters": kept, "entries": groups}, sort_keys=True))
    else:
        print(why.format_report(groups, counters))
    return 0


def _cmd_restart(args: argparse.Namespace) -> int:
    mp = args.mountpoint.expanduser().absolute()
    before = read_stats(mp)
    if not (mp / ".mithrilfs" / "restart").exists():
        raise daemon.MountError(f"{mp}: this mount has no supervisor to hand it over to (its daemon could not start"
                                " one, or is older than restarts): unmount and mount it again instead")
    if before.get("supervisor") == "gone":
        raise daemon.MountError(f"{mp}: restart refused: its supervisor is gone (killed?), so no new daemon would"
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
        raise daemon.MountError(f"{mp}: restart refused: {refused.get('error')}")
    while True:
        # reads wait in the kernel while the daemons change places: the answer comes from the new one,
        # in a thread of its own, so a successor that never serves cannot hold this past the timeout
        pid = call_within(lambda: daemon.daemon_pid(mp), deadline - time.monotonic())
        if pid is not None and pid != before["pid"]:
            break
        if time.monotonic() > deadline or (pid is None and not daemon.is_fuse_mount(mp)):
            raise daemon.MountError(f"{mp}: no new daemon took over within {args.timeout:g} s"
                                    + (" (the handover was asked for and may still complete: see 'mithrilfs "
                                       "status')" if daemon.is_fuse_mount(mp) else " (the mount is gone)"))
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


def _cmd_status(args: argparse.Namespace) -> int:
    mp = args.mountpoint.expanduser().absolute()
    state = daemon.probe_mount(mp, timeout=1.0)
    snap: dict[str, Any] = {}
    if state == "live":
        try:
            snap = read_stats(mp)
        except (OSError, ValueError, UsageError, daemon.MountError):
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
                          "ended": gone, "outside_since_mount": [leaks.as_json(x) for x in outside]},
                         sort_keys=True))
        return status
    if state == "live":
        print(f"{mp}: live{' (read-only store: serves cached files, writes fail)' if snap.get('read_only') else ''}, "
              f"pid {snap['pid']}, {snap['files']} files, {format_size(snap['physical_bytes'])} of "
              f"{format_size(snap['max_bytes'])}, hit rate {snap['hit_rate']:.0%}{_restarts_line(snap)}")
        from mithrilfs.observe.stats import format_levels

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
        print(daemon.forbidden_message(mp))
    elif state == "unmounted" and (gone := ended.read(os.path.realpath(mp))) is not None:
        at = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(gone["at"]))
        print(f"{mp}: not mounted: detached at {at}: {gone['reason']}")
    else:
        print(f"{mp}: " + {"unmounted": "not mounted", "dead": "daemon is gone (stale mount)",
                           "hung": "mounted but not answering within 1 s",
                           "foreign": "mounted, but not a mithrilfs mount"}[state])
    return status


def _cmd_export(args: argparse.Namespace) -> int:
    from mithrilfs.store.open import open_store
    from mithrilfs.tools import archive

    if (args.source is None) == (args.store is None):
        raise UsageError("export needs either MOUNTPOINT or --store DIR")
    if args.file.exists():
        raise UsageError(f"{args.file} already exists")
    if not args.file.absolute().parent.is_dir():
        raise UsageError(f"{args.file.absolute().parent} does not exist")
    progress = None if args.json else progress_bar("exporting")
    # written under a temporary name and renamed when whole: an interrupted export leaves no archive
    partial = args.file.with_name(f".{args.file.name}.partial")
    try:
        if args.source is not None:
            mp = args.source.expanduser().absolute()
            control_file(mp, "pid")
            result = archive.export_mount(mp, partial, progress)
        else:
            store = open_store(_existing_store(args.store))
            try:
                result = archive.export_store(store, partial, progress)
            finally:
                store.close()
        if args.mode is not None:
            os.chmod(partial, args.mode)
        os.rename(partial, args.file)
    except OSError as e:
        raise daemon.MountError(f"cannot write {args.file}: {e.strerror}") from None
    finally:
        partial.unlink(missing_ok=True)
    if args.json:
        print(json.dumps(result | {"file": str(args.file)}, sort_keys=True))
    else:
        print(f"exported {result['entries']:,} entries, {result['blobs']:,} blobs to {args.file}")
    return 0


def _existing_store(path: Path | None) -> Path:
    from mithrilfs.store.open import validate_store

    root = (path or default_store()).expanduser().absolute()
    try:
        validate_store(root)  # an unreadable store is named as such, not as missing
    except StoreError as e:
        raise UsageError(str(e)) from None
    if not (root / "FORMAT").exists():
        raise UsageError(f"{root}: not a mithrilfs store")
    return root


def _cmd_import(args: argparse.Namespace) -> int:
    from mithrilfs.store.open import open_store
    from mithrilfs.tools import archive

    if not args.file.is_file():
        raise UsageError(f"{args.file}: no such archive")
    try:
        archive.check_archive(args.file)
    except archive.ArchiveError as e:
        raise UsageError(str(e)) from None
    store = open_store((args.store or default_store()).expanduser().absolute())
    try:
        r = archive.import_archive(args.file, store, None if args.json else progress_bar("importing"))
    except archive.ArchiveError as e:
        raise UsageError(str(e)) from None
    finally:
        store.close()
    # anything in the archive not imported as it stands: a corrupt blob, a name the mount cannot
    # serve, a path whose place the store holds with something else
    status = 1 if r["corrupt_blobs"] or r["rejected"] or r["conflicts"] else 0
    if args.json:
        print(json.dumps(r | {"file": str(args.file), "exit_status": status}, sort_keys=True))
        return status
    print(f"imported {args.file}: {r['added']} added, {r['replaced']} replaced by newer, {r['kept']} kept, "
          f"{r['blobs']} blobs verified" + (f", {r['corrupt_blobs']} corrupt blobs skipped" if r["corrupt_blobs"] else "")
          + (f", {r['rejected']} names the mount cannot serve rejected" if r["rejected"] else "")
          + (f", {r['conflicts']} conflicting paths left alone" if r["conflicts"] else ""))
    return status


def _cmd_prefetch(args: argparse.Namespace) -> int:
    mp = args.mountpoint.expanduser().absolute()
    request = "all" if args.all else f"set={args.set}"
    try:
        answer = tier_command(mp, "prefetch", request)
    except DaemonChanged:  # the daemon that started it died before answering: following asks its successor
        answer = {"started": True}
    if not answer.get("started"):
        print(f"mithrilfs: error: cannot prefetch: {answer['error']}", file=sys.stderr)
        return 1
    return _follow_prefetch(mp, request)


#: How often a prefetch is asked again of a daemon that replaced the one running it (a crash loop ends it).
PREFETCH_RESUMES = 5


def _follow_prefetch(mp: Path, request: str, *, warn_only: bool = False) -> int:
    """Wait for the mount's prefetch, drawing its progress on a terminal; print its summary.

    A daemon that takes a mount over (a crash, a restart) does not go on with its predecessor's prefetch:
    its state is "idle".  The prefetch (*request*, as the command takes it) is then asked again; what the
    first daemon fetched is local already and is not fetched twice.
    """
    draw = progress_bar("prefetching")
    resumes = 0
    while True:
        state = read_stats(mp).get("prefetch", {})
        if state.get("state") == "idle" and resumes < PREFETCH_RESUMES:
            resumes += 1
            try:
                answer = tier_command(mp, "prefetch", request)
            except DaemonChanged:  # replaced again between asking and answering: the next look asks again
                continue
            if not answer.get("started"):
                state = {"state": "failed", "error": answer.get("error")}
                break
            continue
        if state.get("state") != "running":
            break
        if draw and state.get("total_files"):
            draw(min(state["files"] + state["misses"], state["total_files"]), state["total_files"])
        time.sleep(0.1)
    if state.get("state") != "done":
        print(f"mithrilfs: {'warning' if warn_only else 'error'}: prefetch failed: {state.get('error')}",
              file=sys.stderr)
        return 0 if warn_only else 1
    rate = state["bytes"] / max(state["seconds"], 1e-3)
    print(f"prefetched {state['files']} files, {format_size(state['bytes'])} in {state['seconds']:.1f} s "
          f"({format_size(int(rate))}/s); {state['misses']} misses"
          + (f", {state['skipped_for_budget']} left out for the budget" if state["skipped_for_budget"] else ""),
          file=sys.stderr if warn_only else sys.stdout)
    return 0


def _cmd_push(args: argparse.Namespace) -> int:
    mp = args.mountpoint.expanduser().absolute()
    start = read_stats(mp)
    answer = tier_command(mp, "push", "push")
    if "error" in answer:
        print(f"mithrilfs: error: cannot push: {answer['error']}", file=sys.stderr)
        return 1
    queued = answer["queued"]
    draw = progress_bar("uploading")
    last_left, progress_at = None, time.monotonic()
    while True:
        snap = read_stats(mp)
        left = snap["upload_queue"]
        if draw:
            draw(queued - min(left, queued), queued)
        if left == 0:
            break
        if left != last_left:
            last_left, progress_at = left, time.monotonic()
        elif snap["remote_last_error"] and time.monotonic() - progress_at > PUSH_STALL_SECONDS:
            print(f"mithrilfs: error: cannot push: {snap['remote_last_error']}; {left} files still queued"
                  " (kept, sent when the shared tier answers)", file=sys.stderr)
            return 1
        time.sleep(0.2)
    sent = snap["remote_uploaded_bytes"] - start["remote_uploaded_bytes"]
    print(f"pushed {queued} files; {format_size(sent)} of new blobs uploaded")
    return 0


#: ``push`` gives up after this long without progress while the tier reports errors.
PUSH_STALL_SECONDS = 5.0


def _cmd_config(args: argparse.Namespace) -> int:
    """Show or change the store's settings; a mounted store applies them at once."""
    from mithrilfs import settings
    from mithrilfs.store.open import holder_record, open_store, validate_store

    root = (args.store or default_store()).expanduser().absolute()
    given = given_settings(args)
    # checked before anything changes: settings that do not fit together are a one-line error
    if args.reset:
        validate_store(root)  # a damaged settings file is what --reset is for
        stored = dict(given)
    else:
        stored = _stored_settings(root) | given
    policy = _policy(root, stored, {})
    if not (root / "FORMAT").exists():
        open_store(root).close()  # a new store, made as a mount would make it
    if given or args.reset:
        settings.save(root, stored)
    applied = None
    held = holder_record(root) or {}
    if (given or args.reset) and held:
        mp = Path(held["mountpoint"])
        if daemon.probe_mount(mp, timeout=5.0) == "live":
            applied = control_command(control_file(mp, "settings"), "reload")
    shown = {k: getattr(policy, field) for k, (field, _) in settings.SETTINGS.items()}
    if args.json:
        print(json.dumps({"store": str(root), "settings": shown, "stored": sorted(stored),
                          "applied_to": held["mountpoint"] if applied and applied.get("applied") else None},
                         sort_keys=True))
        return 0
    print(f"store {root}")
    for key, value in shown.items():
        text = ("never" if value is None else format_size(value) if key == "max_size"
                else f"{value:.0%}" if "watermark" in key else f"{value:g}s" if key in ("min_age", "idle_ttl")
                else str(value))
        print(f"  {key.replace('_', '-'):<16}{text:<12}{'(stored)' if key in stored else '(default)'}")
    if applied is not None:
        if "error" in applied:
            print(f"mithrilfs: warning: the mount at {held['mountpoint']} could not apply them: {applied['error']}",
                  file=sys.stderr)
        else:
            kept = ", ".join("--" + k.replace("_", "-") for k in applied.get("kept", []))
            print(f"applied to the mount at {held['mountpoint']}"
                  + (f" (its command line's {kept} kept until it is mounted again)" if kept else ""))
    return 0


#: Each command's function, by the name the parser gives it.
COMMANDS = {"mount": _cmd_mount, "umount": _cmd_umount, "unmount": _cmd_umount, "gc": _cmd_gc, "fsck": _cmd_fsck,
             "stats": _cmd_stats, "why": _cmd_why, "status": _cmd_status, "restart": _cmd_restart, "reload": _cmd_restart,
             "export": _cmd_export, "import": _cmd_import, "push": _cmd_push, "prefetch": _cmd_prefetch,
             "clear": _cmd_clear, "config": _cmd_config}
