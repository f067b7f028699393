"""The FUSE kernel protocol on /dev/fuse: mounting, the request loop, typed requests and replies.

``mount()`` attaches a session to a directory, ``Session`` serves an
``Operations`` object on it, and ``api`` holds the values the two exchange.
Nothing here knows about the store: it is the layer go-fuse and fuser call
the raw bridge.
"""

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
from .notify import Notifier
from .request_times import RequestTimes
from .session import ProtocolError, Session, SessionParameters
from .transport import URING_VARIABLE

__all__ = ["RENAME_EXCHANGE", "RENAME_NOREPLACE", "AfterReply", "DirBuffer", "EntryAttributes", "FileInfo", "FUSEError",
           "FuseMount", "MountError", "Notifier", "Operations", "ProtocolError", "RequestContext", "RequestTimes", "Session", "SessionParameters", "SetattrFields",
           "StatvfsData", "mount", "URING_VARIABLE", "BackingFiles", "PASSTHROUGH"]
