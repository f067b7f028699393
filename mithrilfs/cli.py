"""Command line: argument parsing, one-line errors, exit codes.

User mistakes end with one line on stderr and exit status 2 (bad usage) or
1 (the operation failed); never a traceback.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import NoReturn, Sequence

from . import daemon
from .store import StoreError, default_store


class _Parser(argparse.ArgumentParser):
    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {message}\n")


def _build_parser() -> argparse.ArgumentParser:
    p = _Parser(prog="mithrilfs", description="A deduplicating, evicting FUSE compile cache.")
    sub = p.add_subparsers(dest="command", required=True, parser_class=_Parser, metavar="COMMAND")

    m = sub.add_parser("mount", help="mount the cache filesystem")
    m.add_argument("mountpoint", type=Path)
    m.add_argument("--store", type=Path, default=None, help=f"store directory (default {default_store()})")
    m.add_argument("--foreground", "-f", action="store_true", help="stay attached (for containers)")
    m.add_argument("--allow-other", action="store_true", help="let other users see the mount")
    m.add_argument("--debug", action="store_true", help="log every FUSE request")

    u = sub.add_parser("umount", aliases=["unmount"], help="flush, unmount and wait for the daemon")
    u.add_argument("mountpoint", type=Path)
    return p


def _cmd_mount(args: argparse.Namespace) -> int:
    store = (args.store or default_store()).expanduser().absolute()
    opts = daemon.MountOptions(
        mountpoint=args.mountpoint.expanduser().absolute(),
        store=store,
        foreground=args.foreground,
        allow_other=args.allow_other,
        debug=args.debug,
    )
    return daemon.mount(opts)


def _cmd_umount(args: argparse.Namespace) -> int:
    daemon.umount(args.mountpoint.expanduser().absolute())
    return 0


_COMMANDS = {"mount": _cmd_mount, "umount": _cmd_umount, "unmount": _cmd_umount}


def main(argv: Sequence[str] | None = None) -> int:
    args = _build_parser().parse_args(argv)
    try:
        return _COMMANDS[args.command](args)
    except (daemon.MountError, StoreError) as e:
        print(f"mithrilfs: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130


if __name__ == "__main__":
    sys.exit(main())
