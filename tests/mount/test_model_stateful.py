"""Hypothesis drives random file operations on the mount and on a plain directory side by side.

After every step the results (data or errno) must agree, and so must the
whole tree: names, kinds, sizes, contents.
"""

from __future__ import annotations

import errno
import itertools
import os
import shutil
import tempfile
from pathlib import Path

import pytest
from conftest import Mount
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, rule, run_state_machine_as_test

NAMES = ["a", "b", "d/a", "d/b", "d/e/c", "e", "d/e"]
DIRS = ["d", "d/e", "e", "f"]
PATHS = st.sampled_from(NAMES + DIRS)
DATA = st.binary(max_size=3000) | st.sampled_from([b"", b"x" * 70000])
# errnos that POSIX lets filesystems choose between for the same mistake
_SAME = {errno.EEXIST: errno.ENOTEMPTY}


def _outcome(fn, *args):
    try:
        return ("ok", fn(*args))
    except OSError as e:
        return ("err", _SAME.get(e.errno, e.errno))


def _snapshot(root: Path) -> dict[str, object]:
    tree: dict[str, object] = {}
    for dirpath, dirnames, filenames in os.walk(root):
        rel = os.path.relpath(dirpath, root)
        for d in dirnames:
            tree[os.path.normpath(os.path.join(rel, d))] = "dir"
        for f in filenames:
            p = Path(dirpath) / f
            tree[os.path.normpath(os.path.join(rel, f))] = (p.stat().st_size, p.read_bytes())
    return tree


_counter = itertools.count()


@pytest.fixture(scope="module")
def model_mount(shared_mnt: Mount):
    return shared_mnt


class FsModel(RuleBasedStateMachine):
    mount_root: Path

    @initialize()
    def setup_dirs(self):
        n = next(_counter)
        self.on_mount = self.mount_root / f"model{n}"
        self.on_plain = Path(tempfile.mkdtemp(prefix="mithrilfs-model-"))
        self.on_mount.mkdir()

    def teardown(self):
        shutil.rmtree(self.on_plain, ignore_errors=True)
        shutil.rmtree(self.on_mount, ignore_errors=True)

    def both(self, fn, *rels):
        a = _outcome(fn, *(self.on_mount / r for r in rels))
        b = _outcome(fn, *(self.on_plain / r for r in rels))
        assert a == b, f"{fn.__name__}{rels}: mount {a} != plain {b}"
        return a

    @rule(path=PATHS, data=DATA)
    def create(self, path, data):
        def op(p):
            with open(p, "wb") as f:
                f.write(data)
        self.both(op, path)

    @rule(path=PATHS)
    def create_exclusive(self, path):
        def op(p):
            os.close(os.open(p, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644))
        self.both(op, path)

    @rule(path=PATHS, offset=st.integers(0, 80000), data=st.binary(min_size=1, max_size=2000))
    def write_at(self, path, offset, data):
        def op(p):
            fd = os.open(p, os.O_RDWR)
            try:
                return os.pwrite(fd, data, offset)
            finally:
                os.close(fd)
        self.both(op, path)

    @rule(path=PATHS, data=st.binary(min_size=1, max_size=500))
    def append(self, path, data):
        def op(p):
            with open(p, "ab") as f:
                f.write(data)
        self.both(op, path)

    @rule(path=PATHS, size=st.integers(0, 10) | st.integers(0, 90000))
    def truncate(self, path, size):
        self.both(lambda p: os.truncate(p, size), path)

    @rule(src=PATHS, dst=PATHS)
    def rename(self, src, dst):
        self.both(os.rename, src, dst)

    @rule(src=PATHS, dst=PATHS)
    def link(self, src, dst):
        self.both(os.link, src, dst)

    @rule(path=PATHS)
    def unlink(self, path):
        self.both(os.unlink, path)

    @rule(path=PATHS)
    def mkdir(self, path):
        self.both(os.mkdir, path)

    @rule(path=PATHS)
    def rmdir(self, path):
        self.both(os.rmdir, path)

    @rule(path=PATHS)
    def read(self, path):
        def op(p):
            with open(p, "rb") as f:
                return f.read()
        self.both(op, path)

    @rule(path=PATHS)
    def listdir(self, path):
        self.both(lambda p: sorted(os.listdir(p)), path)

    @invariant()
    def trees_agree(self):
        if hasattr(self, "on_mount"):
            assert _snapshot(self.on_mount) == _snapshot(self.on_plain)


def test_mount_behaves_like_a_plain_directory(model_mount: Mount):
    FsModel.mount_root = model_mount.mountpoint
    run_state_machine_as_test(
        FsModel,
        settings=settings(max_examples=60, stateful_step_count=25, deadline=None,
                          suppress_health_check=list(HealthCheck)),
    )
