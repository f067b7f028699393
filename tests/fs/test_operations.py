"""The Operations class called directly, no kernel: write path, commit points, dedup, lifetimes, errors.

The kernel opens files itself (OPEN and FLUSH get ENOSYS), so these calls
look like what it sends: CREATE, then WRITE/READ/SETATTR/FSYNC by inode.
"""

from __future__ import annotations

import errno
import os
import stat
from types import SimpleNamespace

import pytest
import trio

from mithrilfs import kernel
from mithrilfs.cache.lifetime import NoKernelCaches
from mithrilfs.cache.policy import EvictionPolicy
from mithrilfs.cache.staging import OFFLOAD_MIN
from mithrilfs.control.files import CONTROL_NAME
from mithrilfs.daemon.duties import Duties
from mithrilfs.daemon.wiring import build
from mithrilfs.store.cas import hash_bytes
from mithrilfs.store.namespace import ROOT_INODE
from mithrilfs.store.open import open_store

CTX = kernel.RequestContext()


#: Each filesystem's duties, for ``shutdown`` (a clean unmount's tidy-up).
_DUTIES: dict[object, Duties] = {}


def Operations(store):
    """The filesystem of *store* as a mount builds it (``daemon.wiring``), with no kernel to notify."""
    mounted = build(store, EvictionPolicy(), NoKernelCaches())
    _DUTIES[mounted.ops] = mounted.duties
    return mounted.ops


def shutdown(ops) -> None:
    """What a clean unmount does after the kernel let go (``Duties.shutdown``)."""
    _DUTIES.pop(ops).shutdown()


@pytest.fixture
def ops(tmp_path):
    store = open_store(tmp_path / "store")
    o = Operations(store)
    yield o
    shutdown(o)
    store.close()


def run(fn, *args):
    return trio.run(fn, *args)


async def _write_file(ops, parent, name, data, mode=0o644):
    """Create and write a file, then fsync it (a commit point)."""
    fi, attr = await ops.create(parent, name, stat.S_IFREG | mode, os.O_WRONLY, CTX)
    assert fi.fh == 0  # no handles
    if data:
        assert await ops.write(attr.st_ino, 0, 0, data) == len(data)
    await ops.fsync(attr.st_ino, 0, False)
    return attr.st_ino


async def _read_file(ops, ino, size=1 << 20):
    return await ops.read(ino, 0, 0, size)


def _fields(**set_):
    names = ("update_size", "update_mode", "update_mtime", "update_atime", "update_uid", "update_gid")
    return SimpleNamespace(**{n: set_.get(n, False) for n in names})


async def _truncate(ops, ino, size, fh=0):
    attr = kernel.EntryAttributes()
    attr.st_size = size
    return await ops.setattr(ino, attr, _fields(update_size=True), fh, CTX)


def test_write_commits_to_a_blob_and_reads_back(ops):
    async def t():
        ino = await _write_file(ops, ROOT_INODE, b"a.so", b"\x7fELF payload")
        node = ops.ns.get(ino)
        assert node.hash == hash_bytes(b"\x7fELF payload")
        assert ops.store.cas.read(node.hash) == b"\x7fELF payload"
        assert (await ops.getattr(ino)).st_size == 12
        assert await _read_file(ops, ino) == b"\x7fELF payload"
        assert os.listdir(ops.store.cas.staging) == []

    run(t)


def test_identical_files_share_one_blob(ops):
    async def t():
        a = await _write_file(ops, ROOT_INODE, b"a", b"same bytes")
        b = await _write_file(ops, ROOT_INODE, b"b", b"same bytes")
        assert a != b
        h = ops.ns.get(a).hash
        assert h == ops.ns.get(b).hash
        assert ops.ns.refcount(h) == 2
        assert list(ops.store.cas.iter_digests()) == [h]

    run(t)


def test_open_and_flush_are_left_to_the_kernel(ops):
    async def t():
        ino = await _write_file(ops, ROOT_INODE, b"f", b"x")
        for call in (ops.open(ino, os.O_RDONLY, CTX), ops.flush(ino, 0)):
            with pytest.raises(kernel.FUSEError) as e:
                await call
            assert e.value.errno == errno.ENOSYS  # the kernel then opens and closes files itself

    run(t)


