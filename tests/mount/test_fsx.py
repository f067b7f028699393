"""An fsx-style data-integrity exerciser: random writes, truncates and reads against a model.

Thousands of operations on one file through the mount, checked byte for
byte against an in-memory model after every read.  The seed is in the test
id and in every failure message; MITHRILFS_FSX_SEED=N replays one seed.
"""

from __future__ import annotations

import hashlib
import mmap
import os
import random
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path

import pytest
from conftest import Mount, run_cli

from mithrilfs.cache.staging import WRITE_OFFLOAD_MIN

OPS = 3000
MAX_SIZE = 1 << 20
SEEDS = [int(os.environ["MITHRILFS_FSX_SEED"])] if "MITHRILFS_FSX_SEED" in os.environ else [1, 2, 3]


@pytest.mark.parametrize("seed", SEEDS)
def test_fsx(shared_mnt: Mount, seed: int):
    path = shared_mnt.mountpoint / f"fsx-{seed}"
    model = exercise(path, seed)
    shared_mnt.remount()
    assert path.read_bytes() == bytes(model), f"seed {seed}: after remount"


def exercise(path: Path, seed: int, ops: int = OPS) -> bytearray:
    """*ops* random operations on *path*, each read checked against a model; returns the model.

    Also run in a process of its own (``test_takeover``), while the daemon is killed under it.
    """
    rnd = random.Random(seed)
    model = bytearray()
    fd = os.open(path, os.O_CREAT | os.O_RDWR | os.O_TRUNC, 0o644)
    log: list[str] = []

    def check(what: str, got: bytes, want: bytes) -> None:
        if got != want:
            first = next((i for i, (a, b) in enumerate(zip(got, want)) if a != b), min(len(got), len(want)))
            raise AssertionError(
                f"seed {seed}, op {len(log)} ({what}): {len(got)} bytes read, {len(want)} expected,"
                f" first difference at {first}; last ops: {log[-8:]}"
            )

    try:
        for _ in range(ops):
            op = rnd.random()
            if op < 0.40:
                off = rnd.randrange(0, MAX_SIZE)
                # the last size takes the daemon's worker-thread write path
                sizes = [1, 17, 512, 4096, 65536, rnd.randrange(1, 150000),
                         rnd.randrange(WRITE_OFFLOAD_MIN, 3 * WRITE_OFFLOAD_MIN)]
                data = rnd.randbytes(rnd.choice(sizes))
                log.append(f"write {off}+{len(data)}")
                assert os.pwrite(fd, data, off) == len(data)
                if off > len(model):
                    model.extend(b"\0" * (off - len(model)))
                model[off : off + len(data)] = data
            elif op < 0.50:
                size = rnd.choice([0, rnd.randrange(0, MAX_SIZE), len(model) // 2, len(model) + 1000])
                log.append(f"truncate {size}")
                os.ftruncate(fd, size)
                del model[size:]
                model.extend(b"\0" * (size - len(model)))
            elif op < 0.80:
                off = rnd.randrange(0, max(1, len(model) + 100))
                n = rnd.randrange(1, 200000)
                log.append(f"read {off}+{n}")
                check("read", os.pread(fd, n, off), bytes(model[off : off + n]))
            elif op < 0.88:
                log.append("close+reopen")  # commits to the CAS; reads then come from the blob
                os.close(fd)
                fd = os.open(path, os.O_RDWR)
                assert os.fstat(fd).st_size == len(model), f"seed {seed}: size after reopen"
            elif op < 0.93:
                log.append("fsync")
                os.fsync(fd)
            elif op < 0.97 and model:
                log.append("mmap read")
                with mmap.mmap(fd, len(model), prot=mmap.PROT_READ) as m:
                    check("mmap", m[:], bytes(model))
            else:
                log.append("read whole file by path")
                check("path read", path.read_bytes(), bytes(model))
    finally:
        os.close(fd)
    check("final", path.read_bytes(), bytes(model))
    return model


def _write_file(path: str, seed: int, size: int, chunk: int, sequential: bool) -> str:
    """Write *size* random bytes in *chunk* pieces, in order or shuffled; return what the file must hold."""
    rnd = random.Random(seed)
    data = rnd.randbytes(size)
    offsets = list(range(0, size, chunk))
    if not sequential:
        rnd.shuffle(offsets)
    fd = os.open(path, os.O_CREAT | os.O_WRONLY | os.O_TRUNC, 0o644)
    try:
        for off in offsets:
            piece = data[off : off + chunk]
            assert os.pwrite(fd, piece, off) == len(piece)
        os.fsync(fd)  # a commit point
    finally:
        os.close(fd)
    return hashlib.sha256(data).hexdigest()


def test_big_writes_from_parallel_processes(mnt: Mount):
    """1 MiB writes (hashed in worker threads) from several processes at once, in order and
    shuffled: every file reads back whole, and after a remount, which re-hashes each blob on
    first open, and fsck, which re-hashes them all, every blob still matches its name."""
    jobs = [(str(mnt.mountpoint / f"big{i}"), i, (6 << 20) + i * 4099, 1 << 20, i % 2 == 0) for i in range(4)]
    jobs.append((str(mnt.mountpoint / "copy0"), 0, (6 << 20), 1 << 20, True))  # same bytes as big0: dedup
    with ProcessPoolExecutor(len(jobs)) as pool:
        want = list(pool.map(_write_file, *zip(*jobs)))
    assert mnt.stats()["dedup_hits"] == 1
    mnt.remount()
    for (path, *_), digest in zip(jobs, want):
        assert hashlib.sha256(open(path, "rb").read()).hexdigest() == digest, path
    stats = mnt.stats()
    assert stats["blobs"] == len(jobs) - 1 and stats["corrupt_blobs"] == 0, stats
    mnt.umount()
    fsck = run_cli("fsck", "--store", str(mnt.store))
    assert fsck.returncode == 0 and "no problems" in fsck.stdout, fsck.stdout + fsck.stderr
