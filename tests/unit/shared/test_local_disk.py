"""A full store disk while content comes from the shared tier: told apart from the tier's failures."""

from __future__ import annotations

import errno
import os
import sqlite3

import pytest
import trio

from mithrilfs.shared.stores.entries import RemoteError
from mithrilfs.shared.sync.local_disk import LocalWriteError, StoreFile, cause, disk_full_message


def test_a_write_the_disk_refuses_is_no_oserror_for_the_wires():
    """The wires count an OSError inside their call as the remote level failing: this one must pass them."""
    out = StoreFile(os.open("/dev/full", os.O_WRONLY))
    with pytest.raises(LocalWriteError) as raised:
        out.write(b"x" * (1 << 20))  # larger than the buffer: written through, refused at once
        out.flush()
    assert not isinstance(raised.value, OSError) and raised.value.error.errno == errno.ENOSPC
    out.close()
    out = StoreFile(os.open("/dev/full", os.O_WRONLY))
    out.write(b"x")  # buffered: the disk refuses it at the close
    with pytest.raises(LocalWriteError):
        out.close()


def test_cause_unwraps_a_nursery_and_prefers_a_full_disk():
    async def fail(e: BaseException) -> None:
        raise e

    async def both() -> None:
        async with trio.open_nursery() as nursery:
            nursery.start_soon(fail, RemoteError("the bucket said no"))
            nursery.start_soon(fail, LocalWriteError(OSError(errno.ENOSPC, "No space left on device")))

    with pytest.raises(BaseExceptionGroup) as group:
        trio.run(both)
    found = cause(group.value)
    assert isinstance(found, OSError) and found.errno == errno.ENOSPC
    assert cause(ExceptionGroup("x", [ExceptionGroup("y", [RemoteError("down")])])).args == ("down",)
    assert "(ENOSPC)" in disk_full_message(found)
    assert "(ENOSPC)" in disk_full_message(sqlite3.OperationalError("database or disk is full"))
    assert "(EDQUOT)" in disk_full_message(OSError(errno.EDQUOT, "Disk quota exceeded"))
