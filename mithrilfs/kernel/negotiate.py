"""What the session asks of the kernel at INIT: capabilities, request sizes, and the answer packed.

The capabilities asked for are ``wanted_capabilities`` (docs/design.md,
"INIT", says why each).  A request carries at most ``MAX_WRITE`` bytes,
2 MiB, one PMD-sized folio: a file written in one go then reaches the store
in 2 MiB pieces, which the backing filesystem keeps in 2 MiB folios, so a
mapping of its blob (passthrough) takes one page-table entry per 2 MiB, as
a plain file written the same way does.  The kernel caps a request's pages
at ``fs.fuse.max_pages_limit`` (256 by default, and before the setting
existed; setup raises it to 512): below 512 the session asks for what the
kernel allows and ``status`` says so (``write_size_note``).
"""

from __future__ import annotations

from dataclasses import dataclass

from . import abi

#: The largest WRITE (and READ) asked for.
MAX_WRITE = 2 << 20
#: The kernel's cap on a request's pages.
MAX_PAGES_LIMIT = "/proc/sys/fs/fuse/max_pages_limit"
#: INIT's ``max_stack_depth`` with passthrough: backing files on a plain local filesystem (the store's).
STACK_DEPTH = 1
#: The page size the kernel counts a request's pages in.
PAGE = 4096


def wanted_capabilities(readdirplus: bool, uring: bool = False, passthrough: bool = False) -> int:
    """What we ask for at INIT (docs/design.md says why each)."""
    want = (abi.ASYNC_READ | abi.BIG_WRITES | abi.AUTO_INVAL_DATA | abi.PARALLEL_DIROPS
            | abi.MAX_PAGES | abi.CACHE_SYMLINKS | abi.INIT_EXT)
    if readdirplus:
        want |= abi.DO_READDIRPLUS | abi.READDIRPLUS_AUTO
    if uring:
        want |= abi.OVER_IO_URING
    if passthrough:
        want |= abi.PASSTHROUGH
    return want


def max_pages_limit(path: str = MAX_PAGES_LIMIT) -> int:
    """The kernel's cap on the pages of one request (256 where the setting does not exist)."""
    try:
        with open(path) as f:
            return int(f.read())
    except (OSError, ValueError):
        return 256


def allowed_max_write(wanted: int = MAX_WRITE) -> int:
    """*wanted* (``MAX_WRITE``), or the most the kernel lets one request carry when that is less."""
    return max(PAGE, min(wanted, max_pages_limit() * PAGE))


def write_size_note(max_write: int) -> str:
    """What ``status`` adds when requests are smaller than ``MAX_WRITE`` (else nothing)."""
    if max_write >= MAX_WRITE:
        return ""
    return (f", writes in {max_write >> 10} KiB pieces (fs.fuse.max_pages_limit {max_pages_limit()},"
            f" {MAX_WRITE // PAGE} for 2 MiB)")


def init_reply(proto_minor: int, max_readahead: int, caps: int, max_write: int) -> bytes:
    """INIT's answer: the agreed minor and capabilities, *max_readahead* and the request sizes."""
    max_pages = max(1, max_write // PAGE)
    return abi.INIT_OUT.pack(
        abi.KERNEL_VERSION, proto_minor, max_readahead, caps & 0xFFFFFFFF, 64, 48, max_write, 1, max_pages, 0,
        caps >> 32, STACK_DEPTH if caps & abi.PASSTHROUGH else 0, 0)


@dataclass(frozen=True)
class SessionParameters:
    """What INIT agreed: a daemon taking over a live connection serves with the same (``Session.adopt``)."""

    proto_minor: int
    capabilities: int
    max_write: int
