"""What users install: the wheel built from this checkout, installed (not editable) into a fresh virtualenv.

An editable install (the test suite's own ``.venv``) imports from the source
tree, so it cannot see a package left out of the wheel; this test can.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
from conftest import REPO, Mount, is_mounted, pid_alive, wait_for

pytestmark = pytest.mark.timeout(600)

#: what a copy of the source tree leaves out: build output, caches, the test venv
IGNORE = shutil.ignore_patterns(".git", ".venv", "build", "dist", "*.egg-info", "__pycache__", ".pytest_cache",
                                ".hypothesis")


def _source_modules() -> set[str]:
    """Every module file of the package in the source tree, as a path inside a wheel (mithrilfs/kernel/x.py)."""
    return {p.relative_to(REPO).as_posix() for p in (REPO / "mithrilfs").rglob("*.py")
            if "__pycache__" not in p.parts}


def _clean_env() -> dict[str, str]:
    """The environment minus anything that would let Python import the checkout instead of the install."""
    return {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME", "VIRTUAL_ENV")}


def test_wheel_installs_and_mounts(tmp_path: Path):
    src = tmp_path / "src"
    shutil.copytree(REPO, src, ignore=IGNORE)  # pip would leave build/ and *.egg-info in the tree it builds
    dist = tmp_path / "dist"
    res = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "-q", "-w", str(dist), str(src)],
                         capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    (wheel,) = dist.glob("mithrilfs-*.whl")

    # every module of every subpackage ships (a new subpackage can never be left out again)
    names = set(zipfile.ZipFile(wheel).namelist())
    missing = sorted(_source_modules() - names)
    assert not missing, f"the wheel lacks {missing}"
    subpackages = {Path(m).parent.as_posix() for m in _source_modules()}
    assert "mithrilfs/kernel" in subpackages  # the one that was left out once

    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    res = subprocess.run([str(venv / "bin" / "pip"), "install", "-q", str(wheel)], capture_output=True, text=True,
                         timeout=300, cwd=tmp_path, env=_clean_env())
    assert res.returncode == 0, res.stderr[-3000:]
    env = _clean_env()
    where = subprocess.run([str(venv / "bin" / "python"), "-c", "import mithrilfs; print(mithrilfs.__file__)"],
                           capture_output=True, text=True, timeout=60, cwd=tmp_path, env=env)
    assert where.returncode == 0 and Path(where.stdout.strip()).is_relative_to(venv), where.stdout + where.stderr

    exe = str(venv / "bin" / "mithrilfs")
    version = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=60, cwd=tmp_path, env=env)
    assert version.returncode == 0, version.stderr
    assert version.stdout.split() == ["mithrilfs", tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]]

    mp, store = tmp_path / "mnt", tmp_path / "store"
    mp.mkdir()
    m = Mount(mp, store)
    try:
        res = subprocess.run([exe, "mount", str(mp), "--store", str(store)], capture_output=True, text=True,
                             timeout=60, cwd=tmp_path, env=env)
        assert res.returncode == 0, res.stderr
        assert is_mounted(mp)
        m.pid = int((mp / ".mithrilfs" / "pid").read_text())
        # the daemon runs the installed package, not the checkout
        cmdline = Path(f"/proc/{m.pid}/cmdline").read_bytes().split(b"\0")
        assert any(os.fsencode(venv) in arg for arg in cmdline), cmdline
        # another process writes, this one reads it back through the mount
        subprocess.run(["sh", "-c", f"printf 'from the wheel' > {mp}/hello && sync {mp}/hello"], check=True,
                       timeout=60)
        assert (mp / "hello").read_bytes() == b"from the wheel"
        res = subprocess.run([exe, "umount", str(mp)], capture_output=True, text=True, timeout=60, cwd=tmp_path,
                             env=env)
        assert res.returncode == 0, res.stderr
        assert not is_mounted(mp)
        wait_for(lambda: not pid_alive(m.pid), timeout=15, what="the daemon to exit")
        m.pid = None
        fsck = subprocess.run([exe, "fsck", "--store", str(store)], capture_output=True, text=True, timeout=60,
                              env=env)
        assert fsck.returncode == 0, fsck.stdout + fsck.stderr
    finally:
        m.force_cleanup()
