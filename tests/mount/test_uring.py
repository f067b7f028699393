"""FUSE over io_uring: a mount served from io_uring entries answers ordinary file APIs from other processes.

The daemon asks for it with ``MITHRILFS_FUSE_URING=1``; the kernel offers
it only while the fuse module's ``enable_uring`` is Y.  As root the test
sets it for its own duration and puts the old value back; without the
parameter (a kernel built without ``CONFIG_FUSE_IO_URING``) or the right
to write it, it is skipped with the reason.  The same mount with the
parameter N falls back to /dev/fuse by itself, and ``status`` says which
transport serves.
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import run_cli

pytestmark = pytest.mark.timeout(300)

PARAMETER = Path("/sys/module/fuse/parameters/enable_uring")
ENV = {"MITHRILFS_FUSE_URING": "1"}

#: Another process writes files of several sizes, reads them back through ordinary APIs and prints their digests.
CLIENT = r"""
import hashlib, os, sys
root = sys.argv[1]
os.makedirs(os.path.join(root, "d", "e"), exist_ok=True)
out = []
for i, size in enumerate((0, 1, 4096, 65_537, 3 * 1024 * 1024 + 5)):
    data = os.urandom(size)
    p = os.path.join(root, "d", "e", f"f{i}")
    with open(p, "wb") as f:
        f.write(data)
    os.rename(p, p + ".done")
    with open(p + ".done", "rb") as f:
        back = f.read()
    assert back == data, (p, len(back), size)
    assert os.stat(p + ".done").st_size == size
    out.append(f"f{i}.done {hashlib.sha256(data).hexdigest()}")
assert sorted(os.listdir(os.path.join(root, "d", "e"))) == sorted(f"f{i}.done" for i in range(5))
os.unlink(os.path.join(root, "d", "e", "f0.done"))
print("\n".join(out[1:]))
"""


def _set(value: str) -> None:
    PARAMETER.write_text(value)


@pytest.fixture
def uring_enabled() -> Iterator[None]:
    """``enable_uring`` = Y for the test (and its old value back after it)."""
    if not PARAMETER.exists():
        pytest.skip("this kernel has no FUSE over io_uring (no /sys/module/fuse/parameters/enable_uring)")
    before = PARAMETER.read_text().strip()
    if before != "Y":
        try:
            _set("Y")
        except OSError as e:
            pytest.skip(f"cannot set {PARAMETER} to Y ({e.strerror}): needs root")
    try:
        yield
    finally:
        if before != "Y":
            _set(before)


def _status(mountpoint: Path) -> str:
    res = run_cli("status", str(mountpoint), check=True)
    lines = [line for line in res.stdout.splitlines() if "requests served over" in line]
    assert len(lines) == 1, res.stdout
    return lines[0]


def test_a_mount_served_over_io_uring_answers_other_processes_with_the_right_bytes(mount_factory, uring_enabled):
    m = mount_factory(env=ENV)
    assert "io_uring (" in _status(m.mountpoint)
    res = subprocess.run([sys.executable, "-c", CLIENT, str(m.mountpoint)], capture_output=True, text=True,
                         timeout=240)
    assert res.returncode == 0, res.stderr
    # the bytes again, read by yet another process after the writer is gone
    for line in res.stdout.splitlines():
        name, digest = line.split()
        data = subprocess.run(["cat", str(m.mountpoint / "d" / "e" / name)], capture_output=True, check=True,
                              timeout=60).stdout
        assert hashlib.sha256(data).hexdigest() == digest
    assert not (m.mountpoint / "d" / "e" / "f0.done").exists()
    line = _status(m.mountpoint)  # still the ring serving, not a fallback, and it brought the requests
    assert "io_uring (" in line and int(line.split(" entries, ")[1].split()[0]) > 50, line
    m.umount()
    m.mount()  # and what was written is there after a remount
    assert (m.mountpoint / "d" / "e" / "f1.done").stat().st_size == 1
    # the head starts handlers leave after their replies (a directory's names, a file's blob) run over io_uring
    # too: nothing else wakes the /dev/fuse loop that runs them when the ring serves
    for name in ("f2.done", "f3.done", "f4.done"):
        subprocess.run(["cat", str(m.mountpoint / "d" / "e" / name)], capture_output=True, check=True, timeout=60)
    stats = json.loads((m.mountpoint / ".mithrilfs" / "stats.json").read_text())
    assert stats["requests"].get("AFTER_REPLY", {}).get("count", 0) >= 1, stats["requests"]


def test_without_the_kernel_s_consent_the_mount_falls_back_to_dev_fuse(mount_factory):
    if not PARAMETER.exists():
        pytest.skip("this kernel has no FUSE over io_uring: nothing to fall back from")
    if PARAMETER.read_text().strip() == "Y":
        pytest.skip("enable_uring is Y on this machine: the kernel offers io_uring to every mount")
    m = mount_factory(env=ENV)
    line = _status(m.mountpoint)
    assert "/dev/fuse read/write" in line and "does not offer" in line
    (m.mountpoint / "x").write_bytes(b"abc")
    assert subprocess.run(["cat", str(m.mountpoint / "x")], capture_output=True, check=True).stdout == b"abc"


def test_status_names_dev_fuse_when_io_uring_is_not_asked_for(mount_factory):
    m = mount_factory()
    assert _status(m.mountpoint).strip().startswith("requests served over /dev/fuse read/write;")
    assert os.path.ismount(m.mountpoint)


#: A client asking a round trip back to back: TCGETS on an open file of the mount (what ``isatty()`` asks,
#: answered ENOSYS, which the kernel turns into ENOTTY), N times.
IOCTLS = r"""
import fcntl, os, sys, termios
fd = os.open(sys.argv[1], os.O_RDONLY)
for _ in range(int(sys.argv[2])):
    try:
        fcntl.ioctl(fd, termios.TCGETS, bytes(64))
    except OSError:
        pass
"""


def _sleeps(pid: int) -> int:
    """How often the daemon's main thread (its event loop) has gone to sleep so far."""
    status = Path(f"/proc/{pid}/task/{pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("voluntary_ctxt_switches")))


def test_over_io_uring_the_daemon_polls_for_the_next_request_instead_of_sleeping_after_each(mount_factory,
                                                                                           uring_enabled):
    """As the /dev/fuse reader does, the io_uring worker polls a moment after answering before it sleeps
    (``kernel.polling``): a client asking back to back finds it awake, so the daemon's event loop sleeps far
    less often than once a request; it sleeps only when the client is away longer than the poll, as a loaded
    machine makes it now and then."""
    m = mount_factory(env=ENV)
    (m.mountpoint / "f").write_bytes(b"x")
    assert "io_uring (" in _status(m.mountpoint)
    calls = 4000
    before = _sleeps(m.pid)
    subprocess.run([sys.executable, "-c", IOCTLS, str(m.mountpoint / "f"), str(calls)], check=True, timeout=120)
    slept = _sleeps(m.pid) - before
    assert slept < calls // 2, f"the daemon slept {slept} times for {calls} round trips"
    line = _status(m.mountpoint)  # the ring served them, not /dev/fuse
    assert int(line.split(" entries, ")[1].split()[0]) > calls, line
