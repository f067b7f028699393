"""JIT caches written outside the mount: what ``run`` and ``status`` report.

A tool that ignores its variable (vLLM points Inductor at a root of its
own; a release renamed its variable; a launcher cleared the environment)
writes where it always did, and the mount silently misses that cache.  The
catalog's default locations are measured before and after; a location that
grew is named with the variable that captures it.  A measure stops at
``MAX_ENTRIES`` entries per location and never follows links (the headers'
link points into the mount itself).
"""

from __future__ import annotations

import contextlib
import json
import os
from pathlib import Path

from mithrilfs.jitcaches.catalog import CATALOG, JitCache, expand
from mithrilfs.units import format_size

__all__ = ["Leak", "as_json", "describe", "grown", "measure", "save_at_mount", "since_mount"]

#: Entries walked per location at most: a measure must not take longer than the command it reports on.
MAX_ENTRIES = 100_000

#: (location, bytes it grew by, the catalog entry whose default it is)
Leak = tuple[str, int, JitCache]


def _locations(env: dict[str, str]) -> dict[str, JitCache]:
    return {str(expand(t, env)): c for c in CATALOG for t in c.defaults}


def _size(root: Path) -> int:
    """Bytes of the regular files under *root*, links not followed; -1 when it is no directory."""
    if root.is_symlink() or not root.is_dir():
        return -1
    total, seen, stack = 0, 0, [str(root)]
    while stack and seen < MAX_ENTRIES:
        try:
            with os.scandir(stack.pop()) as it:
                for e in it:
                    seen += 1
                    try:
                        if e.is_dir(follow_symlinks=False):
                            stack.append(e.path)
                        elif e.is_file(follow_symlinks=False):
                            total += e.stat(follow_symlinks=False).st_size
                    except OSError:
                        continue
        except OSError:
            continue
    return total


def measure(env: dict[str, str]) -> dict[str, int]:
    """Bytes in each of the catalog's default locations for a process given *env* (-1: absent)."""
    return {path: _size(Path(path)) for path in _locations(env)}


def grown(before: dict[str, int], after: dict[str, int], env: dict[str, str]) -> list[Leak]:
    """The locations that grew, by how much, with their catalog entry.  A location inside another
    (the headers inside Inductor's default directory) is taken out of the outer one's growth."""
    where = _locations(env)
    growth = {p: size - max(before.get(p, -1), 0) for p, size in after.items() if p in where}
    for inner, g in list(growth.items()):
        for outer in growth:
            if g > 0 and inner.startswith(outer + os.sep):
                growth[outer] -= g
    return [(p, g, where[p]) for p, g in growth.items() if g > 0]


def as_json(leak: Leak) -> dict[str, object]:
    path, grew, cache = leak
    return {"path": path, "bytes": grew, "tool": cache.tool, "variables": list(cache.variables)}


def describe(leak: Leak) -> str:
    """One line for a leak: how much, of what, where, and what captures it."""
    path, grew, cache = leak
    how = (f"{cache.variables[0]} captures it (mithrilfs env sets it)" if cache.variables
           else "mithrilfs env links it into the mount unless a real directory is already there")
    return f"{format_size(grew)} of {cache.tool}'s cache written outside the mount, in {path}: {how}"


#: Where ``mount`` keeps what the catalog's default locations held when it mounted (``status`` compares).
AT_MOUNT = "outside-at-mount.json"


def save_at_mount(store: Path, measured: dict[str, int]) -> None:
    """Keep *measured* (taken just before the mount) in the store, private to its owner."""
    tmp = store / f".{AT_MOUNT}.{os.getpid()}"
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(measured, f)
        tmp.replace(store / AT_MOUNT)
    except OSError:  # a read-only store: status just cannot say it
        with contextlib.suppress(OSError):
            tmp.unlink()


def since_mount(store: Path, env: dict[str, str]) -> list[Leak]:
    """What grew outside the mount since it was mounted; nothing when that is not known (a mount made
    in the foreground, by another user, or on another machine: ``run`` reports those itself)."""
    try:
        with open(store / AT_MOUNT) as f:
            before = json.load(f)
    except (OSError, ValueError):
        return []
    if not isinstance(before, dict) or not all(isinstance(v, int) for v in before.values()):
        return []
    return grown(before, measure(env), env)
