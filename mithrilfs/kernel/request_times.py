"""Requests answered and the daemon's time on them, by opcode (``stats`` -> ``requests``)."""

from __future__ import annotations

from collections.abc import Callable

from . import abi

#: Where ``RequestTimes`` counts the work handlers left for after their reply (no opcode is negative).
AFTER_REPLY = -1
#: Each opcode's name, and ``AFTER_REPLY``'s.
OPCODE_LABELS = {**abi.OPCODE_NAMES, AFTER_REPLY: "AFTER_REPLY"}


class RequestTimes:
    """Requests answered and nanoseconds spent on them (decode, handler, reply), by opcode.

    Kept by the session because only it sees every request (the IOCTL the
    kernel forwards for every ``isatty()``, the ones answered ENOSYS);
    ``stats`` and ``scripts/bench/bench_warmstart.py`` read it to show where a
    load's time goes.
    """

    def __init__(self) -> None:
        self.by_opcode: dict[int, list[int]] = {}
        #: Which transport serves the requests (the session sets it: ``Session.describe_transport``).
        self.transport: Callable[[], str] = lambda: "/dev/fuse read/write"

    def record(self, opcode: int, ns: int) -> None:
        entry = self.by_opcode.get(opcode)
        if entry is None:
            entry = self.by_opcode[opcode] = [0, 0]
        entry[0] += 1
        entry[1] += ns

    def clear(self) -> None:
        self.by_opcode.clear()

    def by_name(self) -> dict[str, dict[str, float]]:
        """Most time first: ``{"LOOKUP": {"count": n, "seconds": s, "us_each": u}, ...}``."""
        return {OPCODE_LABELS.get(op, str(op)):
                {"count": n, "seconds": round(ns / 1e9, 6), "us_each": round(ns / n / 1000, 2) if n else 0.0}
                for op, (n, ns) in sorted(self.by_opcode.items(), key=lambda kv: -kv[1][1])}
