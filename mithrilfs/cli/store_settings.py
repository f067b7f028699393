"""The store's settings: as the commands that mount read them, and ``config``, which shows or changes them.

The command line's settings go on top of the store's; ones that do not fit
together are a one-line error (exit 2) before anything changes.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

from mithrilfs.cache.policy import EvictionPolicy
from mithrilfs.cli.client import (
    control_command,
    control_file,
)
from mithrilfs.cli.parser import given_settings
from mithrilfs.daemon.mountpoint import probe_mount
from mithrilfs.errors import UsageError
from mithrilfs.store.open import StoreError, default_store
from mithrilfs.units import format_size


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
        if probe_mount(mp, timeout=5.0) == "live":
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
COMMANDS = {"config": _cmd_config}