def test_uncommitted_write_is_invisible_in_the_index(ops):
    async def t():
        ino = await _write_file(ops, ROOT_INODE, b"f", b"v1")
        await ops.write(ino, 0, 0, b"v2-longer")
        # readers through the mount see the staging content...
        assert await ops.read(ino, 0, 0, 100) == b"v2-longer"
        assert (await ops.getattr(ino)).st_size == 9
        # ...but the index still points at the committed v1 until a commit point
        assert ops.store.cas.read(ops.ns.get(ino).hash) == b"v1"
        await ops.fsync(ino, 0, False)
        assert ops.store.cas.read(ops.ns.get(ino).hash) == b"v2-longer"
        assert ino not in ops.writes.staged

    run(t)


def test_write_in_place_at_offset_keeps_the_rest(ops):
    async def t():
        ino = await _write_file(ops, ROOT_INODE, b"f", b"0123456789")
        await ops.write(ino, 0, 4, b"XY")
        await ops.write(ino, 0, 12, b"Z")
        assert await _read_file(ops, ino) == b"0123XY6789\x00\x00Z"
        await ops.fsync(ino, 0, False)
        assert ops.store.cas.read(ops.ns.get(ino).hash) == b"0123XY6789\x00\x00Z"

    run(t)


def test_old_blob_freed_when_content_replaced(ops):
    async def t():
        ino = await _write_file(ops, ROOT_INODE, b"f", b"old")
        old = ops.ns.get(ino).hash
        await _truncate(ops, ino, 0)  # O_TRUNC arrives as SETATTR(size=0) with a file
        assert ops.ns.get(ino).hash == old  # the writer goes on: nothing committed yet
        await ops.write(ino, 0, 0, b"new")
        await ops.rename(ROOT_INODE, b"f", ROOT_INODE, b"g", 0, CTX)
        assert not ops.store.cas.exists(old)
        assert ops.ns.refcount(old) is None
        assert await _read_file(ops, ino) == b"new"

    run(t)


def test_large_file_is_hashed_off_loop_and_committed(ops):
    data = os.urandom(OFFLOAD_MIN * 2 + 5)

    async def t():
        ino = await _write_file(ops, ROOT_INODE, b"big", data)
        assert ops.ns.get(ino).hash == hash_bytes(data)
        assert await _read_file(ops, ino, len(data)) == data

    run(t)


def test_unlinked_file_stays_readable_until_forget(ops):
    async def t():
        ino = await _write_file(ops, ROOT_INODE, b"f", b"still here")
        h = ops.ns.get(ino).hash
        await ops.lookup(ROOT_INODE, b"f", CTX)
        await ops.unlink(ROOT_INODE, b"f", CTX)
        assert (await ops.lookup(ROOT_INODE, b"f", CTX)).st_ino == 0
        assert await ops.read(ino, 0, 0, 100) == b"still here"  # the kernel still holds it
        await ops.write(ino, 0, 0, b"STILL")  # an unlinked file can still be written
        assert await ops.read(ino, 0, 0, 100) == b"STILL here"
        await ops.forget([(ino, 1)])
        assert ops.ns.get(ino) is not None
        await ops.forget([(ino, 1)])  # create + lookup: the last reference
        assert ops.ns.get(ino) is None
        assert not ops.store.cas.exists(h) and ino not in ops.writes.staged
        assert os.listdir(ops.store.cas.staging) == []

    run(t)


def test_evicted_file_the_kernel_holds_keeps_its_content_until_forget(ops):
    async def t():
        ino = await _write_file(ops, ROOT_INODE, b"kernel.so", b"machine code" * 100)
        h = ops.ns.get(ino).hash
        ops.policy.min_age = 0
        result = await ops.budget.evictor.run(0, reason="gc")
        assert result.files == 1 and result.deferred_bytes == 1200
        assert ops.ns.lookup(ROOT_INODE, b"kernel.so") is None  # the name goes at once
        assert ops.budget.physical() == 1200  # the bytes count until the kernel lets go
        assert await ops.read(ino, 0, 0, 100) == (b"machine code" * 100)[:100]
        await ops.forget([(ino, 1)])
        assert ops.budget.physical() == 0 and not ops.store.cas.exists(h)

    run(t)


