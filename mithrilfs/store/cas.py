"""Content-addressed blob store: immutable files under ``objects/`` named by blake3.

Blobs never change once written, which is what lets the filesystem hand the
kernel ``keep_cache`` and lets any number of names share one copy.  The store
knows nothing about names or refcounts: that is the namespace's job.  Writers
work in ``staging/`` and a finished staging file becomes a blob by one
``rename``, so a blob is either absent or complete, never torn.
"""

from __future__ import annotations

import errno
import os
import uuid
from collections.abc import Collection
from pathlib import Path

import blake3

from mithrilfs.store.blank_files import NO_BLANKS, Blanks

# the standard-library half the blob writer process runs too: one way to write a blob's file
from mithrilfs.store.blob_writer_child import BLOB_MODE, fill_and_link, write_and_rename

DIGEST_SIZE = 32
#: Files at least this large are hashed with blake3's threads over an mmap.
_MMAP_HASH_MIN = 1 << 20

EMPTY_DIGEST = blake3.blake3(b"").digest()


def hash_bytes(data: bytes | bytearray | memoryview) -> bytes:
    return blake3.blake3(data).digest()


def hash_file(path: str | os.PathLike[str]) -> bytes:
    """blake3 of a file's content; large files use all cores via mmap."""
    size = os.stat(path).st_size
    if size == 0:
        return EMPTY_DIGEST
    if size >= _MMAP_HASH_MIN:
        h = blake3.blake3(max_threads=blake3.blake3.AUTO)
        h.update_mmap(os.fspath(path))
        return h.digest()
    with open(path, "rb") as f:
        return hash_bytes(f.read())


