"""How a task serving requests waits for the next one, and how long it keeps the loop.

After answering, a serving task (the /dev/fuse reader, ``Session._next_request``; the ring's worker,
``transport.UringTransport``) polls for the next request a moment before it sleeps: a client's next
request (its read after a lookup, its next open) comes within microseconds, and one caught awake costs
the daemon no sleep and wake-up (docs/benchmarks.md: the poll's length in "G", over io_uring in
"N-uring").  Polling keeps the trio loop, so a serving task yields to the loop's other tasks every ``YIELD_EVERY``
requests served back to back.
"""

from __future__ import annotations

import time
from collections.abc import Callable

#: How long a serving task polls for the next request after answering, before it sleeps.
SPIN_SECONDS = 200e-6
#: Requests served back to back before a serving task yields to the loop's other tasks.
YIELD_EVERY = 8


class Polling:
    """Whether and until when to poll; ``polled`` counts the waits that began by polling."""

    def __init__(self, polls: Callable[[], bool] = lambda: True) -> None:
        """*polls*: whether to poll now (default always): the daemon says no while it streams a prefetch
        on the same cores (``Tier.streaming``), where a core polling is one the prefetch, its writing
        process and the workload itself wait for (docs/benchmarks.md, "K")."""
        self.polls = polls
        self.polled = 0

    def deadline(self) -> float:
        """Until when (``time.perf_counter``) to poll for the next request before sleeping; 0: sleep at once."""
        if not self.polls():
            return 0.0
        self.polled += 1
        return time.perf_counter() + SPIN_SECONDS
