"""The control directory as the kernel sees it: a node type of its own (go-fuse's way).

``fs`` hands every request on an inode of ``MOUNT/.mithrilfs/`` here; the
directory and its files are never in the index.  Attributes are never
cached (each GETATTR produces the content afresh, see ``files``), commands
are files their owner writes (0644), the rest only read (0444), and
nothing can be created, linked or renamed into the directory.
"""

from __future__ import annotations

import errno
import os
import stat
import time

from mithrilfs.control.files import CONTROL_DIR_INODE, CONTROL_NAME, ControlFiles
from mithrilfs.kernel import DirBuffer, EntryAttributes, FUSEError, SetattrFields
from mithrilfs.store.namespace import ROOT_INODE

#: st_blksize of every file the mount shows (its own and the control files): 128 KiB reads suit both.
BLKSIZE = 128 * 1024


class ControlNode:
    def __init__(self, files: ControlFiles) -> None:
        self.files = files

    @staticmethod
    def owns(ino: int) -> bool:
        """Whether *ino* is the control directory or one of its files."""
        return ControlFiles.is_control(ino)

    @staticmethod
    def is_its_name(parent: int, name: bytes) -> bool:
        return parent == ROOT_INODE and name == CONTROL_NAME

    def refuse_names_in(self, parent: int, name: bytes) -> None:
        """Nothing is made in the control directory, nor under its name: EPERM."""
        if self.owns(parent) or self.is_its_name(parent, name):
            raise FUSEError(errno.EPERM)

    async def lookup(self, parent: int, name: bytes) -> EntryAttributes:
        if self.is_its_name(parent, name):
            return self.attr(CONTROL_DIR_INODE)
        ino = self.files.lookup(name) if parent == CONTROL_DIR_INODE else None
        if ino is None:
            raise FUSEError(errno.ENOENT)
        return await self.getattr(ino)

    async def getattr(self, ino: int) -> EntryAttributes:
        """Attributes with the content produced afresh (a LOOKUP or GETATTR)."""
        if ino != CONTROL_DIR_INODE:
            await self.files.refresh(ino)
        return self.attr(ino)

    def attr(self, ino: int) -> EntryAttributes:
        """Attributes as of the last production (a directory listing)."""
        e = EntryAttributes()
        e.st_ino = ino
        e.entry_timeout = 0
        e.attr_timeout = 0
        now = time.time_ns()
        e.st_atime_ns = e.st_mtime_ns = e.st_ctime_ns = now
        e.st_uid, e.st_gid = os.getuid(), os.getgid()
        e.st_blksize = BLKSIZE
        if ino == CONTROL_DIR_INODE:
            e.st_mode = stat.S_IFDIR | 0o555
            e.st_nlink = 2
        else:
            e.st_mode = stat.S_IFREG | (0o644 if self.files.is_command(ino) else 0o444)
            e.st_nlink = 1
            # a new size or mtime makes the kernel drop the pages it cached of the last content
            e.st_size, e.st_mtime_ns = self.files.shown(ino)
        return e

    def setattr(self, ino: int, attr: EntryAttributes, fields: SetattrFields) -> EntryAttributes:
        """Only a command file's truncate to 0 (a shell's ``echo run > .mithrilfs/gc`` opens with O_TRUNC)."""
        if (self.files.is_command(ino) and not (fields.update_mode or fields.update_uid or fields.update_gid)
                and (not fields.update_size or attr.st_size == 0)):
            return self.attr(ino)
        raise FUSEError(errno.EPERM)

    async def read(self, ino: int, off: int, size: int) -> bytes:
        return await self.files.read(ino, off, size)

    async def write(self, ino: int, buf: bytes) -> int:
        """A command: run it now; its answer is what the file reads back."""
        if not self.files.is_command(ino):
            raise FUSEError(errno.EPERM)
        await self.files.run_command(ino, bytes(buf))
        return len(buf)

    def opendir(self, ino: int) -> int:
        if ino != CONTROL_DIR_INODE:
            raise FUSEError(errno.ENOTDIR)
        return ino

    def readdir(self, start_id: int, token: DirBuffer) -> None:
        for i, (name, ino) in enumerate(self.files.names(), start=1):
            if i > start_id and not token.add(name, self.attr(ino), i):
                return
