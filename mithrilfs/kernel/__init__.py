"""The FUSE kernel protocol on /dev/fuse: mounting, the request loop, typed requests and replies.

``mount()`` attaches a session to a directory, ``Session`` serves an
``Operations`` object on it, and ``api`` holds the values the two exchange.
Nothing here knows about the store: it is the layer go-fuse and fuser call
the raw bridge.

The request loop and its io_uring transport (``Session``, ``ProtocolError``,
``URING_VARIABLE``) load on first use: they pull in trio, which a process
that only unmounts, probes a mount point or keeps one alive (the command
line's other commands, the supervisor) never needs.
"""

import importlib
from typing import TYPE_CHECKING, Any

from .abi import PASSTHROUGH
from .after_reply import AfterReply
from .api import (
                  RENAME_EXCHANGE,
                  RENAME_NOREPLACE,
                  DirBuffer,
                  EntryAttributes,
                  FileInfo,
                  FUSEError,
                  Operations,
                  RequestContext,
                  SetattrFields,
                  StatvfsData,
)
from .backing import BackingFiles
from .mount import FuseMount, MountError, mount
from .negotiate import SessionParameters
from .notify import Notifier
from .request_times import RequestTimes

if TYPE_CHECKING:
    from .session import ProtocolError, Session
    from .transport import URING_VARIABLE

#: The names loaded on first use, and their modules.
_LAZY = {"Session": ".session", "ProtocolError": ".session", "URING_VARIABLE": ".transport"}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(module, __name__), name)
    globals()[name] = value
    return value

__all__ = ["RENAME_EXCHANGE", "RENAME_NOREPLACE", "AfterReply", "DirBuffer", "EntryAttributes", "FileInfo", "FUSEError",
           "FuseMount", "MountError", "Notifier", "Operations", "ProtocolError", "RequestContext", "RequestTimes", "Session", "SessionParameters", "SetattrFields",
           "StatvfsData", "mount", "URING_VARIABLE", "BackingFiles", "PASSTHROUGH"]
