"""The commands of the control directory: what ``gc``, ``clear``, ``stats --zero``, ``config``,
``push``, ``prefetch``, ``forget --fleet`` and ``run`` ask a live mount to do.

Each is a file of ``MOUNT/.mithrilfs/`` (``files``): what is written runs
the command, its JSON answer is what the file reads back.  Commands change
the mount, so they are files its owner writes; what only reads (bytes per
top-level directory, ``usage.json``) anyone who sees the mount may read.
The collaborators are passed in; the commands only translate.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import time
from typing import Any

import trio

from mithrilfs import settings
from mithrilfs.cache.budget import Budget
from mithrilfs.cache.writepath import WritePath
from mithrilfs.control.files import ControlFiles
from mithrilfs.crash_points import crash_point
from mithrilfs.kernel import FUSEError
from mithrilfs.observe.stats import KeptCounters
from mithrilfs.shared.tier import Tier
from mithrilfs.store import reports
from mithrilfs.store.namespace import DirPaths
from mithrilfs.store.open import Store, StoreError
from mithrilfs.units import parse_size


def answer(doc: dict[str, Any]) -> bytes:
    """A command's answer: one JSON document."""
    return (json.dumps(doc) + "\n").encode()


class Commands:
    def __init__(self, store: Store, budget: Budget, writes: WritePath, tier: Tier, kept: KeptCounters,
                 paths: DirPaths, limiter: trio.CapacityLimiter, *, fixed_settings: frozenset[str]) -> None:
        self.store = store
        self.budget = budget
        self.policy = budget.policy
        self.writes = writes
        self.tier = tier
        self.kept = kept
        self.paths = paths
        self._limiter = limiter
        #: Settings given on the mount's command line: ``config`` changes to them wait for the next mount.
        self.fixed_settings = fixed_settings

    def register(self, control: ControlFiles) -> None:
        commands = [(b"gc", self.gc), (b"commit", self.commit), (b"clear", self.clear), (b"zero", self.zero),
                    (b"usage", self.usage_command), (b"settings", self.apply_settings)]
        if self.tier.shared:  # without a tier the files are absent: the CLI says "mounted without --remote"
            commands += [(b"push", self.push), (b"prefetch", self.prefetch), (b"forget", self.forget)]
        for name, run in commands:
            control.add_command(name, run)
        control.add_json_async(b"usage.json", self.usage)

    async def gc(self, request: bytes) -> bytes:
        """``gc``: evict now, down to ``to=SIZE`` (default: the low watermark)."""
        args = dict(part.split("=", 1) for part in request.decode(errors="replace").split() if "=" in part)
        try:
            target = parse_size(args["to"]) if "to" in args else self.policy.low_bytes
        except ValueError:
            raise FUSEError(errno.EINVAL) from None
        idle_before = None
        if self.policy.idle_ttl:
            idle_before = time.time_ns() - int(self.policy.idle_ttl * 1e9)
        result = await self.budget.evictor.run(target, reason="gc", idle_before_ns=idle_before)
        return answer(result.as_dict() | {"physical_bytes": self.budget.physical(), "max_bytes": self.policy.max_bytes})

    async def clear(self, request: bytes) -> bytes:
        """``clear`` (ccache -C): evict every file not being written, now, however young.

        Files a process holds open keep their content until closed; their
        names go like the rest.  Nothing is published: the shared tier keeps them.
        """
        result = await self.budget.evictor.run(0, reason="clear", everything=True)
        return answer(result.as_dict() | {"physical_bytes": self.budget.physical(), "max_bytes": self.policy.max_bytes})

    async def apply_settings(self, request: bytes) -> bytes:
        """``settings``: apply the store's settings now (``mithrilfs config`` on a mounted store).

        Settings fixed on the mount's command line keep their values.  A
        smaller budget evicts at once.
        """
        try:
            stored = settings.load(self.store.root)
            fixed = {k: getattr(self.policy, settings.SETTINGS[k][0]) for k in self.fixed_settings}
            new = settings.policy(stored, fixed)
        except (StoreError, ValueError) as e:
            return answer({"error": str(e)})
        for f in dataclasses.fields(new):
            setattr(self.policy, f.name, getattr(new, f.name))
        self.budget.evictor.notify_growth()
        return answer({"applied": True, "kept": sorted(self.fixed_settings)})

    async def zero(self, request: bytes) -> bytes:
        """``zero`` (``stats --zero``, ccache -z): every counter starts over, kept ones too."""
        self.kept.stats.zero()
        self.kept.save()
        return answer({"zeroed_at": self.kept.stats.since})

    async def usage_command(self, request: bytes) -> bytes:
        """``usage``: ``top=N`` answers ``usage.json`` and the N largest files (``stats --top N``)."""
        text = request.decode(errors="replace").strip().removeprefix("top=")
        return answer(await self.usage(int(text) if text.isdigit() else 0))

    async def usage(self, limit: int = 0) -> dict[str, Any]:
        """Bytes and files per top-level directory (``usage.json``, readable by anyone who sees the mount),
        and the *limit* largest files; the scans run on a reader in a thread."""
        self.store.ns.commit_deferred()  # the reader sees committed rows only
        reader = self.store.ns.reader()
        try:
            by_top, largest = await trio.to_thread.run_sync(
                lambda: (reports.usage_by_top(reader), reports.largest_files(reader, min(limit, 10_000))), limiter=self._limiter)
        finally:
            reader.close()
        return {
            "by_top": [{"name": top, "files": n, "bytes": size, "stored_bytes": stored}
                       for top, n, size, stored in by_top],
            "largest": [{"path": self.paths.of_name(parent, name), "bytes": size} for parent, name, size in largest],
        }

    async def commit(self, request: bytes) -> bytes:
        """``commit``: commit every written file now, unconfirmed (``mithrilfs run`` at its end)."""
        return answer({"committed": await self._commit_written()})

    async def _commit_written(self) -> int:
        """Commit every written file now, unconfirmed; how many were."""
        written = len(self.writes.staged)
        if not self.store.read_only:
            await self.writes.commit_all()
        return written - len(self.writes.staged)

    async def push(self, request: bytes) -> bytes:
        """``push``: commit every written file (one closed a moment ago waits for the idle timer, and the
        uploader never sends a file with nothing committed), then queue every file for upload; the CLI
        follows ``upload_queue`` in stats until it is empty, when the tier holds them all."""
        await self._commit_written()
        return answer(await self.tier.push())

    async def forget(self, request: bytes) -> bytes:
        """``forget --fleet``: a JSON list of paths (from the mount's root) to remove from every node."""
        try:
            paths = json.loads(request.decode(errors="surrogateescape"))
        except (ValueError, RecursionError):
            paths = None
        if not isinstance(paths, list) or not all(isinstance(p, str) for p in paths):
            return answer({"error": "the request is not a JSON list of paths"})
        return answer(await self.tier.forget_fleet(paths))

    async def prefetch(self, request: bytes) -> bytes:
        """``prefetch``: ``set=NAME`` or ``all`` starts a prefetch, or joins the same one running; ``stats``
        shows its progress."""
        crash_point("prefetch_command")  # the tests': a daemon killed with this request read, not answered
        text = request.decode(errors="replace").strip()
        return answer(await self.tier.start_prefetch(None if text == "all" else text.removeprefix("set=")))
