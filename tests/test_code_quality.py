"""Lint, types and layers, checked in every test run (``.ci/run`` runs them through pytest).

ruff (pyflakes, pycodestyle, import order, bugbear, pyupgrade, async
pitfalls), mypy on the package, and import-linter's contracts from
pyproject.toml: arrows between the layers only point down, and the FUSE
protocol layer imports nothing of the rest.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parent.parent
BIN = Path(sys.executable).parent


@pytest.mark.parametrize("command", [
    ["ruff", "check", "mithrilfs", "tests", "scripts"],
    ["mypy"],
    ["lint-imports"],
], ids=["ruff", "mypy", "import-linter"])
def test_clean(command: list[str]) -> None:
    res = subprocess.run([str(BIN / command[0]), *command[1:]], cwd=REPO, capture_output=True, text=True,
                         timeout=600)
    assert res.returncode == 0, (res.stdout + res.stderr)[-4000:]
