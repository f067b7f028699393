"""The command line's grammar: commands, options, and the types that check them (one line each, exit 2)."""

from __future__ import annotations

import argparse
from pathlib import Path
from typing import Any, NoReturn

from mithrilfs.store.open import default_store
from mithrilfs.units import SIZE_HELP, parse_duration, parse_size


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


class _Removed(argparse.Action):
    """An option that no longer exists: one line saying why, rather than argparse's "unrecognized"."""

    def __call__(self, parser: argparse.ArgumentParser, namespace: argparse.Namespace, values: Any,
                 option_string: str | None = None) -> None:
        parser.error(f"{option_string} was removed: it could lose in-place writes (docs/design.md)")


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


def _positive_duration(text: str) -> float:
    """A wait that can end well: 0 would give up before anything could answer."""
    value = _duration(text)
    if value <= 0:
        raise argparse.ArgumentTypeError(f"must be more than 0 seconds: {text!r}")
    return value


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
    from mithrilfs.shared.stores.connect import check_url

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


def given_settings(args: argparse.Namespace) -> dict[str, Any]:
    return {name: getattr(args, name) for name, *_ in _SETTING_OPTIONS if getattr(args, name) is not None}


def build_parser() -> argparse.ArgumentParser:
    from mithrilfs import __version__

    p = _Parser(prog="mithrilfs", description="A deduplicating, evicting FUSE compile cache.")
    p.add_argument("--version", action="version", version=f"mithrilfs {__version__}")
    sub = p.add_subparsers(dest="command", parser_class=_Parser, metavar="COMMAND")

    m = sub.add_parser("mount", help="mount the cache filesystem")
    m.add_argument("mountpoint", type=Path)
    m.add_argument("--store", type=Path, default=None, help=f"store directory (default {default_store()})")
    m.add_argument("--foreground", "-f", action="store_true", help="stay attached (for containers)")
    m.add_argument("--nonempty", action="store_true", help="mount over a directory that holds files (hiding them)")
    m.add_argument("--on-crash", choices=("takeover", "detach"), default="takeover",
                   help="if the daemon dies: a new one takes the live mount over (default; programs see a pause),"
                        " or the mount is detached (programs get ENOTCONN)")
    m.add_argument("--push-on-lookup", action=_Removed, nargs=0, help=argparse.SUPPRESS,
                   default=argparse.SUPPRESS)
    m.add_argument("--allow-other", action="store_true", help="let other users see the mount")
    m.add_argument("--debug", action="store_true", help="log every FUSE request")
    m.add_argument("--passthrough", choices=("on", "off"), default="off",
                   help="on: the kernel reads and maps committed files of 1 MiB or more straight from the"
                        " store's disk (FUSE passthrough; needs root), at the price of a round trip at every"
                        " open of any file; for mounts of large files (weights, big libraries). Default off")
    _add_settings(m, "the store's setting ('mithrilfs config'), else ")
    m.add_argument("--metrics-port", type=_port, default=None, metavar="PORT",
                   help="serve Prometheus metrics on 127.0.0.1:PORT/metrics")
    m.add_argument("--remote", type=_remote_url, action="append", default=None, metavar="URL",
                   help="share the cache through Redis (redis://host:port/db or rediss://...; the password"
                        " from --remote-password-file or $MITHRILFS_REMOTE_PASSWORD) or an S3-compatible bucket"
                        " (s3://BUCKET/PREFIX; credentials and region from the AWS_* variables or profile);"
                        " twice for Redis in front of a bucket")
    m.add_argument("--remote-endpoint", default=None, metavar="URL",
                   help="the S3 endpoint of a server that is not AWS (SeaweedFS, MinIO, R2...);"
                        " default $AWS_ENDPOINT_URL_S3, $AWS_ENDPOINT_URL or the profile's")
    m.add_argument("--remote-password-file", type=Path, default=None, metavar="FILE",
                   help="read the Redis password from FILE")
    m.add_argument("--remote-cluster", action="store_true",
                   help="URL names one node of a Redis Cluster")
    m.add_argument("--remote-owner", type=_owner, default=None, metavar="UID:GID",
                   help="owner of files that come from the shared tier (default: the mount root's)")
    m.add_argument("--startup-set", type=_set_name, default="default", metavar="NAME",
                   help="record what the workload reads in its first minutes into this shared set (default 'default')")
    m.add_argument("--prefetch", type=_set_name, nargs="?", const="", default=None, metavar="NAME",
                   help="before returning, fetch a startup set from the shared tier (default: --startup-set's);"
                        " without it, --startup-set's is fetched in the background")
    m.add_argument("--no-prefetch", action="store_true",
                   help="do not fetch the startup set in the background at mount (files come at their first read)")
    m.add_argument("--remote-namespace", default="default", metavar="NAME",
                   help="nodes sharing a namespace share one tree (default 'default')")
    m.add_argument("--remote-key-file", type=Path, default=None, metavar="FILE",
                   help="sign entries with this key; entries without a valid signature are ignored")

    u = sub.add_parser("umount", aliases=["unmount"], help="flush, unmount and wait for the daemon")
    u.add_argument("mountpoint", type=Path)
    u.add_argument("--lazy", action="store_true",
                   help="detach now even if files are in use; the daemon exits once they are closed")

    r = sub.add_parser("restart", aliases=["reload"],
                       help="hand the live mount to a new daemon of the installed code (upgrades; programs see a pause)")
    r.add_argument("mountpoint", type=Path)
    r.add_argument("--timeout", type=_positive_duration, default=60.0, metavar="SECONDS",
                   help="how long to wait for the new daemon (default 60)")

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

    fg = sub.add_parser("forget", help="remove names (a cache entry: a directory and everything under it) from"
                                       " every node of the fleet")
    fg.add_argument("--fleet", action="store_true", help="from every node sharing the tier (required)")
    fg.add_argument("mountpoint", type=Path)
    fg.add_argument("paths", nargs="+", metavar="PATH", help="inside the mount: absolute, or relative to it")

    s = sub.add_parser("stats", help="hits, misses, bytes, dedup and latency of a mount")
    s.add_argument("mountpoint", type=Path)
    s.add_argument("--json", action="store_true", help="print the JSON document")
    s.add_argument("--watch", type=_duration, default=None, metavar="SECONDS", help="refresh every SECONDS")
    s.add_argument("--top", type=_count, default=None, metavar="N", help="also list the N largest files")
    s.add_argument("--zero", action="store_true",
                   help="set every counter to zero, those kept over remounts too (ccache -z)")

    w = sub.add_parser("why", help="identical recompiles: output the cache already had, written under a new key")
    w.add_argument("mountpoint", type=Path, nargs="?", default=None, metavar="MOUNTPOINT")
    w.add_argument("path", type=Path, nargs="?", default=None, metavar="PATH",
                   help="only cache entries at or under this path (in the mount)")
    w.add_argument("--store", type=Path, default=None, help="read an unmounted store's events instead")
    w.add_argument("--json", action="store_true", help="print the report as JSON")

    st = sub.add_parser("status", help="exit 0 when the mount is live (health probe): a line for it, one for how the "
                        "kernel's requests are served (transport, passthrough), then one per shared-tier level")
    st.add_argument("mountpoint", type=Path)
    st.add_argument("--ready", action="store_true",
                    help="also exit 1 while a prefetch runs (a startup probe that holds the app back)")
    st.add_argument("--json", action="store_true", help="print the state as JSON")

    e = sub.add_parser("env", help="print the shell lines that put every JIT cache of the stack on the mount "
                                   '(eval "$(mithrilfs env MOUNT)")')
    e.add_argument("mountpoint", type=Path, nargs="?", default=None)
    e.add_argument("--list", action="store_true", help="print what is covered, where, and how, instead")

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

    fl = sub.add_parser("fleet", help="the shared tier itself: its budget (fleet gc)")
    fleet = fl.add_subparsers(dest="fleet_command", parser_class=_Parser, metavar="COMMAND", required=True)
    fg = fleet.add_parser("gc", help="delete what the fleet has not used for longest, then the blobs nothing names",
                          description="Deletes cache entries (directories) unused longer than --max-age, then the "
                                      "least recently used until the rest fits --max-size, then the blobs no name "
                                      "references. Same remote settings and secrets as mount. Exit status: 0 done, "
                                      "1 the tier failed, 2 bad usage.")
    fg.add_argument("--remote", type=_remote_url, action="append", required=True, metavar="URL",
                    help="the shared tier, as given to mount (twice for Redis in front of a bucket)")
    fg.add_argument("--remote-endpoint", default=None, metavar="URL", help="as for mount")
    fg.add_argument("--remote-password-file", type=Path, default=None, metavar="FILE", help="as for mount")
    fg.add_argument("--remote-cluster", action="store_true", help="as for mount")
    fg.add_argument("--remote-namespace", default="default", metavar="NAME", help="as for mount (default 'default')")
    fg.add_argument("--remote-key-file", type=Path, default=None, metavar="FILE",
                    help="as for mount: signs the directory entries gc puts back")
    fg.add_argument("--max-size", type=_size, default=None, metavar="SIZE",
                    help="bytes the names may reference after the run: 500G, 2T... " + SIZE_HELP)
    fg.add_argument("--max-age", type=_positive_duration, default=None, metavar="DURATION",
                    help="delete cache entries unused for longer: 7d, 12h...")
    fg.add_argument("--grace", type=_positive_duration, default=None, metavar="DURATION",
                    help="never delete a blob written more recently (default and minimum: what writers assume, 7h)")
    fg.add_argument("--dry-run", action="store_true", help="print what it would delete; delete nothing")
    fg.add_argument("--json", action="store_true", help="print the result as JSON")

    f = sub.add_parser(
        "fsck", help="verify a store (not mounted); --repair fixes what it finds",
        description="Exit status: 0 no problems, 1 problems repaired, 4 problems left, 8 could not check.",
    )
    f.add_argument("--store", type=Path, default=None, help=f"store directory (default {default_store()})")
    f.add_argument("--repair", action="store_true", help="quarantine corrupt blobs, fix the index")
    f.add_argument("--json", action="store_true", help="print the report as JSON")
    return p

