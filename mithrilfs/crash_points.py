"""Places where a crash-safety test kills the daemon: ``MITHRILFS_TEST_CRASH_AT=POINT:N``.

Crash-safety tests set the variable to SIGKILL the process the Nth time (1
when N is left out) it reaches POINT; unset, ``crash_point`` does nothing.
A module of its own, at the bottom of the layers: the write path, the
daemon, the shared tier's packs and gc and the control files all mark
points, and a command-line client that imports the control files must not
load the write path (and trio) to do so.
"""

from __future__ import annotations

import os
import signal

#: The variable a test sets (the supervisor and the upgrade check keep it from the processes it is not for).
VARIABLE = "MITHRILFS_TEST_CRASH_AT"
_CRASH_AT = os.environ.get(VARIABLE)
_crash_hits: dict[str, int] = {}


def crash_point(name: str) -> None:
    """SIGKILL this process if the test asked for a crash at *name* and this is its Nth visit."""
    if _CRASH_AT is None:
        return
    point, _, nth = _CRASH_AT.partition(":")
    if point == name:
        _crash_hits[name] = _crash_hits.get(name, 0) + 1
        if _crash_hits[name] >= int(nth or 1):
            os.kill(os.getpid(), signal.SIGKILL)
