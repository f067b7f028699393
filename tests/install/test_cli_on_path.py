"""After the README's set-up a user types ``mithrilfs``: the set-up links the virtualenv's console script onto PATH.

``scripts/setup/setup-venv.sh`` ends with ``scripts/setup/link-cli.sh``; here that step runs
against this suite's virtualenv with a bin directory of the test's own
(``MITHRILFS_BIN_DIR``), as root and as a user who cannot write there.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

from conftest import REPO, traversable

LINK_CLI = REPO / "scripts" / "setup" / "link-cli.sh"
VENV = Path(sys.executable).parent.parent


def _link(bin_dir: Path, *, user: int | None = None) -> subprocess.CompletedProcess:
    argv = ["bash", str(LINK_CLI), str(VENV)]
    if user is not None:
        argv = ["setpriv", f"--reuid={user}", f"--regid={user}", "--clear-groups", *argv]
    return subprocess.run(argv, capture_output=True, text=True, timeout=60, cwd="/",
                          env=dict(os.environ, MITHRILFS_BIN_DIR=str(bin_dir), PATH=f"{bin_dir}:/usr/bin:/bin"))


def test_setup_puts_mithrilfs_on_path(tmp_path: Path):
    assert "bash scripts/setup/link-cli.sh .venv" in (REPO / "scripts" / "setup" / "setup-venv.sh").read_text()
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    res = _link(bin_dir)
    assert res.returncode == 0, res.stderr
    link = bin_dir / "mithrilfs"
    assert link.is_symlink() and link.resolve() == (VENV / "bin" / "mithrilfs").resolve()
    assert "not on your PATH" not in res.stdout
    # a shell that has only that directory and the system's on PATH finds the command
    env = {"PATH": f"{bin_dir}:/usr/bin:/bin", "PYTHONPATH": os.environ.get("PYTHONPATH", "")}
    version = subprocess.run(["sh", "-c", "mithrilfs --version"], capture_output=True, text=True, timeout=60,
                             cwd="/", env=env)
    assert version.returncode == 0 and version.stdout.startswith("mithrilfs "), version.stderr
    # running the set-up again keeps the link
    assert _link(bin_dir).returncode == 0 and link.is_symlink()


def test_setup_leaves_another_mithrilfs_alone(tmp_path: Path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    other = bin_dir / "mithrilfs"
    other.write_text("#!/bin/sh\necho another install\n")
    res = _link(bin_dir)
    assert res.returncode == 0 and "left alone" in res.stdout, res.stdout + res.stderr
    assert not other.is_symlink() and "another install" in other.read_text()


def test_setup_as_a_user_prints_the_path_line(tmp_path: Path):
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    traversable(bin_dir)  # reachable, but not writable, by that user
    res = _link(bin_dir, user=65534)
    assert res.returncode == 0, res.stderr
    assert not (bin_dir / "mithrilfs").exists()
    assert res.stdout.splitlines()[-1] == f'export PATH="{VENV.resolve()}/bin:$PATH"'
