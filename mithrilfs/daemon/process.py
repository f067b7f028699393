"""Facts about processes that the daemon, its supervisor and the CLI share (a light module: the
supervisor imports nothing heavier).
"""

from __future__ import annotations

import logging
import resource
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)


def raise_fd_limit() -> None:
    """Raise this process's descriptor limit to its hard limit (best effort).

    The daemon and its supervisor hold a descriptor per file being written
    (a memfd mirror or a staging file, ``cache.staging``): thousands while
    a compile writes its cache, more than the usual soft limit of 1024.
    """
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError) as e:
            log.debug("cannot raise the descriptor limit: %s", e)


def pid_alive(pid: int) -> bool:
    """True while the main thread of *pid* runs (a zombie has exited, whatever its other threads do)."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] not in ("Z", "X")
    except (OSError, IndexError):
        return False


def start_time(pid: int) -> int | None:
    """When *pid* started (clock ticks since boot, ``/proc/PID/stat``), None when there is no such process:
    with the pid, it names one process, never a later one given the same pid."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def call_within(call: Callable[[], Any], seconds: float) -> Any:
    """*call*'s result, or None when it takes longer than *seconds*: for anything that may wait on a mount
    whose daemon does not answer (the thread is then left to itself)."""
    out: list[Any] = []
    worker = threading.Thread(target=lambda: out.append(call()), daemon=True)
    worker.start()
    worker.join(max(seconds, 0.0))
    return out[0] if out else None


def in_child(call: Callable[[], str]) -> str:
    """*call*'s one-line answer, computed in a forked child that exits after it.

    For a client that starts threads of its own (obstore's runtime): a
    process that later forks the daemon must never have run one, or the
    daemon inherits a runtime without its threads and hangs.
    """
    import os

    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 0
        try:
            os.close(read_end)
            answer = call()
        except BaseException as e:  # the child must exit whatever happened, and say what it was
            code = 1
            answer = f"{type(e).__name__}: {(str(e).splitlines() or [''])[0][:300]}"
        try:
            os.write(write_end, answer.encode(errors="replace")[:4096])
        finally:
            os._exit(code)
    os.close(write_end)
    with os.fdopen(read_end, "rb") as f:
        answer = f.read().decode(errors="replace")
    os.waitpid(pid, 0)
    return answer
