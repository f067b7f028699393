"""``forget --fleet MOUNT PATH...``: remove names from every node of the fleet (``shared.purge``)."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from mithrilfs.cli.client import tier_command
from mithrilfs.errors import UsageError
from mithrilfs.store.namespace import ROOT_INODE, servable, valid_name

#: A command's request is one write to its control file: kept well below one FUSE write.
MAX_REQUEST_BYTES = 60 << 10


def mount_relative(mp: Path, text: str) -> str:
    """*text* (absolute, or relative to the mount) as a path from the mount's root; UsageError naming the
    problem when it is outside the mount, the mount itself, or not a path a mount can hold."""
    raw = os.fsencode(text)
    full = os.path.normpath(raw if raw.startswith(b"/") else os.fsencode(mp) + b"/" + raw)
    root = os.fsencode(mp)
    if full == root:
        raise UsageError(f"{text!r} is the mount itself: name what to forget inside it")
    if not full.startswith(root + b"/"):
        raise UsageError(f"{text!r} is outside the mount {mp}")
    rel = full[len(root) + 1:]
    parts = rel.split(b"/")
    if not all(valid_name(p) for p in parts):
        raise UsageError(f"{text!r} is not a path a mount can hold")
    if not servable(ROOT_INODE, parts[0]):
        raise UsageError(f"{text!r} is in the mount's control directory")
    return os.fsdecode(rel)


def _cmd_forget(args: argparse.Namespace) -> int:
    if not args.fleet:
        raise UsageError("forget removes names from every node of the fleet: say --fleet"
                         " (to remove a name here only, rm it)")
    mp = args.mountpoint.expanduser().absolute()
    paths = sorted({mount_relative(mp, p) for p in args.paths})
    request = json.dumps(paths)
    if len(request.encode(errors="surrogateescape")) > MAX_REQUEST_BYTES:
        raise UsageError(f"too many paths at once ({len(paths)}): forget a directory above them, or split them")
    answer = tier_command(mp, "forget", request)
    if "error" in answer:
        print(f"mithrilfs: error: cannot forget: {answer['error']}", file=sys.stderr)
        return 1
    print(f"forgot {len(paths)} path(s) on every node: {answer['tombstones']} name(s) tombstoned"
          + ("" if answer.get("announced") else "; the change feed could not be written: other nodes drop them"
             " at their next listing"))
    return 0


COMMANDS = {"forget": _cmd_forget}
