"""The FUSE kernel protocol, as ``include/uapi/linux/fuse.h`` defines it (7.x, little-endian).

Only what mithrilfs speaks is here: opcodes, the INIT capability bits it
negotiates, ``FOPEN_*`` reply flags, ``FATTR_*`` setattr bits, notification
codes, and the fixed-size structs as ``struct.Struct`` objects (one compiled
format each, so the request loop never parses a format string).
"""

from __future__ import annotations

import struct

#: The protocol this module implements: major 7, minor up to 45 (Linux 6.18).
KERNEL_VERSION = 7
KERNEL_MINOR_VERSION = 45
#: Oldest kernel minor we accept: 7.31 (Linux 5.4) has every flag negotiated below.
MIN_KERNEL_MINOR = 31
ROOT_ID = 1
#: The kernel refuses reads of /dev/fuse into smaller buffers.
MIN_READ_BUFFER = 8192

# -- opcodes -----------------------------------------------------------
LOOKUP = 1
FORGET = 2
GETATTR = 3
SETATTR = 4
READLINK = 5
SYMLINK = 6
MKNOD = 8
MKDIR = 9
UNLINK = 10
RMDIR = 11
RENAME = 12
LINK = 13
OPEN = 14
READ = 15
WRITE = 16
STATFS = 17
RELEASE = 18
FSYNC = 20
SETXATTR = 21
GETXATTR = 22
LISTXATTR = 23
REMOVEXATTR = 24
FLUSH = 25
INIT = 26
OPENDIR = 27
READDIR = 28
RELEASEDIR = 29
FSYNCDIR = 30
GETLK = 31
SETLK = 32
SETLKW = 33
ACCESS = 34
CREATE = 35
INTERRUPT = 36
BMAP = 37
DESTROY = 38
IOCTL = 39
POLL = 40
NOTIFY_REPLY = 41
BATCH_FORGET = 42
FALLOCATE = 43
READDIRPLUS = 44
RENAME2 = 45
LSEEK = 46
COPY_FILE_RANGE = 47
SYNCFS = 50
TMPFILE = 51
STATX = 52

OPCODE_NAMES = {v: k for k, v in globals().items() if k.isupper() and isinstance(v, int) and 0 < v < 60
                and k not in ("KERNEL_VERSION", "KERNEL_MINOR_VERSION", "MIN_KERNEL_MINOR", "ROOT_ID")}

# -- INIT capability bits (flags | flags2 << 32) -----------------------
ASYNC_READ = 1 << 0
POSIX_LOCKS = 1 << 1
ATOMIC_O_TRUNC = 1 << 3
EXPORT_SUPPORT = 1 << 4
BIG_WRITES = 1 << 5
DONT_MASK = 1 << 6
FLOCK_LOCKS = 1 << 10
AUTO_INVAL_DATA = 1 << 12
DO_READDIRPLUS = 1 << 13
READDIRPLUS_AUTO = 1 << 14
ASYNC_DIO = 1 << 15
WRITEBACK_CACHE = 1 << 16
NO_OPEN_SUPPORT = 1 << 17
PARALLEL_DIROPS = 1 << 18
HANDLE_KILLPRIV = 1 << 19
ABORT_ERROR = 1 << 21
MAX_PAGES = 1 << 22
CACHE_SYMLINKS = 1 << 23
NO_OPENDIR_SUPPORT = 1 << 24
INIT_EXT = 1 << 30
PASSTHROUGH = 1 << 37
OVER_IO_URING = 1 << 41

# -- open reply flags --------------------------------------------------
FOPEN_DIRECT_IO = 1 << 0
FOPEN_KEEP_CACHE = 1 << 1
FOPEN_NONSEEKABLE = 1 << 2
FOPEN_CACHE_DIR = 1 << 3
FOPEN_NOFLUSH = 1 << 5
#: Reads and mmap of this open go to the backing file the reply's ``backing_id`` names (needs ``PASSTHROUGH``).
FOPEN_PASSTHROUGH = 1 << 7

# -- setattr valid bits ------------------------------------------------
FATTR_MODE = 1 << 0
FATTR_UID = 1 << 1
FATTR_GID = 1 << 2
FATTR_SIZE = 1 << 3
FATTR_ATIME = 1 << 4
FATTR_MTIME = 1 << 5
FATTR_FH = 1 << 6
FATTR_ATIME_NOW = 1 << 7
FATTR_MTIME_NOW = 1 << 8
FATTR_CTIME = 1 << 10

FSYNC_FDATASYNC = 1 << 0

# -- rename2 flags (as renameat2) --------------------------------------
RENAME_NOREPLACE = 1 << 0
RENAME_EXCHANGE = 1 << 1
RENAME_WHITEOUT = 1 << 2

