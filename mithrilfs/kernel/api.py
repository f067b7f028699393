"""What a filesystem built on ``kernel.Session`` implements, and the typed values it exchanges.

The session decodes each request from /dev/fuse and calls one coroutine of
an ``Operations`` object with plain arguments (inode numbers, names as
bytes, offsets); the coroutine returns a typed reply or raises
``FUSEError(errno)``.  A method left as the base class has it answers
ENOSYS, which the kernel remembers for most operations (xattrs, for
instance) and then stops sending.
"""

from __future__ import annotations

import errno
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from . import abi

RENAME_NOREPLACE = abi.RENAME_NOREPLACE
RENAME_EXCHANGE = abi.RENAME_EXCHANGE


class FUSEError(Exception):
    """Answer the request with this errno (no traceback is logged)."""

    __slots__ = ("errno",)

    def __init__(self, code: int) -> None:
        super().__init__(code)
        self.errno = code

    def __str__(self) -> str:
        return f"FUSEError({errno.errorcode.get(self.errno, self.errno)})"


@dataclass(slots=True)
class RequestContext:
    """Who asked: the caller's ids and, for requests that create, its umask.

    *resent*: the kernel sent it again (``NOTIFY_RESEND``) because the
    daemon that read it first died before answering; it may have done it.
    """

    uid: int = 0
    gid: int = 0
    pid: int = 0
    umask: int = 0
    resent: bool = False


class EntryAttributes:
    """Attributes of one inode, and how long the kernel may cache them (and its name).

    ``st_ino = 0`` in a lookup reply is a negative entry: the kernel caches
    "no such name" for ``entry_timeout`` seconds.
    """

    __slots__ = ("st_ino", "generation", "entry_timeout", "attr_timeout", "st_mode", "st_nlink", "st_uid",
                 "st_gid", "st_rdev", "st_size", "st_blksize", "st_blocks", "st_atime_ns", "st_mtime_ns",
                 "st_ctime_ns")

    def __init__(self) -> None:
        self.st_ino = 0
        self.generation = 0
        self.entry_timeout = 0.0
        self.attr_timeout = 0.0
        self.st_mode = 0
        self.st_nlink = 0
        self.st_uid = 0
        self.st_gid = 0
        self.st_rdev = 0
        self.st_size = 0
        self.st_blksize = 4096
        self.st_blocks = 0
        self.st_atime_ns = 0
        self.st_mtime_ns = 0
        self.st_ctime_ns = 0


@dataclass(slots=True)
class SetattrFields:
    """Which fields of a SETATTR request's attributes are to be changed."""

    update_mode: bool = False
    update_uid: bool = False
    update_gid: bool = False
    update_size: bool = False
    update_atime: bool = False
    update_mtime: bool = False
    update_ctime: bool = False


@dataclass(slots=True)
class FileInfo:
    """An open file handle and how the kernel should treat its pages.

    keep_cache: keep the page cache from earlier opens (content unchanged).
    noflush: the kernel sends no FLUSH at close (nothing to commit: read-only opens).
    direct_io: bypass the page cache (virtual files whose size is not known up front).
    backing_id: not 0: the kernel serves reads and mmap from this backing file (``kernel.BackingFiles``).
    """

    fh: int
    keep_cache: bool = False
    noflush: bool = False
    direct_io: bool = False
    backing_id: int = 0

    def open_flags(self) -> int:
        return ((abi.FOPEN_KEEP_CACHE if self.keep_cache else 0) | (abi.FOPEN_NOFLUSH if self.noflush else 0)
                | (abi.FOPEN_DIRECT_IO if self.direct_io else 0)
                | (abi.FOPEN_PASSTHROUGH if self.backing_id else 0))


@dataclass(slots=True)
class StatvfsData:
    f_bsize: int = 4096
    f_frsize: int = 4096
    f_blocks: int = 0
    f_bfree: int = 0
    f_bavail: int = 0
    f_files: int = 0
    f_ffree: int = 0
    f_favail: int = 0
    f_namemax: int = 255


class DirBuffer:
    """The reply to one READDIR/READDIRPLUS: entries are added until the kernel's buffer is full.

    With ``plus``, every entry added also counts as a lookup of its inode
    (the kernel will send FORGET for it), so a filesystem that counts
    lookups must count the entries ``add`` accepted.
    """

    __slots__ = ("plus", "_size", "_parts", "_used")

    def __init__(self, size: int, plus: bool) -> None:
        self.plus = plus
        self._size = size
        self._parts: list[bytes] = []
        self._used = 0

    def add(self, name: bytes, attr: EntryAttributes, next_offset: int) -> bool:
        """Append one entry; False (and nothing added) when it does not fit."""
        namelen = len(name)
        head = abi.DIRENT.size + (abi.ENTRY_OUT.size if self.plus else 0)
        reclen = (head + namelen + 7) & ~7
        if self._used + reclen > self._size:
            return False
        dirent = abi.DIRENT.pack(attr.st_ino, next_offset, namelen, (attr.st_mode >> 12) & 0o17)
        pad = b"\0" * (reclen - head - namelen)
        if self.plus:
            self._parts.append(pack_entry(attr) + dirent + name + pad)
        else:
            self._parts.append(dirent + name + pad)
        self._used += reclen
        return True

    def payload(self) -> bytes:
        return b"".join(self._parts)


def _split_timeout(t: float) -> tuple[int, int]:
    secs = int(t)
    return secs, int((t - secs) * 1e9)


