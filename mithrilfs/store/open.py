"""Opening a store directory: format stamp, exclusive lock, CAS + namespace.

Two daemons on one store would corrupt each other's refcounts, so opening
takes an exclusive ``flock`` on ``STORE/lock`` for the life of the process.
"""

from __future__ import annotations

import errno
import fcntl
import json
import os
import sqlite3
import stat
import time
from dataclasses import dataclass
from pathlib import Path

import platformdirs

from mithrilfs.store.blobs import Blobs
from mithrilfs.store.cas import CAS
from mithrilfs.store.namespace import Namespace
from mithrilfs.store.reserve import RESERVE_BYTES, Reserve, disk_room, is_disk_full

#: RESERVE_BYTES, disk_room and is_disk_full are the store's word to the layers above, said here
__all__ = ["RESERVE_BYTES", "Store", "StoreError", "disk_room", "is_disk_full", "open_store"]

FORMAT_VERSION = 1
_FORMAT_FILE = "FORMAT"
_INDEX_FILE = "index.sqlite3"
_RESERVE_FILE = "reserve"


class StoreError(Exception):
    """A problem with the store a user can fix; printed as one line."""


def default_store() -> Path:
    return Path(platformdirs.user_cache_dir("mithrilfs"))


@dataclass
class Store:
    root: Path
    cas: CAS
    ns: Namespace
    blobs: Blobs
    lock_fd: int
    #: The store's filesystem is read-only: served as a read-only mount.
    read_only: bool = False
    #: The last stop was unclean (the index's clean mark was off at open) and no garbage
    #: collection has recounted the blob bytes against the disk since.
    unclean: bool = False

    def close(self) -> None:
        """Close the index and release the store's lock (a second call does nothing)."""
        if self.lock_fd < 0:
            return
        self.cas.blanks.close()
        self.ns.close()
        os.close(self.lock_fd)
        self.lock_fd = -1

    def ensure_reserve(self) -> bool:
        """Hold RESERVE_BYTES of real disk blocks (best effort); True when held."""
        return self.blobs.reserve.ensure()

    def release_reserve(self) -> None:
        self.blobs.reserve.release()

    def room(self) -> int:
        """Bytes still free for the store on its disk (``reserve.disk_room``)."""
        return disk_room(self.root)

    def collect_garbage(self) -> int:
        """Delete blob files no inode references; returns how many.

        The blobs' byte total is set afresh afterwards: it was summed when
        the store opened, with these blobs in it (a kill -9 left 250 MiB of
        dropped files counted, and the budget evicted real files for them).
        The first collection after an unclean stop counts against the files
        on disk (``Blobs.recount``); later ones trust the index.
        """
        garbage = self.ns.garbage()
        for digest in garbage:
            self.cas.delete(digest)
        with self.ns.txn():
            for digest in garbage:
                self.ns.forget_blob(digest)
        self.blobs.recount(check_files=self.unclean)
        self.unclean = False
        return len(garbage)


def validate_store(path: str | os.PathLike[str]) -> None:
    """Refuse, without changing anything, a path that cannot be (or become) a store."""
    root = Path(path)
    try:
        if not root.exists():
            return
        if not root.is_dir():
            raise StoreError(f"{root}: store is not a directory")
        _check_format(root, create=False)
    except PermissionError:
        raise StoreError(f"{root}: cannot open store: permission denied{_owner_hint(root)}") from None


def _check_format(root: Path, *, create: bool = True) -> None:
    stamp = root / _FORMAT_FILE
    if stamp.exists():
        try:
            fmt = json.loads(stamp.read_text()).get("format")
        except (ValueError, AttributeError):
            raise StoreError(f"{root}: FORMAT file is unreadable; not a mithrilfs store?") from None
        if fmt != FORMAT_VERSION:
            raise StoreError(
                f"{root}: store format {fmt} is not supported (this mithrilfs reads format {FORMAT_VERSION})"
            )
        return
    if any(root.iterdir()):
        raise StoreError(f"{root}: directory is not empty and is not a mithrilfs store")
    if not create:
        return
    tmp = root / f".{_FORMAT_FILE}.tmp"
    tmp.write_text(json.dumps({"format": FORMAT_VERSION, "created": time.time()}) + "\n")
    os.rename(tmp, stamp)


