"""Each request's body decoded into a call of the filesystem, and its answer encoded for the kernel.

The session (``session``) owns the request loop: reading, the header,
errors, replies, INIT and interrupts.  What a request *means* is here:
which ``linux/fuse.h`` struct its body holds, which ``Operations`` method
it calls, and how the result is packed.  Kept apart so that the loop,
where a round trip's time goes, reads on one screen, and a new opcode is
one method and one table entry here.

A handler takes ``(nodeid, ctx, buf, view, off, end)``: the request's
inode, its caller, the read buffer (and a memoryview of it, for WRITE's
data without a copy), where the body starts and where the request ends.
Structs are unpacked from a buffer larger than the request; the session
has checked the body is at least ``abi.MIN_BODY`` long, and names are
looked for only up to *end* (``cstr``).

Resent requests (after a takeover, ``Session.adopt``): a create, mkdir,
mknod, symlink or link the previous daemon already carried out meets
EEXIST and is answered with the entry that is there (``_made``).
"""

from __future__ import annotations

import errno
import time
from collections.abc import Awaitable, Callable
from typing import Any

from . import abi
from .api import DirBuffer, EntryAttributes, FUSEError, Operations, RequestContext, SetattrFields, pack_attr, pack_entry

#: What a handler is: ``(nodeid, ctx, buf, view, off, end) -> payload`` (None: an empty reply, or none).
Handler = Callable[..., Awaitable[bytes | memoryview | None]]


class Malformed(Exception):
    """A request whose body does not hold what its opcode says (answered EIO)."""


def cstr(buf: Any, start: int, end: int) -> tuple[bytes, int]:
    """The NUL-terminated name at *start*; and where the next field begins."""
    i = buf.find(b"\0", start, end)
    if i < 0:
        raise Malformed("name without its terminating NUL")
    return bytes(buf[start:i]), i + 1


#: The method of ``Requests`` that serves each opcode (the session serves INIT, DESTROY and INTERRUPT).
_BY_OPCODE = {
    abi.LOOKUP: "lookup", abi.FORGET: "forget", abi.BATCH_FORGET: "batch_forget", abi.GETATTR: "getattr",
    abi.SETATTR: "setattr", abi.READLINK: "readlink", abi.SYMLINK: "symlink", abi.MKNOD: "mknod",
    abi.MKDIR: "mkdir", abi.UNLINK: "unlink", abi.RMDIR: "rmdir", abi.RENAME: "rename", abi.RENAME2: "rename2",
    abi.LINK: "link", abi.OPEN: "open", abi.READ: "read", abi.WRITE: "write", abi.STATFS: "statfs",
    abi.RELEASE: "release", abi.FSYNC: "fsync", abi.FLUSH: "flush", abi.OPENDIR: "opendir",
    abi.READDIR: "readdir", abi.READDIRPLUS: "readdirplus", abi.RELEASEDIR: "releasedir",
    abi.FSYNCDIR: "fsyncdir", abi.CREATE: "create",
}