def _attr_fields(a: EntryAttributes) -> tuple[int, ...]:
    at, atn = divmod(a.st_atime_ns, 1_000_000_000)
    mt, mtn = divmod(a.st_mtime_ns, 1_000_000_000)
    ct, ctn = divmod(a.st_ctime_ns, 1_000_000_000)
    return (a.st_ino, a.st_size, a.st_blocks, at, mt, ct, atn, mtn, ctn, a.st_mode, a.st_nlink, a.st_uid,
            a.st_gid, a.st_rdev, a.st_blksize, 0)


def pack_entry(a: EntryAttributes) -> bytes:
    """fuse_entry_out for a lookup-like reply (a negative entry when st_ino is 0)."""
    es, en = _split_timeout(a.entry_timeout)
    if a.st_ino == 0:
        return abi.ENTRY_OUT.pack(0, 0, es, 0, en, 0, *((0,) * 16))
    as_, an = _split_timeout(a.attr_timeout)
    return abi.ENTRY_OUT.pack(a.st_ino, a.generation, es, as_, en, an, *_attr_fields(a))


def pack_attr(a: EntryAttributes) -> bytes:
    """fuse_attr_out for GETATTR and SETATTR."""
    as_, an = _split_timeout(a.attr_timeout)
    return abi.ATTR_OUT.pack(as_, an, 0, *_attr_fields(a))


class Operations:
    """Base class: every request a filesystem does not answer gets ENOSYS.

    Handlers are coroutines run on the session's trio loop; one that awaits
    lets other requests in meanwhile.  ``ctx`` is a RequestContext.
    """

    async def init(self) -> None:
        """The kernel finished INIT: the mount is about to serve."""

    async def destroy(self) -> None:
        """The kernel is tearing the mount down."""

    async def lookup(self, parent: int, name: bytes, ctx: RequestContext) -> EntryAttributes:
        raise FUSEError(errno.ENOSYS)

    async def forget(self, inodes: Sequence[tuple[int, int]]) -> None:
        """The kernel dropped *n* references to each inode (no reply is sent)."""

    async def getattr(self, inode: int, ctx: RequestContext) -> EntryAttributes:
        raise FUSEError(errno.ENOSYS)

    async def setattr(self, inode: int, attr: EntryAttributes, fields: SetattrFields, fh: int | None,
                      ctx: RequestContext) -> EntryAttributes:
        raise FUSEError(errno.ENOSYS)

    async def readlink(self, inode: int, ctx: RequestContext) -> bytes:
        raise FUSEError(errno.ENOSYS)

    async def mknod(self, parent: int, name: bytes, mode: int, rdev: int, ctx: RequestContext) -> EntryAttributes:
        raise FUSEError(errno.ENOSYS)

    async def mkdir(self, parent: int, name: bytes, mode: int, ctx: RequestContext) -> EntryAttributes:
        raise FUSEError(errno.ENOSYS)

    async def symlink(self, parent: int, name: bytes, target: bytes, ctx: RequestContext) -> EntryAttributes:
        raise FUSEError(errno.ENOSYS)

    async def unlink(self, parent: int, name: bytes, ctx: RequestContext) -> None:
        raise FUSEError(errno.ENOSYS)

    async def rmdir(self, parent: int, name: bytes, ctx: RequestContext) -> None:
        raise FUSEError(errno.ENOSYS)

    async def rename(self, parent_old: int, name_old: bytes, parent_new: int, name_new: bytes, flags: int,
                     ctx: RequestContext) -> None:
        raise FUSEError(errno.ENOSYS)

    async def link(self, inode: int, new_parent: int, new_name: bytes, ctx: RequestContext) -> EntryAttributes:
        raise FUSEError(errno.ENOSYS)

    async def open(self, inode: int, flags: int, ctx: RequestContext) -> FileInfo:
        """ENOSYS here makes the kernel open every file itself from then on, and send no RELEASE."""
        raise FUSEError(errno.ENOSYS)

    async def create(self, parent: int, name: bytes, mode: int, flags: int,
                     ctx: RequestContext) -> tuple[FileInfo, EntryAttributes]:
        raise FUSEError(errno.ENOSYS)

    async def read(self, inode: int, fh: int, off: int, size: int) -> bytes | memoryview:
        raise FUSEError(errno.ENOSYS)

    async def write(self, inode: int, fh: int, off: int, buf: Any) -> int:
        """*buf* is a memoryview into the session's request buffer: use it before returning."""
        raise FUSEError(errno.ENOSYS)

    async def flush(self, inode: int, fh: int) -> None:
        """ENOSYS here makes the kernel stop sending FLUSH at every close."""
        raise FUSEError(errno.ENOSYS)

    async def release(self, inode: int, fh: int) -> None:
        pass

    async def fsync(self, inode: int, fh: int, datasync: bool) -> None:
        raise FUSEError(errno.ENOSYS)

    async def opendir(self, inode: int, ctx: RequestContext) -> int:
        raise FUSEError(errno.ENOSYS)

    async def readdir(self, fh: int, start_id: int, token: DirBuffer) -> None:
        raise FUSEError(errno.ENOSYS)

    async def releasedir(self, fh: int) -> None:
        pass

    async def fsyncdir(self, fh: int, datasync: bool) -> None:
        raise FUSEError(errno.ENOSYS)

    async def statfs(self, ctx: RequestContext) -> StatvfsData:
        raise FUSEError(errno.ENOSYS)
