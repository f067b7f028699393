"""``fsck``, ``export`` and ``import``: commands on a store itself, unmounted (``export`` also from a mount).

They open the store themselves (``store.open``), so a mounted store is
refused with one line rather than opened twice.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from mithrilfs.cli.client import (
    control_file,
    progress_bar,
)
from mithrilfs.errors import MountError, UsageError
from mithrilfs.store.open import StoreError, default_store
from mithrilfs.terminal import shown

# fsck's exit statuses, as fsck(8): problems repaired, problems left, could not check
FSCK_REPAIRED, FSCK_UNREPAIRED, FSCK_OPERATIONAL_ERROR = 1, 4, 8


def _cmd_fsck(args: argparse.Namespace) -> int:
    from mithrilfs.store.open import open_store
    from mithrilfs.tools import fsck

    root = existing_store(args.store)
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
            store = open_store(existing_store(args.store))
            try:
                result = archive.export_store(store, partial, progress)
            finally:
                store.close()
        if args.mode is not None:
            os.chmod(partial, args.mode)
        os.rename(partial, args.file)
    except OSError as e:
        raise MountError(f"cannot write {args.file}: {e.strerror}") from None
    finally:
        partial.unlink(missing_ok=True)
    if args.json:
        print(json.dumps(result | {"file": str(args.file)}, sort_keys=True))
    else:
        print(f"exported {result['entries']:,} entries, {result['blobs']:,} blobs to {args.file}")
    return 0


def existing_store(path: Path | None) -> Path:
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


#: Each command's function, by the name the parser gives it.
COMMANDS = {"fsck": _cmd_fsck, "export": _cmd_export, "import": _cmd_import}