def _make_private(root: Path) -> None:
    """Directories 0700 and files 0600 at the store's top level (best effort).

    A store made by an older version, or a directory someone created for it
    (a container entrypoint's ``mkdir``), may be 0755: the index names every
    file and the blobs are the cached code.  Blob shards below ``objects/``
    are protected by their parent's 0700 and made 0700 as they appear;
    blobs are 0400.  Processes that write a store set umask 077 as well.
    """
    if root.stat().st_uid != os.getuid():
        return
    for path in (root, *root.iterdir()):
        try:
            st = path.lstat()
            if stat.S_ISDIR(st.st_mode):
                if stat.S_IMODE(st.st_mode) != 0o700:
                    os.chmod(path, 0o700)
            elif stat.S_ISREG(st.st_mode) and st.st_mode & 0o077:
                os.chmod(path, stat.S_IMODE(st.st_mode) & 0o700)
        except OSError:
            pass


def _owner_hint(root: Path) -> str:
    """Why a store cannot be used when another user owns it (a store made by root, used as a user)."""
    import pwd

    existing = next((p for p in (root, *root.parents) if os.path.lexists(p)), root)
    try:
        uid = existing.stat().st_uid
    except OSError:
        return ""
    if uid == os.geteuid():
        return ""
    try:
        owner = f"{pwd.getpwuid(uid).pw_name} (uid {uid})"
    except KeyError:
        owner = f"uid {uid}"
    return (f"; {existing} belongs to {owner} and this is uid {os.geteuid()}: use a store of your own"
            f" (--store DIR; the default is {default_store()}) or run as its owner")


HOLDER_FILE = "mounted.json"


def holder_record(root: Path) -> dict | None:
    """{'pid': N, 'mountpoint': MP, 'owner': ...} of the daemon that mounted the store, while it runs; else
    None.  'owner' is the process the mount is for, as the daemon was given it (``run``'s; else None)."""
    try:
        held = json.loads((root / HOLDER_FILE).read_text())
        pid, mountpoint = int(held["pid"]), str(held["mountpoint"])
        os.kill(pid, 0)
    except (OSError, ValueError, KeyError, TypeError):
        return None
    return {"pid": pid, "mountpoint": mountpoint, "owner": held.get("owner")}


def _holder(root: Path) -> str:
    """Who holds the store, as the daemon wrote it at mount: ' (pid N, mounted at MP; ...)' or ''."""
    held = holder_record(root)
    if held is None:
        return ""
    return (f" (pid {held['pid']}, mounted at {held['mountpoint']}; use that mount, e.g. "
            f"'mithrilfs run --mount {held['mountpoint']} -- CMD', or unmount it)")


def open_store(path: str | os.PathLike[str] | None = None, *, lock_fd: int | None = None) -> Store:
    """Open (or create) the store at *path* and take its lock.

    *lock_fd*: the lock is already held on this descriptor, which the
    caller hands over (a daemon taking over a live mount gets it from the
    mount's supervisor, which holds it for the life of the mount).
    """
    root = Path(path) if path is not None else default_store()
    root = root.expanduser().absolute()
    if root.exists() and not root.is_dir():
        raise StoreError(f"{root}: store is not a directory")
    try:
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as e:
        raise StoreError(f"{root}: cannot create store: {e.strerror}{_owner_hint(root)}") from None
    inherited, lock_fd = lock_fd, -1
    read_only = bool(os.statvfs(root).f_flag & os.ST_RDONLY)
    if not read_only:
        _make_private(root)
    try:
        if read_only:
            if not (root / _FORMAT_FILE).exists():
                raise StoreError(f"{root}: read-only and not a mithrilfs store")
            _check_format(root, create=False)
            lock_fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        else:
            _check_format(root)
            lock_fd = os.open(root / "lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    except OSError as e:
        raise StoreError(f"{root}: cannot open store: {e.strerror}{_owner_hint(root)}") from None
    if inherited is not None:
        os.close(lock_fd)
        lock_fd = inherited
        os.set_inheritable(lock_fd, False)
    try:
        fcntl.flock(lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError as e:
        os.close(lock_fd)
        if e.errno in (errno.EWOULDBLOCK, errno.EAGAIN):
            raise StoreError(f"{root}: store is in use by another mithrilfs process{_holder(root)}") from None
        raise
    try:
        cas = CAS(root, create=not read_only)
        ns = Namespace(str(root / _INDEX_FILE), read_only=read_only)
    except (OSError, sqlite3.Error) as e:
        os.close(lock_fd)
        raise StoreError(f"{root}: cannot open store: {getattr(e, 'strerror', None) or e}") from None
    unclean = not read_only and ns.get_meta("clean") != "1"
    return Store(root, cas, ns, Blobs(ns, cas, Reserve(root / _RESERVE_FILE)), lock_fd, read_only, unclean)