# -- notifications (out header: unique 0, error = the code) ------------
NOTIFY_INVAL_INODE = 2
NOTIFY_INVAL_ENTRY = 3
NOTIFY_DELETE = 6
NOTIFY_RESEND = 7

# -- structs -----------------------------------------------------------
IN_HEADER = struct.Struct("<IIQQIIIHH")  # len opcode unique nodeid uid gid pid total_extlen padding
OUT_HEADER = struct.Struct("<IiQ")  # len error unique
#: fuse_attr: ino size blocks atime mtime ctime (s64 seconds) atimensec mtimensec ctimensec
#: mode nlink uid gid rdev blksize flags
ATTR_FORMAT = "QQQqqqIIIIIIIIII"
ENTRY_OUT = struct.Struct("<QQQQII" + ATTR_FORMAT)  # nodeid generation entry_valid attr_valid (+nsec x2) attr
ATTR_OUT = struct.Struct("<QII" + ATTR_FORMAT)  # attr_valid attr_valid_nsec dummy attr
OPEN_OUT = struct.Struct("<QIi")  # fh open_flags backing_id
WRITE_OUT = struct.Struct("<II")
STATFS_OUT = struct.Struct("<QQQQQIIII24x")  # blocks bfree bavail files ffree bsize namelen frsize padding spare
INIT_IN = struct.Struct("<IIIII")  # major minor max_readahead flags flags2 (flags2 only with INIT_EXT)
#: ... max_pages map_alignment flags2 max_stack_depth request_timeout unused[11]
INIT_OUT = struct.Struct("<IIIIHHIIHHIIH22x")
FORGET_IN = struct.Struct("<Q")
BATCH_FORGET_IN = struct.Struct("<II")
FORGET_ONE = struct.Struct("<QQ")
GETATTR_IN = struct.Struct("<IIQ")
SETATTR_IN = struct.Struct("<IIQQQqqqIIIIIIII")
MKNOD_IN = struct.Struct("<IIII")
MKDIR_IN = struct.Struct("<II")
RENAME_IN = struct.Struct("<Q")
RENAME2_IN = struct.Struct("<QII")
LINK_IN = struct.Struct("<Q")
OPEN_IN = struct.Struct("<II")
CREATE_IN = struct.Struct("<IIII")
RELEASE_IN = struct.Struct("<QIIQ")
FLUSH_IN = struct.Struct("<QIIQ")
READ_IN = struct.Struct("<QQIIQII")
WRITE_IN = struct.Struct("<QQIIQII")
FSYNC_IN = struct.Struct("<QII")
INTERRUPT_IN = struct.Struct("<Q")
DIRENT = struct.Struct("<QQII")  # ino off namelen type, then the name, padded to 8 bytes
NOTIFY_INVAL_ENTRY_OUT = struct.Struct("<QII")  # parent namelen flags
NOTIFY_INVAL_INODE_OUT = struct.Struct("<Qqq")  # ino off len
NOTIFY_DELETE_OUT = struct.Struct("<QQII")  # parent child namelen padding
BACKING_MAP = struct.Struct("<iIQ")  # fd flags padding (fuse_backing_map)

# -- /dev/fuse ioctls (_IOW(229, nr, size)) ------------------------------
#: Register an open file as a backing file; returns its backing id (> 0).
DEV_IOC_BACKING_OPEN = (1 << 30) | (BACKING_MAP.size << 16) | (229 << 8) | 1
#: Drop a backing id (opens that use it keep their file).
DEV_IOC_BACKING_CLOSE = (1 << 30) | (4 << 16) | (229 << 8) | 2

assert ENTRY_OUT.size == 128 and ATTR_OUT.size == 104 and STATFS_OUT.size == 80 and INIT_OUT.size == 64
assert SETATTR_IN.size == 88 and READ_IN.size == 40 and WRITE_IN.size == 40 and IN_HEADER.size == 40

#: Size of the fixed part of each request's body (what a handler unpacks before any names).
MIN_BODY = {
    INIT: 16, FORGET: FORGET_IN.size, BATCH_FORGET: BATCH_FORGET_IN.size, GETATTR: GETATTR_IN.size,
    SETATTR: SETATTR_IN.size, MKNOD: MKNOD_IN.size, MKDIR: MKDIR_IN.size, RENAME: RENAME_IN.size,
    RENAME2: RENAME2_IN.size, LINK: LINK_IN.size, OPEN: OPEN_IN.size, CREATE: CREATE_IN.size, READ: READ_IN.size,
    WRITE: WRITE_IN.size, RELEASE: RELEASE_IN.size, FLUSH: FLUSH_IN.size, FSYNC: FSYNC_IN.size,
    OPENDIR: OPEN_IN.size, READDIR: READ_IN.size, READDIRPLUS: READ_IN.size, RELEASEDIR: RELEASE_IN.size,
    FSYNCDIR: FSYNC_IN.size, INTERRUPT: INTERRUPT_IN.size,
}