class CAS:
    """The ``objects/``, ``staging/`` and ``quarantine/`` directories of a store."""

    def __init__(self, store: str | os.PathLike[str], *, create: bool = True) -> None:
        self.root = Path(store)
        self.objects = self.root / "objects"
        self.staging = self.root / "staging"
        self.quarantine = self.root / "quarantine"
        #: Shard directories known to exist (``write_blob`` skips their mkdir).
        self._shards: set[str] = set()
        #: ``objects/`` as a string: the read path builds a blob's file name per request without pathlib.
        self._objects_prefix = os.fspath(self.objects) + os.sep
        self.staging_prefix = os.fspath(self.staging) + os.sep
        #: Empty staging files made ahead (``blank_files``): none unless a daemon serving the store sets them.
        self.blanks: Blanks = NO_BLANKS
        if create:
            for d in (self.objects, self.staging, self.quarantine):
                d.mkdir(mode=0o700, parents=True, exist_ok=True)

    # -- blobs -----------------------------------------------------------
    def path(self, digest: bytes) -> Path:
        return Path(self.file_name(digest))

    def file_name(self, digest: bytes) -> str:
        """The blob's file, as ``path`` without building a Path (a few microseconds per request)."""
        h = digest.hex()
        return f"{self._objects_prefix}{h[:2]}/{h}"

    def exists(self, digest: bytes) -> bool:
        return os.path.exists(self.file_name(digest))

    def open(self, digest: bytes) -> int:
        """A read-only fd on the blob; FileNotFoundError when it is gone."""
        return os.open(self.file_name(digest), os.O_RDONLY | os.O_CLOEXEC)

    def read(self, digest: bytes) -> bytes:
        with open(self.path(digest), "rb") as f:
            return f.read()

    def verify(self, digest: bytes) -> bool:
        """True when the blob exists and its content still hashes to its name."""
        try:
            return hash_file(self.path(digest)) == digest
        except FileNotFoundError:
            return False

    def delete(self, digest: bytes) -> bool:
        """Remove the blob's file; True when there was one (the bytes it held are freed)."""
        try:
            os.unlink(self.path(digest))
        except FileNotFoundError:
            return False
        return True

    def adopt(self, staging_path: str | os.PathLike[str], digest: bytes, *, trust_existing: bool = True) -> bool:
        """Make the finished file at *staging_path* also the blob *digest*.

        Returns True when a new blob appeared, False when one already existed
        (dedup).  The blob is a hard link to the staging file, made in one
        atomic step, so it is never seen half-written; the caller removes the
        staging name once the index points at the blob (and can retry if
        that fails).  Unless *trust_existing*, an existing blob is atomically
        replaced by these bytes (same name, so same content when it is
        intact; a silently damaged one is healed for free).
        """
        dest = self.path(digest)
        if os.path.exists(dest):
            if not trust_existing:
                tmp = dest.with_name(f".{dest.name}.{uuid.uuid4().hex[:8]}")
                os.chmod(staging_path, BLOB_MODE)
                os.link(staging_path, tmp)
                os.rename(tmp, dest)
            return False
        dest.parent.mkdir(mode=0o700, exist_ok=True)
        os.chmod(staging_path, BLOB_MODE)
        try:
            os.link(staging_path, dest)
        except FileExistsError:
            return False
        return True

    def make_shards(self) -> None:
        """Make every directory of ``objects/`` a blob can go to (256), so no ``write_blob`` makes one."""
        for i in range(256):
            self._make_shard(f"{i:02x}")

    def _make_shard(self, shard: str) -> None:
        """The directory of ``objects/`` named *shard* exists (made unless known to)."""
        if shard not in self._shards:
            os.makedirs(f"{self._objects_prefix}{shard}", mode=0o700, exist_ok=True)
            self._shards.add(shard)

    def write_blob(self, digest: bytes, data: bytes | bytearray | memoryview, *, trust_existing: bool = True) -> bool:
        """Write verified bytes as the blob *digest* in one rename (no staging file); True when new.

        For small blobs (a prefetch, a commit of content staged in memory):
        a create and a rename each, where a staging file, its link and its
        unlink cost more; the create is a blank made ahead when one is ready
        (``blanks``).  Unless *trust_existing*, an existing blob is
        atomically replaced by these bytes (as ``adopt`` does).  Safe from
        worker threads.
        """
        dest = self.file_name(digest)  # strings, not Paths: a prefetch writes thousands a second
        if trust_existing and os.path.exists(dest):  # a blob the caller expects there: kept, no blank spent
            return False
        self._make_shard(dest[len(self._objects_prefix):len(self._objects_prefix) + 2])
        blank = self.blanks.take()
        if blank is not None:  # nameless: a crash or a full disk leaves nothing of it
            try:  # its link is the check (content not verified here is new, as a rule: no stat first)
                return fill_and_link(blank, dest, data, replace_via=None if trust_existing else self._staging_name)
            except OSError as e:
                if e.errno in (errno.ENOSPC, errno.EDQUOT):
                    raise
                self.blanks.refused(e)  # and the bytes are written as without blanks
        existed = not trust_existing and os.path.exists(dest)
        # a crash leaves the temporary file where startup clears; a full disk removes it (the retry after
        # making room starts over)
        write_and_rename(self._staging_name(), dest, data, exclusive=True)
        return not existed

    def _staging_name(self) -> str:
        """A new name in ``staging/`` (a string: no Path made)."""
        return f"{self.staging_prefix}{uuid.uuid4().hex}"

    def quarantine_blob(self, digest: bytes) -> Path | None:
        """Move a blob that failed verification out of ``objects/`` (kept for inspection)."""
        target = self.quarantine / f"{digest.hex()}.{uuid.uuid4().hex[:8]}"
        try:
            os.rename(self.path(digest), target)
        except FileNotFoundError:
            return None
        return target

    # -- staging ---------------------------------------------------------
    def new_staging(self) -> tuple[int, str]:
        """A fresh, empty staging file opened read-write: (fd, path)."""
        path = str(self.staging / uuid.uuid4().hex)
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        return fd, path

    def clear_staging(self, keep: Collection[str] = ()) -> int:
        """Remove every staging file (uncommitted writes of a previous run) but those in *keep*."""
        n = 0
        for entry in os.scandir(self.staging):
            if entry.path in keep:
                continue
            try:
                os.unlink(entry.path)
                n += 1
            except FileNotFoundError:
                pass
        return n

    def iter_digests(self):
        """Every blob on disk, by name (for fsck and tests); stray files are skipped."""
        for sub in os.scandir(self.objects):
            if not sub.is_dir():
                continue
            for entry in os.scandir(sub.path):
                if len(entry.name) == 2 * DIGEST_SIZE and entry.name.startswith(sub.name):
                    try:
                        yield bytes.fromhex(entry.name)
                    except ValueError:
                        continue
