"""The store's own disk failing while content comes in from the shared tier: never the tier's failure.

A blob streamed from the tier is written into the store as it arrives, from
inside the store's call; the stores turn any ``OSError`` there into a failure
of the remote level and back it off.  A full local disk is no failure of the
bucket: taken for one, it would back the level off and fail every file not
fetched yet.  So the file the stores write into (``StoreFile``) raises
``LocalWriteError`` instead, which no store catches, and the caller turns it
back into the ``OSError`` it was.

trio wraps what the tasks of a nursery raise in an ``ExceptionGroup``;
``cause`` finds the error inside, so a message names it ("No space left on
device"), never "Exceptions from Trio nursery".
"""

from __future__ import annotations

import errno
import io
from typing import Any

from mithrilfs.store.open import is_disk_full


class LocalWriteError(Exception):
    """Writing fetched bytes into the store failed; ``error`` is the ``OSError`` (ENOSPC: the disk is full).

    Not an ``OSError`` itself, on purpose: see the module's docstring.
    """

    def __init__(self, error: OSError) -> None:
        super().__init__(str(error))
        self.error = error


class StoreFile(io.BufferedWriter):
    """A staging file the wires stream a blob into: a write that fails is the store's (``LocalWriteError``)."""

    def __init__(self, fd: int) -> None:
        super().__init__(io.FileIO(fd, "wb"))

    def write(self, data: Any) -> int:
        try:
            return super().write(data)
        except OSError as e:
            raise LocalWriteError(e) from e

    def flush(self) -> None:
        try:
            super().flush()
        except OSError as e:
            raise LocalWriteError(e) from e


def cause(e: BaseException) -> BaseException:
    """The error inside (nested) exception groups: a full disk first, else the first one."""
    leaves = list(_leaves(e))
    return next((leaf for leaf in leaves if is_disk_full(leaf)), leaves[0] if leaves else e)


def _leaves(e: BaseException):
    if isinstance(e, BaseExceptionGroup):
        for inner in e.exceptions:
            yield from _leaves(inner)
    elif isinstance(e, LocalWriteError):
        yield e.error
    else:
        yield e


def disk_full_message(e: BaseException) -> str:
    """One line for a full store disk, naming ENOSPC (or EDQUOT) and what it means for the files."""
    code = errno.errorcode.get(getattr(e, "errno", None) or errno.ENOSPC, "ENOSPC")
    return f"the store's disk is full ({code}): files not fetched stay listed and are fetched when read"
