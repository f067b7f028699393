"""Command line: argument parsing, one-line errors, exit codes.

User mistakes end with one line on stderr and exit status 2 (bad usage) or
1 (the operation failed); never a traceback.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, NoReturn, Sequence

from mithrilfs.daemon import lifecycle as daemon
from mithrilfs.control.files import CONTROL_NAME
from mithrilfs.errors import UsageError
from mithrilfs.shared.redis_wire import url_password, without_password
from mithrilfs.cache.eviction import EvictionPolicy
from mithrilfs.store.open import StoreError, default_store
from mithrilfs.units import SIZE_HELP, format_size, parse_duration, parse_size


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def _bytes(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _size(text: str) -> int:
    n = _bytes(text)
    if n <= 0:
        raise argparse.ArgumentTypeError(f"size must be positive: {text!r}")
    return n


def _duration(text: str) -> float:
    try:
        return parse_duration(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def _fraction(text: str) -> float:
    """``95%`` or ``0.95``."""
    try:
        value = float(text[:-1]) / 100 if text.endswith("%") else float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"invalid watermark {text!r} (use e.g. 95% or 0.95)") from None
    if not 0 < value <= 1:
        raise argparse.ArgumentTypeError(f"watermark must be between 0% and 100%: {text!r}")
    return value


def _file_mode(text: str) -> int:
    try:
        mode = int(text, 8)
    except ValueError:
        mode = -1
    if not 0 <= mode <= 0o777:
        raise argparse.ArgumentTypeError(f"invalid mode {text!r} (permission bits in octal, e.g. 0640)")
    return mode


def _port(text: str) -> int:
    if not text.isdigit() or not 0 < int(text) < 65536:
        raise argparse.ArgumentTypeError(f"invalid port {text!r} (1-65535)")
    return int(text)


def _remote_url(text: str) -> str:
    from mithrilfs.shared.redis_wire import check_url

    try:
        check_url(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def _owner(text: str) -> tuple[int, int]:
    uid, sep, gid = text.partition(":")
    if not sep or not uid.isdigit() or not gid.isdigit() or int(uid) >= 1 << 32 or int(gid) >= 1 << 32:
        raise argparse.ArgumentTypeError(f"invalid owner {text!r} (use numeric UID:GID)")
    return int(uid), int(gid)


def _set_name(text: str) -> str:
    if text and not all(c.isalnum() or c in "-_." for c in text) or len(text) > 100:
        raise argparse.ArgumentTypeError(f"invalid set name {text!r} (letters, digits, - _ .)")
    return text


def _count(text: str) -> int:
    if not text.isdigit():
        raise argparse.ArgumentTypeError(f"invalid count {text!r} (a whole number)")
    return int(text)


#: The options a store keeps: ``settings.SETTINGS`` name (the flag is --name-with-dashes), parser,
#: metavar, help, default.
_SETTING_OPTIONS = (
    ("max_size", _size, "SIZE", "byte budget of the store: 500M, 10G, 1.5T or bytes; " + SIZE_HELP, "10G"),
    ("high_watermark", _fraction, "PCT", "start evicting above this share of the budget", "95%%"),
    ("low_watermark", _fraction, "PCT", "evict down to this share of the budget", "85%%"),
    ("min_age", _duration, "DURATION", "never evict files changed more recently", "5s"),
    ("idle_ttl", _duration, "DURATION", "evict anything unused for this long, even under budget", "never"),
    ("min_entries", _count, "N", "never evict below N files or groups", "0"),
)


def _add_settings(p: argparse.ArgumentParser, default_from: str) -> None:
    """The options a store keeps; unset ones are None (so the store's value can stand)."""
    for name, parse, metavar, text, default in _SETTING_OPTIONS:
        p.add_argument("--" + name.replace("_", "-"), type=parse, default=None, metavar=metavar,
                       help=f"{text} (default: {default_from}{default})")


def _given_settings(args: argparse.Namespace) -> dict[str, Any]:
    return {name: getattr(args, name) for name, *_ in _SETTING_OPTIONS if getattr(args, name) is not None}


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


def _store_policy(store: Path, given: dict[str, Any]) -> EvictionPolicy:
    """The store's settings with *given* (the command line's) on top."""
    return _policy(store, _stored_settings(store), given)


def _build_parser() -> argparse.ArgumentParser:
    from mithrilfs import __version__

    p = _Parser(prog="mithrilfs", description="A deduplicating, evicting FUSE compile cache.")
    p.add_argument("--version", action="version", version=f"mithrilfs {__version__}")
    sub = p.add_subparsers(dest="command", parser_class=_Parser, metavar="COMMAND")

    m = sub.add_parser("mount", help="mount the cache filesystem")
    m.add_argument("mountpoint", type=Path)
    m.add_argument("--store", type=Path, default=None, help=f"store directory (default {default_store()})")
    m.add_argument("--foreground", "-f", action="store_true", help="stay attached (for containers)")
    m.add_argument("--nonempty", action="store_true", help="mount over a directory that holds files (hiding them)")
    m.add_argument("--allow-other", action="store_true", help="let other users see the mount")
    m.add_argument("--debug", action="store_true", help="log every FUSE request")
    _add_settings(m, "the store's setting ('mithrilfs config'), else ")
    m.add_argument("--metrics-port", type=_port, default=None, metavar="PORT",
                   help="serve Prometheus metrics on 127.0.0.1:PORT/metrics")
    m.add_argument("--remote", type=_remote_url, default=None, metavar="URL",
                   help="share the cache through Redis: redis://host:port/db or rediss://... (the password"
                        " from --remote-password-file or $MITHRILFS_REMOTE_PASSWORD)")
    m.add_argument("--remote-password-file", type=Path, default=None, metavar="FILE",
                   help="read the Redis password from FILE")
    m.add_argument("--remote-cluster", action="store_true",
                   help="URL names one node of a Redis Cluster")
    m.add_argument("--remote-owner", type=_owner, default=None, metavar="UID:GID",
                   help="owner of files that come from the shared tier (default: the mount root's)")
    m.add_argument("--startup-set", type=_set_name, default="default", metavar="NAME",
                   help="record what the workload reads in its first minutes into this shared set (default 'default')")
    m.add_argument("--prefetch", type=_set_name, nargs="?", const="", default=None, metavar="NAME",
                   help="before returning, fetch a startup set from the shared tier (default: --startup-set's)")
    m.add_argument("--remote-namespace", default="default", metavar="NAME",
                   help="nodes sharing a namespace share one tree (default 'default')")
    m.add_argument("--remote-key-file", type=Path, default=None, metavar="FILE",
                   help="sign entries with this key; entries without a valid signature are ignored")

    u = sub.add_parser("umount", aliases=["unmount"], help="flush, unmount and wait for the daemon")
    u.add_argument("mountpoint", type=Path)
    u.add_argument("--lazy", action="store_true",
                   help="detach now even if files are in use; the daemon exits once they are closed")

    g = sub.add_parser("gc", help="evict now and print what was freed")
    g.add_argument("mountpoint", type=Path)
    g.add_argument("--to", type=_bytes, default=None, metavar="SIZE",
                   help="evict down to this many bytes (default: the low watermark)")
    g.add_argument("--json", action="store_true", help="print the result as JSON")

    cl = sub.add_parser("clear", help="evict every file not being written, now (ccache -C)")
    cl.add_argument("mountpoint", type=Path)
    cl.add_argument("--json", action="store_true", help="print the result as JSON")

    c = sub.add_parser("config", help="show or change the settings a store keeps for its mounts (ccache -M)",
                       description="Settings kept in the store are used by every later mount unless its command "
                                   "line gives another value; a mounted store applies them at once.")
    c.add_argument("store", type=Path, nargs="?", default=None, metavar="STORE",
                   help=f"store directory (default {default_store()})")
    _add_settings(c, "")
    c.add_argument("--reset", action="store_true", help="forget every stored setting (back to the defaults)")
    c.add_argument("--json", action="store_true", help="print the settings as JSON")

    pu = sub.add_parser("push", help="upload everything not yet in the shared tier")
    pu.add_argument("mountpoint", type=Path)

    pf = sub.add_parser("prefetch", help="fetch a startup set (or everything) from the shared tier, verified")
    pf.add_argument("mountpoint", type=Path)
    which = pf.add_mutually_exclusive_group()
    which.add_argument("--set", type=_set_name, default="default", metavar="NAME",
                       help="the startup set to fetch (default 'default')")
    which.add_argument("--all", action="store_true", help="fetch the whole shared namespace (within the budget)")

    s = sub.add_parser("stats", help="hits, misses, bytes, dedup and latency of a mount")
    s.add_argument("mountpoint", type=Path)
    s.add_argument("--json", action="store_true", help="print the JSON document")
    s.add_argument("--watch", type=_duration, default=None, metavar="SECONDS", help="refresh every SECONDS")
    s.add_argument("--top", type=_count, default=None, metavar="N", help="also list the N largest files")
    s.add_argument("--zero", action="store_true",
                   help="set every counter to zero, those kept over remounts too (ccache -z)")

    st = sub.add_parser("status", help="exit 0 with one line when the mount is live (health probe)")
    st.add_argument("mountpoint", type=Path)
    st.add_argument("--ready", action="store_true",
                    help="also exit 1 while a prefetch runs (a startup probe that holds the app back)")
    st.add_argument("--json", action="store_true", help="print the state as JSON")

    e = sub.add_parser("env", help="print shell exports pointing Inductor and Triton at the mount")
    e.add_argument("mountpoint", type=Path)

    r = sub.add_parser("run", help="run a command with its compile caches on the mount")
    r.add_argument("--mount", type=Path, default=None, metavar="MOUNTPOINT",
                   help="use (or mount) this mount point (default: a temporary one)")
    r.add_argument("--store", type=Path, default=None, help="store when mounting (default: the platform cache dir)")
    r.add_argument("cmd", nargs=argparse.REMAINDER, metavar="-- CMD ARGS")

    x = sub.add_parser("export", help="write the whole namespace and its blobs to one archive")
    x.add_argument("source", type=Path, nargs="?", default=None, metavar="MOUNTPOINT")
    x.add_argument("file", type=Path, metavar="FILE")
    x.add_argument("--store", type=Path, default=None, help="export an unmounted store instead of a mount")
    x.add_argument("--mode", type=_file_mode, default=None, metavar="OCTAL",
                   help="permissions of the archive (default 0600: it holds every cached file's bytes)")
    x.add_argument("--json", action="store_true", help="print the result as JSON")

    i = sub.add_parser("import", help="merge an archive into a store (newer entries win)")
    i.add_argument("file", type=Path, metavar="FILE")
    i.add_argument("--store", type=Path, default=None, help=f"store directory (default {default_store()})")
    i.add_argument("--json", action="store_true", help="print the result as JSON")

    f = sub.add_parser(
        "fsck", help="verify a store (not mounted); --repair fixes what it finds",
        description="Exit status: 0 no problems, 1 problems repaired, 4 problems left, 8 could not check.",
    )
    f.add_argument("--store", type=Path, default=None, help=f"store directory (default {default_store()})")
    f.add_argument("--repair", action="store_true", help="quarantine corrupt blobs, fix the index")
    f.add_argument("--json", action="store_true", help="print the report as JSON")
    return p


def _cmd_mount(args: argparse.Namespace) -> int:
    store = (args.store or default_store()).expanduser().absolute()
    given = _given_settings(args)
    policy = _store_policy(store, given)
    key = None
    if args.remote_key_file is not None:
        if args.remote is None:
            _usage_error("--remote-key-file needs --remote")
        try:
            key = args.remote_key_file.read_bytes().strip()
        except OSError as e:
            _usage_error(f"cannot read key file {args.remote_key_file}: {e.strerror}")
        if len(key) < 16:
            _usage_error(f"key file {args.remote_key_file} holds fewer than 16 bytes")
    if not args.remote_namespace or not all(c.isalnum() or c in "-_." for c in args.remote_namespace):
        _usage_error(f"invalid namespace {args.remote_namespace!r} (letters, digits, - _ .)")
    password = _remote_password(args)
    opts = daemon.MountOptions(
        policy=policy,
        metrics_port=args.metrics_port,
        remote=without_password(args.remote) if args.remote else None,
        remote_namespace=args.remote_namespace,
        remote_key=key,
        remote_password=password,
        remote_cluster=args.remote_cluster,
        remote_owner=args.remote_owner,
        startup_set=args.startup_set,
        prefetch=None if args.prefetch is None else (args.prefetch or args.startup_set),
        mountpoint=args.mountpoint.expanduser().absolute(),
        store=store,
        foreground=args.foreground,
        allow_other=args.allow_other,
        debug=args.debug,
        nonempty=args.nonempty,
        fixed_settings=frozenset(given),
    )
    if opts.prefetch is not None and args.remote is None:
        _usage_error("--prefetch needs --remote")
    status = daemon.mount(opts)
    if status == 0 and opts.remote is not None and not opts.foreground:
        _warn_if_unreachable(opts)
    if status == 0 and opts.prefetch is not None and not opts.foreground:
        _follow_prefetch(opts.mountpoint, warn_only=True)
    return status


def _warn_if_unreachable(opts: daemon.MountOptions) -> None:
    """The mount works as a local cache without Redis, but the user should know it is alone."""
    from mithrilfs.shared.redis_wire import RemoteError, RemoteTier

    tier = RemoteTier(opts.remote, opts.remote_namespace, password=opts.remote_password,  # type: ignore[arg-type]
                      cluster=opts.remote_cluster)
    try:
        tier.ping()
    except RemoteError as e:
        print(f"mithrilfs: warning: the shared tier {tier.url} cannot be reached ({e}); mounted as a local cache,"
              " changes are queued and sent when it answers", file=sys.stderr)
    finally:
        tier.close()


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
                _usage_error(f"--{opt.replace('_', '-')} needs --remote")
        return None
    if args.remote_password_file is not None:
        try:
            password = args.remote_password_file.read_text().strip()
        except (OSError, UnicodeDecodeError) as e:
            _usage_error(f"cannot read password file {args.remote_password_file}: {getattr(e, 'strerror', e)}")
        if not password:
            _usage_error(f"password file {args.remote_password_file} is empty")
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
    try:
        before = _read_stats(mp)
    except (OSError, ValueError, UsageError):
        before = None
    daemon.umount(mp, lazy=args.lazy)
    if before is not None and "upload_queue" in before:
        pending = daemon.pending_uploads(Path(before["store"]))
        if pending:
            why = before.get("remote_last_error") or "still queued"
            print(f"mithrilfs: {pending} changes not yet in the shared tier ({why}); kept in the store"
                  " and sent at its next mount with --remote", file=sys.stderr)
    return 0


def _usage_error(message: str) -> NoReturn:
    print(f"mithrilfs: error: {message}", file=sys.stderr)
    sys.exit(2)


def control_file(mountpoint: Path, name: str) -> Path:
    """A file of the mount's control directory, or a one-line error when it is not a live mount."""
    mp = mountpoint.expanduser().absolute()
    state = daemon.probe_mount(mp, timeout=5.0)
    if state == "forbidden":
        raise daemon.MountError(daemon.forbidden_message(mp))
    if state in ("dead", "hung"):
        raise UsageError(f"{mp}: " + ("its daemon is gone (stale mount); run 'mithrilfs umount " + str(mp) + "'"
                                      " and mount again" if state == "dead" else "the mount does not answer"))
    if not mp.is_dir():
        raise UsageError(f"{mp} is not a directory")
    path = mp / CONTROL_NAME.decode() / name
    if not path.exists():
        raise UsageError(f"{mp} is not a mithrilfs mount")
    return path


def _control_command(path: Path, request: str) -> dict:
    """Run a command through its control file: write the request, read the JSON answer back.

    Commands change the mount, so only its owner may run them; anyone who sees the mount reads.
    """
    try:
        try:
            fd = os.open(path, os.O_RDWR)
        except PermissionError:
            owner = path.stat().st_uid
            raise daemon.MountError(f"{path.parent.parent}: '{path.name}' needs the rights of the mount's owner "
                                    f"(uid {owner}; this is uid {os.getuid()}): run it as uid {owner}") from None
        try:
            os.write(fd, request.encode())
            return json.loads(os.pread(fd, 1 << 16, 0))
        finally:
            os.close(fd)
    except OSError as e:  # the mount went away under us
        raise daemon.MountError(f"{path.parent.parent}: the mount stopped answering ({e.strerror})") from None


def _cmd_gc(args: argparse.Namespace) -> int:
    return _evict(args, "gc", f"to={args.to}" if args.to is not None else "run", args.to)


def _cmd_clear(args: argparse.Namespace) -> int:
    return _evict(args, "clear", "run", 0)


def _evict(args: argparse.Namespace, command: str, request: str, target: int | None) -> int:
    """Run an eviction command (``gc``, ``clear``) down to *target* bytes (None: the low watermark),
    drawing its progress, and say what it freed in words."""
    path = control_file(args.mountpoint, command)
    before = _read_stats(args.mountpoint)
    if target is None:
        target = before["low_bytes"]
    to_free = max(0, before["physical_bytes"] - target)
    draw = _progress_bar("evicting", sizes=True) if to_free and not args.json else None
    answer = _while_drawing(lambda: _control_command(path, request), args.mountpoint, draw, to_free)
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


def _while_drawing(command: Callable[[], dict], mountpoint: Path, draw: Callable[[int, int], None] | None,
                   total: int) -> dict:
    """Run a blocking control command; meanwhile draw the eviction's progress from ``stats``."""
    if draw is None:
        return command()
    import concurrent.futures

    with concurrent.futures.ThreadPoolExecutor(1) as pool:
        running = pool.submit(command)
        while not running.done():
            try:
                current = _read_stats(mountpoint).get("eviction") or {}
            except (UsageError, daemon.MountError):
                break
            draw(min(current.get("bytes", 0), total), total)
            concurrent.futures.wait([running], timeout=0.1)
        answer = running.result()
    draw(total, total)
    return answer


def _progress_bar(label: str, *, sizes: bool = False) -> Callable[[int, int], None] | None:
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


# fsck's exit statuses, as fsck(8): problems repaired, problems left, could not check
FSCK_REPAIRED, FSCK_UNREPAIRED, FSCK_OPERATIONAL_ERROR = 1, 4, 8


def _cmd_fsck(args: argparse.Namespace) -> int:
    from mithrilfs.tools import fsck
    from mithrilfs.store.open import open_store

    root = _existing_store(args.store)
    try:
        store = open_store(root)
    except StoreError as e:
        msg = f"{root}: store is mounted or in use; unmount it before fsck" if "in use" in str(e) else str(e)
        print(f"mithrilfs: error: {msg}", file=sys.stderr)
        return FSCK_OPERATIONAL_ERROR
    try:
        report = fsck.check(store, None if args.json else _progress_bar("verifying blobs"))
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
        print(f"  corrupt: {name}" + (" (removed: a cache miss from now on)" if after is not None else ""))
    for name in report.bad_names:
        print(f"  name the mount cannot serve: {name}" + (" (removed)" if after is not None else ""))
    return status


def _read_stats(mountpoint: Path) -> dict:
    return _read_json(mountpoint, control_file(mountpoint, "stats.json"))


def _read_json(mountpoint: Path, path: Path) -> dict:
    """A JSON control file's content."""
    try:
        return json.loads(path.read_text())
    except OSError as e:  # the mount went away under us
        raise daemon.MountError(f"{mountpoint}: the mount stopped answering ({e.strerror})") from None


def _cmd_stats(args: argparse.Namespace) -> int:
    from mithrilfs.observe.stats import format_table, format_usage

    if args.zero:
        _control_command(control_file(args.mountpoint, "zero"), "zero")
        if not args.json and args.watch is None:
            print(f"statistics zeroed ({args.mountpoint.expanduser().absolute()})")
            return 0
    # the largest files are a command (the owner's); bytes per directory anyone who sees the mount reads
    usage_file = control_file(args.mountpoint, "usage" if args.top else "usage.json")
    while True:
        snap = _read_stats(args.mountpoint)
        snap["usage"] = (_control_command(usage_file, f"top={args.top}") if args.top
                         else _read_json(args.mountpoint, usage_file) | {"largest": []})
        if args.json:
            print(json.dumps(snap, sort_keys=True), flush=True)
        else:
            if args.watch and sys.stdout.isatty():
                sys.stdout.write("\x1b[H\x1b[2J")
            print(format_table(snap) + "\n\n" + format_usage(snap["usage"], top=args.top is not None), flush=True)
        if not args.watch:
            return 0
        time.sleep(args.watch)


def _cmd_status(args: argparse.Namespace) -> int:
    mp = args.mountpoint.expanduser().absolute()
    state = daemon.probe_mount(mp, timeout=1.0)
    snap: dict[str, Any] = {}
    if state == "live":
        try:
            snap = _read_stats(mp)
        except (OSError, ValueError, UsageError, daemon.MountError):
            state = "foreign"
    prefetch = snap.get("prefetch") or {}
    if state == "live" and args.ready and prefetch.get("state") == "running":
        state = "prefetching"
    status = 0 if state == "live" else 1
    if args.json:
        keys = ("pid", "store", "files", "physical_bytes", "max_bytes", "hit_rate", "read_only", "upload_queue",
                "remote_last_error")
        print(json.dumps({"mountpoint": str(mp), "state": state, "ready": status == 0,
                          **{k: snap[k] for k in keys if k in snap}, "prefetch": prefetch or None}, sort_keys=True))
        return status
    if state == "live":
        print(f"{mp}: live{' (read-only store: serves cached files, writes fail)' if snap.get('read_only') else ''}, "
              f"pid {snap['pid']}, {snap['files']} files, {format_size(snap['physical_bytes'])} of "
              f"{format_size(snap['max_bytes'])}, hit rate {snap['hit_rate']:.0%}")
    elif state == "prefetching":
        print(f"{mp}: live, prefetching ({prefetch.get('files', 0)} of {prefetch.get('total_files', '?')} files)")
    elif state == "forbidden":
        print(daemon.forbidden_message(mp))
    else:
        print(f"{mp}: " + {"unmounted": "not mounted", "dead": "daemon is gone (stale mount)",
                           "hung": "mounted but not answering within 1 s",
                           "foreign": "mounted, but not a mithrilfs mount"}[state])
    return status


def cache_env(mountpoint: Path) -> dict[str, str]:
    """The variables that point the frameworks at the mount (their directories are created)."""
    env = {"TORCHINDUCTOR_CACHE_DIR": str(mountpoint / "inductor"), "TRITON_CACHE_DIR": str(mountpoint / "triton")}
    for d in env.values():
        os.makedirs(d, exist_ok=True)
    return env


def _cmd_env(args: argparse.Namespace) -> int:
    mp = args.mountpoint.expanduser().absolute()
    control_file(mp, "pid")  # a one-line error unless it is a live mount
    for k, v in cache_env(mp).items():
        print(f"export {k}={shlex.quote(v)}")
    return 0


def _cmd_run(args: argparse.Namespace) -> int:
    cmd = args.cmd[1:] if args.cmd[:1] == ["--"] else args.cmd
    if not cmd:
        raise UsageError("run needs a command: mithrilfs run [--mount DIR] -- CMD ARGS...")
    temp = None
    if args.mount is None:
        temp = Path(tempfile.mkdtemp(prefix="mithrilfs-run-"))
    mp = (args.mount or temp).expanduser().absolute()  # type: ignore[union-attr]
    state = daemon.probe_mount(mp)
    if state == "forbidden":
        raise daemon.MountError(daemon.forbidden_message(mp))
    mounted_here = state != "live"
    if mounted_here:
        store = (args.store or default_store()).expanduser().absolute()
        try:
            daemon.mount(daemon.MountOptions(mountpoint=mp, store=store, policy=_store_policy(store, {})))
        except BaseException:
            if temp is not None:
                temp.rmdir()
            raise
    try:
        before = _read_stats(mp)
        env = dict(os.environ, **cache_env(mp))
        try:
            status = subprocess.run(cmd, env=env).returncode
        except FileNotFoundError:
            print(f"mithrilfs: error: command not found: {cmd[0]}", file=sys.stderr)
            status = 127
        except OSError as e:  # as a shell says it: not executable, a directory, a bad binary
            print(f"mithrilfs: error: cannot run {cmd[0]}: {e.strerror}", file=sys.stderr)
            status = 126
        # the kernel does not tell the daemon about closes: commit what the command left written
        _control_command(control_file(mp, "commit"), "run")
        after = _read_stats(mp)
        d = {k: after[k] - before[k] for k in ("hits", "misses", "writes", "write_bytes", "commits", "dedup_hits")}
        ended = f"killed by signal {-status}" if status < 0 else f"exit status {status}"
        print(f"mithrilfs: {d['hits']} hits, {d['misses']} misses, {d['commits']} files written "
              f"({format_size(d['write_bytes'])}, {d['dedup_hits']} deduplicated); {ended}",
              file=sys.stderr)
    finally:
        if mounted_here:
            daemon.umount(mp)
        if temp is not None:
            temp.rmdir()
    return status if status >= 0 else 128 - status


def _cmd_export(args: argparse.Namespace) -> int:
    from mithrilfs.tools import archive
    from mithrilfs.store.open import open_store

    if (args.source is None) == (args.store is None):
        raise UsageError("export needs either MOUNTPOINT or --store DIR")
    if args.file.exists():
        raise UsageError(f"{args.file} already exists")
    if not args.file.absolute().parent.is_dir():
        raise UsageError(f"{args.file.absolute().parent} does not exist")
    progress = None if args.json else _progress_bar("exporting")
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
    from mithrilfs.tools import archive
    from mithrilfs.store.open import open_store

    if not args.file.is_file():
        raise UsageError(f"{args.file}: no such archive")
    try:
        archive.check_archive(args.file)
    except archive.ArchiveError as e:
        raise UsageError(str(e)) from None
    store = open_store((args.store or default_store()).expanduser().absolute())
    try:
        r = archive.import_archive(args.file, store, None if args.json else _progress_bar("importing"))
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


def _tier_command(mp: Path, name: str, request: str) -> dict:
    """Run a command that needs the shared tier; a one-line usage error for a mount without one."""
    answer = _control_command(control_file(mp, name), request)
    if answer.get("no_tier"):
        raise UsageError(f"{mp} was mounted without --remote")
    return answer


def _cmd_prefetch(args: argparse.Namespace) -> int:
    mp = args.mountpoint.expanduser().absolute()
    answer = _tier_command(mp, "prefetch", "all" if args.all else f"set={args.set}")
    if not answer.get("started"):
        print(f"mithrilfs: error: cannot prefetch: {answer['error']}", file=sys.stderr)
        return 1
    return _follow_prefetch(mp)


def _follow_prefetch(mp: Path, *, warn_only: bool = False) -> int:
    """Wait for the mount's prefetch, drawing its progress on a terminal; print its summary."""
    draw = _progress_bar("prefetching")
    while True:
        state = _read_stats(mp).get("prefetch", {})
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
    start = _read_stats(mp)
    answer = _tier_command(mp, "push", "push")
    if "error" in answer:
        print(f"mithrilfs: error: cannot push: {answer['error']}", file=sys.stderr)
        return 1
    queued = answer["queued"]
    draw = _progress_bar("uploading")
    last_left, progress_at = None, time.monotonic()
    while True:
        snap = _read_stats(mp)
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
    given = _given_settings(args)
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
    held = holder_record(root)
    if (given or args.reset) and held is not None:
        mp = Path(held["mountpoint"])
        if daemon.probe_mount(mp, timeout=5.0) == "live":
            applied = _control_command(control_file(mp, "settings"), "reload")
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


_COMMANDS = {"mount": _cmd_mount, "umount": _cmd_umount, "unmount": _cmd_umount, "gc": _cmd_gc, "fsck": _cmd_fsck,
             "stats": _cmd_stats, "status": _cmd_status, "env": _cmd_env, "run": _cmd_run,
             "export": _cmd_export, "import": _cmd_import, "push": _cmd_push, "prefetch": _cmd_prefetch,
             "clear": _cmd_clear, "config": _cmd_config}


def main(argv: Sequence[str] | None = None) -> int:
    parser = _build_parser()
    args = parser.parse_args(argv)
    if args.command is None:  # ``mithrilfs`` alone
        parser.print_help()
        return 2
    if args.command in ("fsck", "import", "config", "export"):
        os.umask(0o077)  # files they add to a store are private, like the daemon's; an archive too
    try:
        return _COMMANDS[args.command](args)
    except UsageError as e:
        print(f"mithrilfs: error: {e}", file=sys.stderr)
        return 2
    except (daemon.MountError, StoreError) as e:
        print(f"mithrilfs: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # ``mithrilfs stats --watch 1 MNT | head -3``: the reader is done
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except OSError as e:  # what no command foresaw (a path too long for the kernel, say): one line, not a traceback
        name = str(e.filename) if e.filename is not None else ""
        if len(name) > 100:
            name = f"{name[:60]}...({len(name)} bytes)"
        print(f"mithrilfs: error: {name + ': ' if name else ''}{e.strerror or e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
