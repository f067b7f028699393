"""Lifetimes on their own: kernel references, deleting unused inodes, removing every name, telling the kernel.

A real store (CAS + SQLite index in a temporary directory); the kernel's
caches are a small recording implementation of the ``KernelCaches``
protocol, so the tests can see what the kernel would have been told.
"""

from __future__ import annotations

import os
import stat

import pytest
from conftest import make_dir

from mithrilfs.cache.lifetime import Lifetimes, Removed
from mithrilfs.cache.lookups import LookupCounts
from mithrilfs.cache.recency import Recency
from mithrilfs.store.namespace import ROOT_INODE, Inode
from mithrilfs.store.open import Store


class RecordingKernel:
    """The ``KernelCaches`` protocol, remembering every call (what a mount's notifier would send)."""

    def __init__(self) -> None:
        self.deleted: list[tuple[int, int, bytes]] = []
        self.invalidated: list[tuple[int, int, int]] = []

    def delete(self, parent: int, child: int, name: bytes) -> None:
        self.deleted.append((parent, child, name))

    def invalidate_inode(self, inode: int, off: int = 0, length: int = 0) -> None:
        self.invalidated.append((inode, off, length))


@pytest.fixture
def kernel() -> RecordingKernel:
    return RecordingKernel()


@pytest.fixture
def written() -> set[int]:
    """Inodes with uncommitted writes (``WritePath.staged`` in a mount)."""
    return set()


@pytest.fixture
def lifetimes(store: Store, written: set[int], kernel: RecordingKernel) -> Lifetimes:
    return Lifetimes(store.ns, store.blobs, Recency(store.ns), written.__contains__, kernel)




def add_file(store: Store, parent: int, name: bytes, data: bytes) -> Inode:
    """A named file whose content *data* is a committed blob (what a commit leaves)."""
    digest, _ = store.blobs.add_bytes(data)
    with store.ns.txn():
        ino = store.ns.create_inode(stat.S_IFREG | 0o644, os.getuid(), os.getgid())
        store.ns.link(parent, name, ino.id)
        store.ns.set_content(ino, digest, len(data), ino.mtime_ns)
    return ino


def unlink(lifetimes: Lifetimes, parent: int, name: bytes) -> Inode:
    """Remove one name as UNLINK does (the inode row stays for ``delete_if_unused``)."""
    ns = lifetimes.ns
    ino = ns.get(ns.lookup(parent, name))  # type: ignore[arg-type]
    parent_ino = ns.get(parent)
    assert ino is not None and parent_ino is not None
    with ns.txn():
        lifetimes.drop_name(parent_ino, name, ino)
    return ino


def test_ref_and_unref_count_kernel_references(lifetimes: Lifetimes) -> None:
    """Every positive reply adds one; FORGET gives back n at a time; True only when none is left."""
    lifetimes.ref(7)
    lifetimes.ref(7)
    lifetimes.ref(7)
    assert lifetimes.referenced(7)
    assert lifetimes.unref(7, 2) is False
    assert lifetimes.referenced(7)
    assert lifetimes.unref(7, 1) is True
    assert not lifetimes.referenced(7) and lifetimes.counts.get(7) == 0
    # more forgotten than held (a remount's stale FORGET) leaves nothing negative
    lifetimes.ref(8)
    assert lifetimes.unref(8, 5) is True
    assert not lifetimes.referenced(8)
    lifetimes.ref(8)
    assert lifetimes.referenced(8)


def test_delete_if_unused_keeps_named_or_referenced_or_written_inodes(
        store: Store, lifetimes: Lifetimes, written: set[int]) -> None:
    """An inode goes (row, blob reference, blob file) only with no name, no kernel reference and no writes."""
    ino = add_file(store, ROOT_INODE, b"f", b"content of f")
    digest = ino.hash
    assert digest is not None
    # still named
    assert lifetimes.delete_if_unused(ino.id) == 0
    assert store.ns.get(ino.id) is not None
    lifetimes.ref(ino.id)
    unlink(lifetimes, ROOT_INODE, b"f")
    assert ino.nlink == 0
    # no name, but the kernel holds it (an open file)
    assert lifetimes.delete_if_unused(ino.id) == 0
    assert store.ns.get(ino.id) is not None and store.cas.exists(digest)
    lifetimes.unref(ino.id, 1)
    # no name, no reference, but uncommitted writes
    written.add(ino.id)
    assert lifetimes.delete_if_unused(ino.id) == 0
    assert store.ns.get(ino.id) is not None
    written.discard(ino.id)
    # nothing holds it any more: row and blob go, and the bytes freed are returned
    assert lifetimes.delete_if_unused(ino.id) == len(b"content of f")
    assert store.ns.get(ino.id) is None
    assert not store.cas.exists(digest) and store.ns.blob_info(digest) is None
    assert store.blobs.bytes == 0


def test_delete_if_unused_keeps_a_blob_another_inode_shares(store: Store, lifetimes: Lifetimes) -> None:
    """Deleting one of two inodes with the same content frees nothing: the blob is still referenced."""
    a = add_file(store, ROOT_INODE, b"a", b"same")
    b = add_file(store, ROOT_INODE, b"b", b"same")
    assert a.hash == b.hash and a.hash is not None
    unlink(lifetimes, ROOT_INODE, b"a")
    assert lifetimes.delete_if_unused(a.id) == 0
    assert store.ns.get(a.id) is None
    assert store.cas.exists(a.hash) and store.ns.refcount(a.hash) == 1


