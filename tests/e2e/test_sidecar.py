"""The sidecar pattern without Docker: mount namespaces and mount propagation, as a pod has them.

The daemon runs through the container entrypoint in its own mount namespace
and mounts under a directory with shared propagation (the pod's
Bidirectional volume); applications run in other namespaces that receive
the mount as slaves (HostToContainer) and use it through ordinary paths.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from conftest import ENTRYPOINT, MITHRILFS_BIN, REPO, is_mounted, run_cli

from mithrilfs.testing import own_namespace

pytestmark = pytest.mark.e2e
WORKLOAD = REPO / "scripts" / "workloads" / "compile_workload.py"




def _app(env: dict, cache: Path) -> dict:
    """An application container: its own mount namespace, receiving mounts as a slave; of the FUSE mounts
    only the cache (no copy of another test's mount held while it compiles)."""
    res = subprocess.run(own_namespace.argv([sys.executable, str(WORKLOAD)], keep=[cache], propagation="slave"),
                         env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(900)
def test_sidecar_in_its_own_namespace_serves_apps_in_theirs(shared_dir: Path, tmp_path: Path):
    cache, store = shared_dir / "cache", tmp_path / "store"
    env = dict(os.environ, MITHRILFS_MOUNTPOINT=str(cache), MITHRILFS_STORE=str(store), MITHRILFS_BIN=MITHRILFS_BIN)
    sidecar = subprocess.Popen(own_namespace.argv(["sh", str(ENTRYPOINT)], propagation="unchanged"), env=env,
                               stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 30
        while not (is_mounted(cache) and (cache / ".mithrilfs" / "pid").exists()):
            assert sidecar.poll() is None and time.monotonic() < deadline, "the sidecar's mount never propagated"
            time.sleep(0.05)
        app_env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(cache / "inductor"),
                       TRITON_CACHE_DIR=str(cache / "triton"))
        cold = _app(app_env, cache)
        warm = _app(app_env, cache)
        assert cold["fxgraph_cache_miss"] > 0
        assert warm["fxgraph_cache_hit"] > 0 and warm["output_sha"] == cold["output_sha"]

        # an application still holding a file when the sidecar stops gets an error, not a hang
        held = next(p for p in (cache / "inductor").rglob("*.py") if p.is_file())
        fd = os.open(held, os.O_RDONLY)
        sidecar.send_signal(signal.SIGTERM)
        assert sidecar.wait(timeout=60) == 0
        outcome: list[object] = []

        def read_after_stop() -> None:
            try:
                os.pread(fd, 4096, 1 << 20)  # past what the kernel may have cached
                outcome.append("read")
            except OSError as e:
                outcome.append(e.errno)

        t = threading.Thread(target=read_after_stop, daemon=True)
        t.start()
        t.join(10)
        assert outcome, "a read after the sidecar stopped hung"
        try:
            os.close(fd)  # the fd is released either way; its flush may report ENOTCONN
        except OSError as e:
            assert e.errno == 107
        assert not is_mounted(cache), "a dead mount was left behind"
        fsck = run_cli("fsck", "--store", str(store))
        assert fsck.returncode == 0, fsck.stdout
    finally:
        if sidecar.poll() is None:
            sidecar.kill()
