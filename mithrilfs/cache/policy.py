"""How much a store keeps and for how long: the eviction policy's settings (``EvictionPolicy``).

The values a mount is given (``mount --max-size``, ``--min-age``, the
store's kept settings) and checks them; ``eviction`` applies them.  A
module of its own so that the command line reads and checks settings
without loading the evictor's machinery (trio).
"""

from __future__ import annotations

from dataclasses import dataclass

from mithrilfs.units import MAX_SIZE

GiB = 1 << 30


@dataclass
class EvictionPolicy:
    max_bytes: int = 10 * GiB
    #: Crossing high * max_bytes starts eviction down to low * max_bytes.
    high: float = 0.95
    low: float = 0.85
    #: Files changed more recently than this are never evicted (seconds).
    min_age: float = 5.0
    #: Units unused for this long are evicted even under budget (seconds).
    idle_ttl: float | None = None
    #: Never evict below this many units.
    min_entries: int = 0

    def __post_init__(self) -> None:
        if self.max_bytes <= 0:
            raise ValueError("the size budget must be positive")
        if self.max_bytes > MAX_SIZE:
            raise ValueError(f"the size budget must fit in 64 bits (at most {MAX_SIZE} bytes)")
        if not 0 < self.low <= self.high <= 1:
            raise ValueError("watermarks must satisfy 0 < low <= high <= 1")
        if self.min_age < 0 or (self.idle_ttl is not None and self.idle_ttl <= 0) or self.min_entries < 0:
            raise ValueError("min-age, idle-ttl and min-entries must not be negative")

    @property
    def high_bytes(self) -> int:
        return int(self.max_bytes * self.high)

    @property
    def low_bytes(self) -> int:
        return int(self.max_bytes * self.low)
