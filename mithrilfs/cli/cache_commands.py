"""``stats``, ``why``, ``gc`` and ``clear``: what a mount's cache holds and does, and making room in it.

Each asks the mount's daemon through its control files (``cli.client``);
``why --store`` reads a store's event log without a mount.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

from mithrilfs.cli.client import (
    control_command,
    control_file,
    progress_bar,
    read_json,
    read_stats,
    while_drawing,
)
from mithrilfs.cli.store_commands import existing_store
from mithrilfs.errors import MountError, UsageError
from mithrilfs.units import format_size


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
        store = existing_store(args.store)
    under = None
    if args.path is not None:
        # through a mount, PATH is relative to it or absolute inside it; with --store, relative to the store's root
        under = str(args.path) if mount is None else os.path.relpath(mount / args.path, mount)
        if under == ".." or under.startswith("../"):
            raise UsageError(f"{args.path} is not inside {mount}")
        under = "" if under == "." else under
    if not os.access(store, os.R_OK | os.X_OK):
        raise MountError(f"cannot read the events of {store}: permission denied")
    groups = why.report(store, mount, under)
    if args.json:
        # the counters come from the mount's stats; without a mount, the events alone
        kept = None if counters is None else {k: counters.get(k, 0) for k in (
            "identical_recompiles", "identical_recompile_bytes", "fleet_identical_recompiles")}
        print(json.dumps({"store": str(store), "counters": kept, "entries": groups}, sort_keys=True))
    else:
        print(why.format_report(groups, counters))
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


#: Each command's function, by the name the parser gives it.
COMMANDS = {"stats": _cmd_stats, "why": _cmd_why, "gc": _cmd_gc, "clear": _cmd_clear}
