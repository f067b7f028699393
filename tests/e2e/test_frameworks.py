"""Real clients on the mount, in fresh processes: torch.compile (Inductor, CPU) and Triton's cache."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest
from conftest import REPO, Mount, MountFactory, daemon_pid, run_cli, wait_for

pytestmark = pytest.mark.e2e

WORKLOAD = REPO / "scripts" / "workloads" / "compile_workload.py"


def _compile(cache_dir) -> dict:
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(cache_dir), TRITON_CACHE_DIR=str(cache_dir / "triton"))
    res = subprocess.run([sys.executable, str(WORKLOAD)], env=env, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.mark.timeout(900)
def test_a_cold_torch_compile_survives_a_kill9_of_the_daemon_in_its_middle(mnt: Mount, tmp_path):
    """The cache path is absolute: before takeovers, a compile went on writing into the directory under
    the mount point once the watchdog detached it.  Now it sees a pause and finishes like a run on a plain
    directory; nothing lands beside the store."""
    reference = _compile(tmp_path / "plain")
    cache = mnt.mountpoint / "inductor"
    env = dict(os.environ, TORCHINDUCTOR_CACHE_DIR=str(cache), TRITON_CACHE_DIR=str(cache / "triton"))
    proc = subprocess.Popen([sys.executable, str(WORKLOAD)], env=env, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    try:
        wait_for(lambda: cache.is_dir() and any(p.is_file() for p in cache.rglob("*")), timeout=300,
                 what="the compile writes its cache")
        time.sleep(0.5)  # in the middle of writing it
        old = mnt.pid
        assert old is not None
        os.kill(old, signal.SIGKILL)
        out, err = proc.communicate(timeout=600)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert proc.returncode == 0, err[-3000:]
    result = json.loads(out.strip().splitlines()[-1])
    assert result["output_sha"] == reference["output_sha"]
    mnt.pid = daemon_pid(mnt.mountpoint)
    assert mnt.pid not in (None, old) and mnt.stats()["restarts"] == 1
    mnt.umount()
    assert os.listdir(mnt.mountpoint) == []  # nothing written beside the store
    fsck = run_cli("fsck", "--store", str(mnt.store))
    assert fsck.returncode == 0, fsck.stdout + fsck.stderr
    mnt.mount()
    warm = _compile(cache)  # what the killed run cached is whole: a warm run hits and agrees
    assert warm["fxgraph_cache_hit"] > 0 and warm["output_sha"] == reference["output_sha"]


@pytest.mark.timeout(900)
def test_inductor_cache_warm_after_remount_reported_exported_and_recompiled_after_a_partial_eviction(
        mount_factory: MountFactory, tmp_path):
    """One cold compile (about 20 s here) serves four checks that each paid their own before: a warm start
    after a remount hits, stats report the hits under ``inductor``, an exported and imported store hits
    too, and a store half evicted recompiles what it lost and computes the same."""
    a = mount_factory("a", "--min-age", "0")
    cache = a.mountpoint / "inductor"
    cold = _compile(cache)
    assert cold["fxgraph_cache_miss"] > 0 and cold["fxgraph_cache_hit"] == 0
    written = [p for p in cache.rglob("*") if p.is_file()]
    assert any(p.suffix == ".so" for p in written) and any(p.suffix == ".cpp" for p in written)
    a.remount()
    warm = _compile(cache)
    assert warm["fxgraph_cache_hit"] > 0 and warm["fxgraph_cache_miss"] == 0
    assert warm["output_sha"] == cold["output_sha"]
    ind = a.stats()["by_dir"]["inductor"]
    assert ind["hits"] > 0 and ind["reads"] > 0
    # exported and imported into another store: it hits there too
    archive = tmp_path / "cache.tar"
    run_cli("export", str(a.mountpoint), str(archive), check=True)
    run_cli("import", str(archive), "--store", str(tmp_path / "imported"), check=True)
    b = mount_factory("b", store=tmp_path / "imported")
    again = _compile(b.mountpoint / "inductor")
    assert again["fxgraph_cache_hit"] > 0 and again["fxgraph_cache_miss"] == 0
    assert again["output_sha"] == cold["output_sha"]
    assert b.stats()["by_dir"]["inductor"]["hits"] > 0
    b.umount()
    # half of A's store evicted: what is gone is compiled again, and the result is the same
    physical = a.stats()["physical_bytes"]
    out = run_cli("gc", str(a.mountpoint), "--to", str(physical // 2), check=True)
    assert "evicted" in out.stdout and a.stats()["evictions"] > 0
    assert a.stats()["physical_bytes"] <= physical // 2
    a.remount()
    after = _compile(cache)
    assert after["output_sha"] == cold["output_sha"]


TRITON_PUT = textwrap.dedent(
    """
    import json, sys
    from triton.runtime.cache import FileCacheManager
    m = FileCacheManager(sys.argv[1])
    group = {}
    for name, data in (("k.cubin", b"\\x7fCUBIN" * 500), ("k.ptx", b".version 8.0\\n" * 300), ("k.json", b'{"n": 1}')):
        group[name] = m.put(data, name)
    m.put_group("k.json", group)
    print(json.dumps(group))
    """
)
TRITON_GET = textwrap.dedent(
    """
    import json, sys
    from triton.runtime.cache import FileCacheManager
    g = FileCacheManager(sys.argv[1]).get_group("k.json")
    print(json.dumps(None if g is None else {k: open(p, "rb").read().hex() for k, p in g.items()}))
    """
)


def _py(code: str, *args: str, env: dict) -> str:
    res = subprocess.run([sys.executable, "-c", code, *args], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-3000:]
    return res.stdout.strip().splitlines()[-1]


def test_triton_file_cache_group_across_processes(mnt: Mount):
    env = dict(os.environ, TRITON_CACHE_DIR=str(mnt.mountpoint / "triton"))
    group = json.loads(_py(TRITON_PUT, "abc123", env=env))
    assert set(group) == {"k.cubin", "k.ptx", "k.json"}
    mnt.remount()
    got = json.loads(_py(TRITON_GET, "abc123", env=env))
    assert got == {
        "k.cubin": (b"\x7fCUBIN" * 500).hex(),
        "k.ptx": (b".version 8.0\n" * 300).hex(),
        "k.json": b'{"n": 1}'.hex(),
    }
    # the temporary directories Triton writes through are gone
    assert sorted(os.listdir(mnt.mountpoint / "triton" / "abc123")) == ["__grp__k.json", "k.cubin", "k.json", "k.ptx"]
    assert json.loads(_py(TRITON_GET, "missing-key", env=env)) is None


def test_demo_runs_and_leaves_no_temporary_directory(tmp_path):
    """The README's main job: a real torch.compile cold then warm on the mount, and nothing left behind."""
    tmp = tmp_path / "tmp"
    tmp.mkdir()
    res = subprocess.run([sys.executable, str(REPO / "scripts" / "demo.py"), "--store", str(tmp_path / "store")],
                         env=dict(os.environ, TMPDIR=str(tmp)), capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stdout + res.stderr
    assert "outputs of the two runs: identical" in res.stdout
    assert not list(tmp.glob("mithrilfs-demo-*"))  # its mount point was removed (torch keeps its own dirs there)
