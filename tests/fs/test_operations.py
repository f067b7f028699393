"""The Operations class called directly, no kernel: write path, dedup, lifetimes, errors."""

from __future__ import annotations

import errno
import os
import stat
from types import SimpleNamespace

import pytest
import trio

from mithrilfs import kernel
from mithrilfs.cas import hash_bytes
from mithrilfs.control import CONTROL_NAME
from mithrilfs.fs import Operations
from mithrilfs.writepath import OFFLOAD_MIN
from mithrilfs.namespace import ROOT_INODE
from mithrilfs.store import open_store

CTX = kernel.RequestContext()
RW = os.O_RDWR


@pytest.fixture
def ops(tmp_path):
    store = open_store(tmp_path / "store")
    o = Operations(store)
    yield o
    o.shutdown()
    store.close()


def run(fn, *args):
    return trio.run(fn, *args)


async def _write_file(ops, parent, name, data, mode=0o644):
    fi, attr = await ops.create(parent, name, stat.S_IFREG | mode, os.O_WRONLY, CTX)
    if data:
        assert await ops.write(fi.fh, 0, data) == len(data)
    await ops.flush(fi.fh)
    await ops.release(fi.fh)
    return attr.st_ino


async def _read_file(ops, ino, size=1 << 20):
    fi = await ops.open(ino, os.O_RDONLY, CTX)
    try:
        return await ops.read(fi.fh, 0, size)
    finally:
        await ops.release(fi.fh)


def test_write_commits_to_a_blob_and_reads_back(ops):
    async def t():
        ino = await _write_file(ops, ROOT_INODE, b"a.so", b"\x7fELF payload")
        node = ops.ns.get(ino)
        assert node.hash == hash_bytes(b"\x7fELF payload")
        assert ops.cas.read(node.hash) == b"\x7fELF payload"
        assert (await ops.getattr(ino)).st_size == 12
        assert await _read_file(ops, ino) == b"\x7fELF payload"
        assert os.listdir(ops.cas.staging) == []

    run(t)


def test_identical_files_share_one_blob(ops):
    async def t():
        a = await _write_file(ops, ROOT_INODE, b"a", b"same bytes")
        b = await _write_file(ops, ROOT_INODE, b"b", b"same bytes")
        assert a != b
        h = ops.ns.get(a).hash
        assert h == ops.ns.get(b).hash
        assert ops.ns.refcount(h) == 2
        assert list(ops.cas.iter_digests()) == [h]

    run(t)


def test_uncommitted_write_is_invisible_in_the_index(ops):
    async def t():
        ino = await _write_file(ops, ROOT_INODE, b"f", b"v1")
        fi = await ops.open(ino, RW, CTX)
        await ops.write(fi.fh, 0, b"v2-longer")
        # readers through the mount see the staging content...
        assert await ops.read(fi.fh, 0, 100) == b"v2-longer"
        # ...but the index still points at the committed v1 until close
        assert ops.cas.read(ops.ns.get(ino).hash) == b"v1"
        await ops.flush(fi.fh)
        assert ops.cas.read(ops.ns.get(ino).hash) == b"v2-longer"
        await ops.release(fi.fh)

    run(t)


def test_write_in_place_at_offset_keeps_the_rest(ops):
    async def t():
        ino = await _write_file(ops, ROOT_INODE, b"f", b"0123456789")
        fi = await ops.open(ino, RW, CTX)
        await ops.write(fi.fh, 4, b"XY")
        await ops.write(fi.fh, 12, b"Z")
        await ops.release(fi.fh)
        assert await _read_file(ops, ino) == b"0123XY6789\x00\x00Z"

    run(t)


def test_old_blob_freed_when_content_replaced(ops):
    async def t():
        ino = await _write_file(ops, ROOT_INODE, b"f", b"old")
        old = ops.ns.get(ino).hash
        fi = await ops.open(ino, os.O_WRONLY | os.O_TRUNC, CTX)
        await ops.write(fi.fh, 0, b"new")
        await ops.release(fi.fh)
        assert not ops.cas.exists(old)
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


def test_unlinked_open_file_stays_readable_then_is_freed(ops):
    async def t():
        ino = await _write_file(ops, ROOT_INODE, b"f", b"still here")
        h = ops.ns.get(ino).hash
        await ops.lookup(ROOT_INODE, b"f", CTX)
        fi = await ops.open(ino, os.O_RDONLY, CTX)
        await ops.unlink(ROOT_INODE, b"f", CTX)
        assert (await ops.lookup(ROOT_INODE, b"f", CTX)).st_ino == 0
        assert await ops.read(fi.fh, 0, 100) == b"still here"
        await ops.release(fi.fh)
        assert ops.ns.get(ino) is not None  # the kernel still holds a reference
        await ops.forget([(ino, 2)])  # create + lookup
        assert ops.ns.get(ino) is None
        assert not ops.cas.exists(h)

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
        assert ops.ns.get(b) is None and not ops.cas.exists(old_hash)
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
        await ops.unlink(ROOT_INODE, b"a", CTX)
        assert await _read_file(ops, ops.ns.lookup(ROOT_INODE, b"b")) == b"shared"

    run(t)


def test_setattr_truncate_chmod_utimens(ops):
    async def t():
        ino = await _write_file(ops, ROOT_INODE, b"f", b"abcdef")
        attr = kernel.EntryAttributes()
        attr.st_size = 3
        attr.st_mode = stat.S_IFREG | 0o600
        attr.st_mtime_ns = 1_000_000_000
        fields = SimpleNamespace(
            update_size=True, update_mode=True, update_mtime=True,
            update_atime=False, update_uid=False, update_gid=False,
        )
        out = await ops.setattr(ino, attr, fields, None, CTX)
        assert out.st_size == 3 and stat.S_IMODE(out.st_mode) == 0o600
        assert out.st_mtime_ns == 1_000_000_000
        assert await _read_file(ops, ino) == b"abc"
        assert ops.ns.get(ino).size == 3

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
        fi = await ops.open(pid.st_ino, os.O_RDONLY, CTX)
        assert int(await ops.read(fi.fh, 0, 100)) == os.getpid()
        await ops.release(fi.fh)
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
        await ops.write(fi.fh, 0, b"a" * 100)
        await ops.write(fi.fh, 100, b"b" * 100)  # still sequential
        await ops.write(fi.fh, 50, b"C" * 10)  # overwrite inside the hashed prefix
        await ops.write(fi.fh, 200, b"d" * 10)
        await ops.release(fi.fh)
        content = b"a" * 50 + b"C" * 10 + b"a" * 40 + b"b" * 100 + b"d" * 10
        assert ops.ns.get(attr.st_ino).hash == hash_bytes(content)
        assert await _read_file(ops, attr.st_ino) == content
        fi, _ = await ops.create(ROOT_INODE, b"seq", stat.S_IFREG | 0o644, os.O_RDWR, CTX)
        for i in range(10):
            await ops.write(fi.fh, i * 7, bytes([i]) * 7)
        await ops.release(fi.fh)
        seq = ops.ns.get(ops.ns.lookup(ROOT_INODE, b"seq"))
        assert seq.hash == hash_bytes(b"".join(bytes([i]) * 7 for i in range(10)))

    run(t)
