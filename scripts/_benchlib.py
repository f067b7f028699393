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


@contextmanager
def redis_server() -> Iterator[str]:
    """A throwaway redis-server on a free loopback port; yields its URL."""
    import socket
    import time

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.Popen(["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--save", "",
                             "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(200):
            ping = subprocess.run(["redis-cli", "-p", str(port), "PING"], capture_output=True, text=True)
            if ping.stdout.strip() == "PONG":
                break
            time.sleep(0.05)
        yield f"redis://127.0.0.1:{port}/0"
    finally:
        proc.kill()
        proc.wait()