class Requests:
    """The filesystem's requests: decode the body, call *ops*, encode the answer."""

    def __init__(self, ops: Operations) -> None:
        self.ops = ops

    def handlers(self) -> dict[int, Handler]:
        """Each opcode served here, with the bound method that serves it."""
        return {opcode: getattr(self, name) for opcode, name in _BY_OPCODE.items()}

    # ------------------------------------------------------------------
    # names
    # ------------------------------------------------------------------
    async def lookup(self, nodeid, ctx, buf, view, off, end) -> bytes:
        name, _ = cstr(buf, off, end)
        return pack_entry(await self.ops.lookup(nodeid, name, ctx))

    async def forget(self, nodeid, ctx, buf, view, off, end) -> None:
        (n,) = abi.FORGET_IN.unpack_from(buf, off)
        await self.ops.forget([(nodeid, n)])

    async def batch_forget(self, nodeid, ctx, buf, view, off, end) -> None:
        (count, _) = abi.BATCH_FORGET_IN.unpack_from(buf, off)
        off += abi.BATCH_FORGET_IN.size
        count = min(count, (end - off) // abi.FORGET_ONE.size)
        await self.ops.forget([abi.FORGET_ONE.unpack_from(buf, off + i * abi.FORGET_ONE.size) for i in range(count)])

    async def getattr(self, nodeid, ctx, buf, view, off, end) -> bytes:
        return pack_attr(await self.ops.getattr(nodeid, ctx))

    async def setattr(self, nodeid, ctx, buf, view, off, end) -> bytes:
        (valid, _, fh, size, _lock_owner, atime, mtime, ctime, atimensec, mtimensec, ctimensec, mode, _, uid, gid,
         _) = abi.SETATTR_IN.unpack_from(buf, off)
        attr = EntryAttributes()
        fields = SetattrFields()
        now = time.time_ns()
        if valid & abi.FATTR_MODE:
            fields.update_mode, attr.st_mode = True, mode
        if valid & abi.FATTR_UID:
            fields.update_uid, attr.st_uid = True, uid
        if valid & abi.FATTR_GID:
            fields.update_gid, attr.st_gid = True, gid
        if valid & abi.FATTR_SIZE:
            fields.update_size, attr.st_size = True, size
        if valid & (abi.FATTR_ATIME | abi.FATTR_ATIME_NOW):
            fields.update_atime = True
            attr.st_atime_ns = now if valid & abi.FATTR_ATIME_NOW else atime * 1_000_000_000 + atimensec
        if valid & (abi.FATTR_MTIME | abi.FATTR_MTIME_NOW):
            fields.update_mtime = True
            attr.st_mtime_ns = now if valid & abi.FATTR_MTIME_NOW else mtime * 1_000_000_000 + mtimensec
        if valid & abi.FATTR_CTIME:
            fields.update_ctime, attr.st_ctime_ns = True, ctime * 1_000_000_000 + ctimensec
        handle = fh if valid & abi.FATTR_FH else None
        return pack_attr(await self.ops.setattr(nodeid, attr, fields, handle, ctx))

    async def readlink(self, nodeid, ctx, buf, view, off, end) -> bytes:
        return await self.ops.readlink(nodeid, ctx)

    async def _made(self, nodeid: int, name: bytes, ctx: RequestContext,
                    make: Awaitable[EntryAttributes]) -> EntryAttributes:
        """The entry a request makes; for a resent one the previous daemon already made, the entry there."""
        try:
            return await make
        except FUSEError as e:
            if not (ctx.resent and e.errno == errno.EEXIST):
                raise
        return await self.ops.lookup(nodeid, name, ctx)

    async def symlink(self, nodeid, ctx, buf, view, off, end) -> bytes:
        name, off = cstr(buf, off, end)
        target, _ = cstr(buf, off, end)
        return pack_entry(await self._made(nodeid, name, ctx, self.ops.symlink(nodeid, name, target, ctx)))

    async def mknod(self, nodeid, ctx, buf, view, off, end) -> bytes:
        mode, rdev, umask, _ = abi.MKNOD_IN.unpack_from(buf, off)
        name, _ = cstr(buf, off + abi.MKNOD_IN.size, end)
        ctx.umask = umask
        return pack_entry(await self._made(nodeid, name, ctx, self.ops.mknod(nodeid, name, mode, rdev, ctx)))

    async def mkdir(self, nodeid, ctx, buf, view, off, end) -> bytes:
        mode, umask = abi.MKDIR_IN.unpack_from(buf, off)
        name, _ = cstr(buf, off + abi.MKDIR_IN.size, end)
        ctx.umask = umask
        return pack_entry(await self._made(nodeid, name, ctx, self.ops.mkdir(nodeid, name, mode, ctx)))

    async def unlink(self, nodeid, ctx, buf, view, off, end) -> None:
        name, _ = cstr(buf, off, end)
        await self.ops.unlink(nodeid, name, ctx)

    async def rmdir(self, nodeid, ctx, buf, view, off, end) -> None:
        name, _ = cstr(buf, off, end)
        await self.ops.rmdir(nodeid, name, ctx)

    async def rename(self, nodeid, ctx, buf, view, off, end) -> None:
        (newdir,) = abi.RENAME_IN.unpack_from(buf, off)
        old, off = cstr(buf, off + abi.RENAME_IN.size, end)
        new, _ = cstr(buf, off, end)
        await self.ops.rename(nodeid, old, newdir, new, 0, ctx)

    async def rename2(self, nodeid, ctx, buf, view, off, end) -> None:
        newdir, flags, _ = abi.RENAME2_IN.unpack_from(buf, off)
        old, off = cstr(buf, off + abi.RENAME2_IN.size, end)
        new, _ = cstr(buf, off, end)
        if flags & ~(abi.RENAME_NOREPLACE | abi.RENAME_EXCHANGE):
            raise FUSEError(errno.EINVAL)  # RENAME_WHITEOUT: no overlay upper layers here
        await self.ops.rename(nodeid, old, newdir, new, flags, ctx)

    async def link(self, nodeid, ctx, buf, view, off, end) -> bytes:
        (old,) = abi.LINK_IN.unpack_from(buf, off)
        name, _ = cstr(buf, off + abi.LINK_IN.size, end)
        return pack_entry(await self._made(nodeid, name, ctx, self.ops.link(old, nodeid, name, ctx)))

    # ------------------------------------------------------------------
    # files
    # ------------------------------------------------------------------
    async def open(self, nodeid, ctx, buf, view, off, end) -> bytes:
        flags, _ = abi.OPEN_IN.unpack_from(buf, off)
        fi = await self.ops.open(nodeid, flags, ctx)
        return abi.OPEN_OUT.pack(fi.fh, fi.open_flags(), fi.backing_id)

    async def create(self, nodeid, ctx, buf, view, off, end) -> bytes:
        flags, mode, umask, _ = abi.CREATE_IN.unpack_from(buf, off)
        name, _ = cstr(buf, off + abi.CREATE_IN.size, end)
        ctx.umask = umask
        try:
            fi, attr = await self.ops.create(nodeid, name, mode, flags, ctx)
        except FUSEError as e:
            if not (ctx.resent and e.errno == errno.EEXIST):
                raise
            # the previous daemon made it: the caller opens the file that is there
            return pack_entry(await self.ops.lookup(nodeid, name, ctx)) + abi.OPEN_OUT.pack(0, 0, 0)
        return pack_entry(attr) + abi.OPEN_OUT.pack(fi.fh, fi.open_flags(), fi.backing_id)

    async def read(self, nodeid, ctx, buf, view, off, end) -> bytes | memoryview:
        fh, offset, size, *_ = abi.READ_IN.unpack_from(buf, off)
        return await self.ops.read(nodeid, fh, offset, size)

    async def write(self, nodeid, ctx, buf, view, off, end) -> bytes:
        fh, offset, size, *_ = abi.WRITE_IN.unpack_from(buf, off)
        start = off + abi.WRITE_IN.size
        if start + size > end:
            raise Malformed(f"write of {size} bytes carries {end - start}")
        n = await self.ops.write(nodeid, fh, offset, view[start : start + size])
        return abi.WRITE_OUT.pack(n, 0)

    async def flush(self, nodeid, ctx, buf, view, off, end) -> None:
        (fh, *_) = abi.FLUSH_IN.unpack_from(buf, off)
        await self.ops.flush(nodeid, fh)

    async def release(self, nodeid, ctx, buf, view, off, end) -> None:
        (fh, *_) = abi.RELEASE_IN.unpack_from(buf, off)
        await self.ops.release(nodeid, fh)

    async def fsync(self, nodeid, ctx, buf, view, off, end) -> None:
        fh, flags, _ = abi.FSYNC_IN.unpack_from(buf, off)
        await self.ops.fsync(nodeid, fh, bool(flags & abi.FSYNC_FDATASYNC))

    async def statfs(self, nodeid, ctx, buf, view, off, end) -> bytes:
        s = await self.ops.statfs(ctx)
        return abi.STATFS_OUT.pack(s.f_blocks, s.f_bfree, s.f_bavail, s.f_files, s.f_ffree, s.f_bsize, s.f_namemax,
                                   s.f_frsize, 0)

    # ------------------------------------------------------------------
    # directories
    # ------------------------------------------------------------------
    async def opendir(self, nodeid, ctx, buf, view, off, end) -> bytes:
        fh = await self.ops.opendir(nodeid, ctx)
        return abi.OPEN_OUT.pack(fh, 0, 0)

    async def readdir(self, nodeid, ctx, buf, view, off, end, plus: bool = False) -> bytes:
        fh, offset, size, *_ = abi.READ_IN.unpack_from(buf, off)
        out = DirBuffer(size, plus)
        await self.ops.readdir(fh, offset, out)
        return out.payload()

    async def readdirplus(self, nodeid, ctx, buf, view, off, end) -> bytes:
        return await self.readdir(nodeid, ctx, buf, view, off, end, plus=True)

    async def releasedir(self, nodeid, ctx, buf, view, off, end) -> None:
        (fh, *_) = abi.RELEASE_IN.unpack_from(buf, off)
        await self.ops.releasedir(fh)

    async def fsyncdir(self, nodeid, ctx, buf, view, off, end) -> None:
        fh, flags, _ = abi.FSYNC_IN.unpack_from(buf, off)
        await self.ops.fsyncdir(fh, bool(flags & abi.FSYNC_FDATASYNC))