def test_rename_replaces_target_atomically_and_frees_it(ops):
    async def t():
        a = await _write_file(ops, ROOT_INODE, b"tmp", b"new content")
        b = await _write_file(ops, ROOT_INODE, b"final", b"old content")
        old_hash = ops.ns.get(b).hash
        await ops.rename(ROOT_INODE, b"tmp", ROOT_INODE, b"final", 0, CTX)
        assert ops.ns.lookup(ROOT_INODE, b"final") == a
        assert ops.ns.lookup(ROOT_INODE, b"tmp") is None
        await ops.forget([(b, 1)])
        assert ops.ns.get(b) is None and not ops.store.cas.exists(old_hash)
        with pytest.raises(kernel.FUSEError) as e:
            await _write_file(ops, ROOT_INODE, b"other", b"x")
            await ops.rename(ROOT_INODE, b"other", ROOT_INODE, b"final", kernel.RENAME_NOREPLACE, CTX)
        assert e.value.errno == errno.EEXIST

    run(t)


def test_rename_directory_into_itself_is_refused(ops):
    async def t():
        d = await ops.mkdir(ROOT_INODE, b"d", 0o755, CTX)
        sub = await ops.mkdir(d.st_ino, b"sub", 0o755, CTX)
        with pytest.raises(kernel.FUSEError) as e:
            await ops.rename(ROOT_INODE, b"d", sub.st_ino, b"x", 0, CTX)
        assert e.value.errno == errno.EINVAL

    run(t)


def test_directory_rules(ops):
    async def t():
        d = await ops.mkdir(ROOT_INODE, b"d", 0o755, CTX)
        assert (await ops.getattr(ROOT_INODE)).st_nlink == 3
        await _write_file(ops, d.st_ino, b"f", b"x")
        for call, code in (
            (ops.mkdir(ROOT_INODE, b"d", 0o755, CTX), errno.EEXIST),
            (ops.rmdir(ROOT_INODE, b"d", CTX), errno.ENOTEMPTY),
            (ops.unlink(ROOT_INODE, b"d", CTX), errno.EISDIR),
            (ops.rmdir(d.st_ino, b"f", CTX), errno.ENOTDIR),
        ):
            with pytest.raises(kernel.FUSEError) as e:
                await call
            assert e.value.errno == code
        await ops.unlink(d.st_ino, b"f", CTX)
        await ops.rmdir(ROOT_INODE, b"d", CTX)
        assert (await ops.getattr(ROOT_INODE)).st_nlink == 2

    run(t)


def test_hard_links_share_an_inode(ops):
    async def t():
        ino = await _write_file(ops, ROOT_INODE, b"a", b"shared")
        attr = await ops.link(ino, ROOT_INODE, b"b", CTX)
        assert attr.st_ino == ino and attr.st_nlink == 2
        await ops.write(ino, 0, 0, b"SH")
        await ops.link(ino, ROOT_INODE, b"c", CTX)  # a link commits what the inode holds
        assert ops.store.cas.read(ops.ns.get(ino).hash) == b"SHared"
        await ops.unlink(ROOT_INODE, b"c", CTX)
        await ops.unlink(ROOT_INODE, b"a", CTX)
        assert await _read_file(ops, ops.ns.lookup(ROOT_INODE, b"b")) == b"SHared"

    run(t)


def test_setattr_truncate_chmod_utimens(ops):
    async def t():
        ino = await _write_file(ops, ROOT_INODE, b"f", b"abcdef")
        attr = kernel.EntryAttributes()
        attr.st_size = 3
        attr.st_mode = stat.S_IFREG | 0o600
        attr.st_mtime_ns = 1_000_000_000
        fields = _fields(update_size=True, update_mode=True, update_mtime=True)
        out = await ops.setattr(ino, attr, fields, None, CTX)  # the chmod commits the truncate
        assert out.st_size == 3 and stat.S_IMODE(out.st_mode) == 0o600
        assert out.st_mtime_ns == 1_000_000_000
        assert await _read_file(ops, ino) == b"abc"
        assert ops.ns.get(ino).size == 3 and ino not in ops.writes.staged
        # GNU ld writes its output in place, then chmods it: the chmod commits
        await ops.write(ino, 0, 3, b"def")
        assert ops.ns.get(ino).size == 3
        attr.st_mode = stat.S_IFREG | 0o755
        await ops.setattr(ino, attr, _fields(update_mode=True), None, CTX)
        assert ops.store.cas.read(ops.ns.get(ino).hash) == b"abcdef" and ino not in ops.ns.unconfirmed

    run(t)


