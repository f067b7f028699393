"""Shared pieces of the benchmark scripts: a temporary mount, fresh-process runs, ABBA order."""

from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator, Sequence

HERE = Path(__file__).resolve().parent
CLI = [sys.executable, "-m", "mithrilfs"]


@contextmanager
def temp_mount(*extra: str, base: str | None = None) -> Iterator[tuple[Path, Path]]:
    """A fresh store mounted on a fresh mount point, side by side with a plain directory.

    Yields (mountpoint, plain_dir); both live on the same backing filesystem
    so the comparison is fair.  Always unmounts.
    """
    root = Path(tempfile.mkdtemp(prefix="mithrilfs-bench-", dir=base))
    mp, store, plain = root / "mnt", root / "store", root / "plain"
    mp.mkdir()
    plain.mkdir()
    subprocess.run([*CLI, "mount", str(mp), "--store", str(store), *extra], check=True)
    try:
        yield mp, plain
    finally:
        if subprocess.run([*CLI, "umount", str(mp)]).returncode != 0:
            subprocess.run(["fusermount3", "-u", "-z", str(mp)])
        subprocess.run(["rm", "-rf", str(root)])


def abba(reps: int) -> list[tuple[str, str]]:
    """Alternating order: AB, BA, AB, ... so neither side always goes first."""
    return [("plain", "mount") if i % 2 == 0 else ("mount", "plain") for i in range(reps)]


def run_json(cmd: Sequence[str], env: dict[str, str] | None = None, timeout: float = 900) -> dict:
    res = subprocess.run(list(cmd), env=env, capture_output=True, text=True, timeout=timeout)
    if res.returncode != 0:
        sys.exit(f"benchmark step failed: {' '.join(cmd)}\n{res.stderr[-2000:]}")
    return json.loads(res.stdout.strip().splitlines()[-1])


def compile_env(cache: Path) -> dict[str, str]:
    return dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(cache), TRITON_CACHE_DIR=str(cache / "triton"))


def median(xs: Sequence[float]) -> float:
    return statistics.median(xs) if xs else float("nan")