def test_remove_all_names_keeping_content_of_a_referenced_inode_until_forget(
        store: Store, lifetimes: Lifetimes) -> None:
    """Eviction (keep_content): a referenced inode keeps row and blob until unref + delete; others go at once."""
    d = make_dir(store, ROOT_INODE, b"inductor")
    held = add_file(store, d, b"held.so", b"mapped by a process")
    with store.ns.txn():
        store.ns.link(ROOT_INODE, b"held-link", held.id)  # a second name: both must go
        store.ns.add_link(held, 1)
    free = add_file(store, d, b"free.py", b"nobody holds me")
    lifetimes.ref(held.id)
    removed: list[Removed] = []
    with store.ns.txn():
        dropped = lifetimes.remove_all_names([held, free], removed, keep_content=True)
    assert sorted(removed) == sorted([(d, b"held.so", held.id), (ROOT_INODE, b"held-link", held.id),
                                      (d, b"free.py", free.id)])
    assert store.ns.names_of(held.id) == [] and store.ns.names_of(free.id) == []
    # the unreferenced inode's row went; its blob is the caller's to collect
    assert dropped == {free.hash}
    assert store.ns.get(free.id) is None
    assert sum(store.blobs.collect(h) for h in dropped) == len(b"nobody holds me")
    # the referenced one is kept whole and still readable until FORGET
    row = store.ns.get(held.id)
    assert row is not None and row.nlink == 0 and row.hash == held.hash
    assert held.id not in lifetimes.unreadable
    assert store.cas.read(held.hash) == b"mapped by a process"  # type: ignore[arg-type]
    assert lifetimes.unref(held.id, 1)
    assert lifetimes.delete_if_unused(held.id) == len(b"mapped by a process")
    assert not store.cas.exists(held.hash)  # type: ignore[arg-type]


def test_remove_all_names_without_keeping_content_makes_a_referenced_inode_unreadable(
        store: Store, lifetimes: Lifetimes) -> None:
    """Content that must not be served (corrupt) goes at once even from an inode the kernel holds."""
    ino = add_file(store, ROOT_INODE, b"bad", b"corrupt bytes")
    digest = ino.hash
    lifetimes.ref(ino.id)
    removed: list[Removed] = []
    with store.ns.txn():
        dropped = lifetimes.remove_all_names([ino], removed, keep_content=False)
    assert dropped == {digest}
    row = store.ns.get(ino.id)
    assert row is not None and row.hash is None and row.size == 0  # the row stays until FORGET
    assert ino.id in lifetimes.unreadable
    assert store.ns.refcount(digest) == 0  # type: ignore[arg-type]


def test_tell_kernel_passes_parent_child_and_name(store: Store, lifetimes: Lifetimes,
                                                  kernel: RecordingKernel) -> None:
    """Every name the daemon removed on its own reaches the kernel as (parent, child, name)."""
    d = make_dir(store, ROOT_INODE, b"triton")
    lifetimes.tell_kernel([(d, b"k.cubin", 42), (ROOT_INODE, b"x", 43)])
    assert kernel.deleted == [(d, 42, b"k.cubin"), (ROOT_INODE, 43, b"x")]
    # forget_content removes every name of a blob and tells the kernel about each of them
    kernel.deleted.clear()
    ino = add_file(store, d, b"a", b"lost")
    with store.ns.txn():
        store.ns.link(ROOT_INODE, b"b", ino.id)
        store.ns.add_link(ino, 1)
    lifetimes.forget_content(ino.hash, [ino])  # type: ignore[arg-type]
    assert sorted(kernel.deleted) == sorted([(d, ino.id, b"a"), (ROOT_INODE, ino.id, b"b")])
    assert store.ns.lookup(d, b"a") is None and store.ns.lookup(ROOT_INODE, b"b") is None
    assert not store.cas.exists(ino.hash)  # type: ignore[arg-type]


def test_a_successor_sees_exactly_the_references_the_dead_daemon_handed_out(
        store: Store, lifetimes: Lifetimes, written: set[int], kernel: RecordingKernel) -> None:
    """The counts live in a memfd: a successor mapping the supervisor's copy of it knows which inodes the
    kernel holds, keeps those (open, mapped) and frees the rest at once."""
    held = add_file(store, ROOT_INODE, b"open-elsewhere", b"still read by a process")
    dropped = add_file(store, ROOT_INODE, b"gone", b"nobody holds this")
    lifetimes.ref(held.id)
    lifetimes.ref(held.id)
    lifetimes.ref(dropped.id)
    assert lifetimes.unref(dropped.id, 1)
    lifetimes.ref(5_000_000)  # ids far apart: the table grows (sparse)
    unlink(lifetimes, ROOT_INODE, b"open-elsewhere")
    unlink(lifetimes, ROOT_INODE, b"gone")
    supervisors_copy = os.dup(lifetimes.counts.fd)  # the daemon dies; this descriptor is what survives
    successor = Lifetimes(store.ns, store.blobs, Recency(store.ns), written.__contains__, kernel,
                          LookupCounts(supervisors_copy))
    assert successor.referenced(held.id) and not successor.referenced(dropped.id)
    assert successor.referenced(5_000_000)
    assert successor.delete_if_unused(dropped.id) > 0 and store.ns.get(dropped.id) is None
    assert successor.delete_if_unused(held.id) == 0 and store.ns.get(held.id) is not None
    assert not successor.unref(held.id, 1) and successor.unref(held.id, 1)
    assert successor.delete_if_unused(held.id) > 0 and store.ns.get(held.id) is None