def test_symlink(ops):
    async def t():
        attr = await ops.symlink(ROOT_INODE, b"l", b"target/path", CTX)
        assert stat.S_ISLNK(attr.st_mode) and attr.st_size == 11
        assert await ops.readlink(attr.st_ino, CTX) == b"target/path"

    run(t)


def test_xattrs_are_refused_not_crashed(ops):
    async def t():
        for call in (
            ops.getxattr(ROOT_INODE, b"user.x", CTX),
            ops.setxattr(ROOT_INODE, b"user.x", b"1", CTX),
            ops.listxattr(ROOT_INODE, CTX),
            ops.removexattr(ROOT_INODE, b"user.x", CTX),
        ):
            with pytest.raises(kernel.FUSEError) as e:
                await call
            assert e.value.errno == errno.ENOSYS  # the kernel turns it into ENOTSUP

    run(t)


def test_control_directory_is_reachable_but_protected(ops):
    async def t():
        attr = await ops.lookup(ROOT_INODE, CONTROL_NAME, CTX)
        assert stat.S_ISDIR(attr.st_mode)
        pid = await ops.lookup(attr.st_ino, b"pid", CTX)
        assert int(await ops.read(pid.st_ino, 0, 0, 100)) == os.getpid()
        gc = await ops.lookup(attr.st_ino, b"gc", CTX)
        assert await ops.write(gc.st_ino, 0, 0, b"run") == 3
        answer = await ops.getattr(gc.st_ino)  # the kernel asks before every read (no attribute caching)
        assert answer.attr_timeout == 0 and answer.st_size > 0
        assert b'"units"' in await ops.read(gc.st_ino, 0, 0, answer.st_size)  # a short read ends it
        with pytest.raises(kernel.FUSEError) as e:
            await ops.write(pid.st_ino, 0, 0, b"1")
        assert e.value.errno == errno.EPERM
        for call in (
            ops.mkdir(ROOT_INODE, CONTROL_NAME, 0o755, CTX),
            ops.rmdir(ROOT_INODE, CONTROL_NAME, CTX),
            ops.create(attr.st_ino, b"x", 0o644, os.O_WRONLY, CTX),
        ):
            with pytest.raises(kernel.FUSEError) as e:
                await call
            assert e.value.errno == errno.EPERM

    run(t)


def test_missing_name_is_a_cacheable_negative_entry(ops):
    async def t():
        attr = await ops.lookup(ROOT_INODE, b"nope", CTX)
        assert attr.st_ino == 0 and attr.entry_timeout > 0

    run(t)


def test_out_of_order_writes_hash_the_final_content(ops):
    """The running hash of sequential writes must be dropped when a write lands elsewhere."""

    async def t():
        fi, attr = await ops.create(ROOT_INODE, b"ooo", stat.S_IFREG | 0o644, os.O_RDWR, CTX)
        ino = attr.st_ino
        await ops.write(ino, 0, 0, b"a" * 100)
        await ops.write(ino, 0, 100, b"b" * 100)  # still sequential
        await ops.write(ino, 0, 50, b"C" * 10)  # overwrite inside the hashed prefix
        await ops.write(ino, 0, 200, b"d" * 10)
        await ops.fsync(ino, 0, False)
        content = b"a" * 50 + b"C" * 10 + b"a" * 40 + b"b" * 100 + b"d" * 10
        assert ops.ns.get(attr.st_ino).hash == hash_bytes(content)
        assert await _read_file(ops, attr.st_ino) == content
        fi, seq_attr = await ops.create(ROOT_INODE, b"seq", stat.S_IFREG | 0o644, os.O_RDWR, CTX)
        for i in range(10):
            await ops.write(seq_attr.st_ino, 0, i * 7, bytes([i]) * 7)
        await ops.forget([(seq_attr.st_ino, 1)])  # the kernel let go: no process has it open
        seq = ops.ns.get(ops.ns.lookup(ROOT_INODE, b"seq"))
        assert seq.hash == hash_bytes(b"".join(bytes([i]) * 7 for i in range(10)))

    run(t)


def test_rename_commits_and_confirms_an_idle_commit(ops):
    async def t():
        fi, attr = await ops.create(ROOT_INODE, b"tmp", stat.S_IFREG | 0o644, os.O_WRONLY, CTX)
        ino = attr.st_ino
        await ops.write(ino, 0, 0, b"half")
        assert [of.inode.id for of in ops.writes.idle(float("inf"))] == [ino]
        await ops.writes.commit(ops.writes.staged[ino], confirmed=False)  # what the idle timer does
        assert ino in ops.ns.unconfirmed
        assert ops.ns.db.execute("SELECT inode FROM unconfirmed").fetchall() == [(ino,)]
        await ops.write(ino, 0, 4, b" and the rest")
        await ops.rename(ROOT_INODE, b"tmp", ROOT_INODE, b"final", 0, CTX)
        assert ops.store.cas.read(ops.ns.get(ino).hash) == b"half and the rest"
        assert ino not in ops.ns.unconfirmed
        assert ops.ns.db.execute("SELECT count(*) FROM unconfirmed").fetchone() == (0,)

    run(t)


def test_unclean_stop_drops_unconfirmed_names_clean_one_keeps_them(tmp_path):
    async def write_idle(ops, name):
        fi, attr = await ops.create(ROOT_INODE, name, stat.S_IFREG | 0o644, os.O_WRONLY, CTX)
        await ops.write(attr.st_ino, 0, 0, b"maybe a paused writer")
        await ops.writes.commit(ops.writes.staged[attr.st_ino], confirmed=False)

    async def write_renamed(ops, name):
        await _write_file(ops, ROOT_INODE, b"tmp", b"published")
        await ops.rename(ROOT_INODE, b"tmp", ROOT_INODE, name, 0, CTX)

    store = open_store(tmp_path / "s")
    store.ns.recover()
    ops = Operations(store)
    trio.run(write_idle, ops, b"idle")
    trio.run(write_renamed, ops, b"renamed")
    store.close()  # killed: no shutdown, the store is not marked clean
    store = open_store(tmp_path / "s")
    report = store.ns.recover()
    assert report["unconfirmed_names_dropped"] == 1
    assert store.ns.lookup(ROOT_INODE, b"idle") is None
    assert store.ns.lookup(ROOT_INODE, b"renamed") is not None
    ops = Operations(store)
    trio.run(write_idle, ops, b"idle2")
    shutdown(ops)  # a clean stop keeps them (still unconfirmed)
    store.close()
    store = open_store(tmp_path / "s")
    assert store.ns.recover()["unconfirmed_names_dropped"] == 0
    assert store.ns.lookup(ROOT_INODE, b"idle2") is not None
    store.close()


def test_first_read_verifies_the_blob(ops):
    async def t():
        ino = await _write_file(ops, ROOT_INODE, b"victim.so", b"original kernel bytes")
        other = await _write_file(ops, ROOT_INODE, b"alias.so", b"original kernel bytes")
        digest = ops.ns.get(ino).hash
        path = ops.store.cas.path(digest)
        os.chmod(path, 0o644)
        with open(path, "wb") as f:
            f.write(b"evil kernel bytes!!!!")
        ops.store.blobs.verified.discard(digest)  # a new mount has verified nothing
        with pytest.raises(kernel.FUSEError) as e:
            await ops.read(ino, 0, 0, 100)
        assert e.value.errno == errno.EIO  # never the bad bytes
        await ops.lookup(ROOT_INODE, b"good", CTX)
        with pytest.raises(kernel.FUSEError) as e:
            await ops.read(ino, 0, 0, 100)  # the kernel retries a failed read: never an empty file either
        assert e.value.errno == errno.EIO
        assert ops.ns.lookup(ROOT_INODE, b"victim.so") is None and ops.ns.lookup(ROOT_INODE, b"alias.so") is None
        assert ops.ns.get(other).nlink == 0

    run(t)


def test_staging_in_memory_and_in_files_reads_and_commits_alike(ops, monkeypatch):
    """Small files stage in memory, larger ones (or past the memory cap) in staging files; holes,
    truncates and a file growing from one to the other read back and commit the same, and the
    staging byte total returns to zero."""
    from mithrilfs.cache import staging

    async def t():
        attr = (await ops.create(ROOT_INODE, b"grow", stat.S_IFREG | 0o644, os.O_WRONLY, CTX))[1]
        ino = attr.st_ino
        await ops.write(ino, 0, 0, b"head")
        await ops.write(ino, 0, 10, b"tail")  # a hole of 6 zero bytes
        of = ops.writes.staged[ino]
        assert of.mem is not None and os.listdir(ops.store.cas.staging) == []
        assert await ops.read(ino, 0, 0, 100) == b"head" + bytes(6) + b"tail"
        assert ops.writes.staging_bytes() == 14
        await _truncate(ops, ino, 2)
        await _truncate(ops, ino, 5)
        assert await ops.read(ino, 0, 0, 100) == b"he\0\0\0"
        big = os.urandom(staging.MEM_STAGING_MAX)
        await ops.write(ino, 0, 5, big)  # past the in-memory size: moves to a staging file
        assert of.mem is None and len(os.listdir(ops.store.cas.staging)) == 1
        assert await ops.read(ino, 0, 0, 1 << 20) == b"he\0\0\0" + big
        assert ops.writes.staging_bytes() == 5 + len(big)
        await ops.fsync(ino, 0, False)
        assert ops.store.cas.read(ops.ns.get(ino).hash) == b"he\0\0\0" + big
        assert ops.writes.staging_bytes() == 0 and os.listdir(ops.store.cas.staging) == []
        # a rewrite in place starts as an in-memory copy of the blob when it is small
        small = await _write_file(ops, ROOT_INODE, b"small", b"0123456789")
        await ops.write(small, 0, 3, b"abc")
        assert ops.writes.staged[small].mem is not None
        assert await ops.read(small, 0, 0, 100) == b"012abc6789"
        # with the memory cap reached, new staging goes to a file
        monkeypatch.setattr(staging, "MEM_STAGING_TOTAL", 0)
        other = (await ops.create(ROOT_INODE, b"other", stat.S_IFREG | 0o644, os.O_WRONLY, CTX))[1].st_ino
        await ops.write(other, 0, 0, b"on disk")
        assert ops.writes.staged[other].mem is None and ops.writes.staged[other].staging_fd is not None
        await ops.fsync(small, 0, False)
        await ops.fsync(other, 0, False)
        assert ops.store.cas.read(ops.ns.get(small).hash) == b"012abc6789"
        assert ops.store.cas.read(ops.ns.get(other).hash) == b"on disk"
        assert ops.writes.staging_bytes() == 0 and ops.writes._mem_bytes == 0
        assert os.listdir(ops.store.cas.staging) == []

    run(t)


def test_idle_commit_of_many_small_files_in_batches(ops, monkeypatch):
    """The idle timer commits files staged in memory in batches (unconfirmed, deduplicated, counted);
    a large file and one removed meanwhile are left to the one-by-one path."""
    from mithrilfs.cache import staging, writepath

    monkeypatch.setattr(writepath, "COMMIT_BATCH_MAX", 3)

    async def t():
        inos = {}
        for i in range(7):
            data = b"same" if i in (2, 3) else f"file {i}".encode()
            attr = (await ops.create(ROOT_INODE, f"f{i}".encode(), stat.S_IFREG | 0o644, os.O_WRONLY, CTX))[1]
            await ops.write(attr.st_ino, 0, 0, data)
            inos[attr.st_ino] = data
        big = (await ops.create(ROOT_INODE, b"big", stat.S_IFREG | 0o644, os.O_WRONLY, CTX))[1].st_ino
        await ops.write(big, 0, 0, os.urandom(staging.MEM_STAGING_MAX + 1))
        blobs_before = ops.store.blobs.bytes
        left = await ops.writes.commit_idle(ops.writes.idle(float("inf")))
        assert [of.inode.id for of in left] == [big]
        for ino, data in inos.items():
            node = ops.ns.get(ino)
            assert ops.store.cas.read(node.hash) == data and node.size == len(data)
            assert ino in ops.ns.unconfirmed and ino not in ops.writes.staged
            assert await ops.read(ino, 0, 0, 100) == data
        assert ops.ns.refcount(hash_bytes(b"same")) == 2
        assert ops.store.blobs.bytes - blobs_before == sum(len(d) for d in set(inos.values()))
        assert ops.writes.staging_bytes() == left[0].size
        assert os.listdir(ops.store.cas.staging) == [os.path.basename(left[0].staging_path)]

    run(t)
