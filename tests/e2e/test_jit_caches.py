"""Every JIT cache of the stack on one mount (``mithrilfs.jitcaches``): a really new node compiles nothing.

A new node here has an empty store, an empty ``TMPDIR`` and an empty home,
as a fresh machine or container has; it gets node A's cache through a real
redis-server, at the same mount path.  The compiler is a wrapper that logs
each call, so "nothing compiled" is counted, not inferred from a time.
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import REPO, Mount, MountFactory, RedisServer, run_cli, wait_uploaded

from mithrilfs.jitcaches import catalog

pytestmark = pytest.mark.e2e

WORKLOAD = REPO / "scripts" / "workloads" / "compile_workload.py"


def _compiler(tmp_path: Path) -> Path:
    """A g++ that logs its arguments (one line per call) to $CXX_LOG, then runs the real one."""
    cxx = tmp_path / "bin" / "g++"
    cxx.parent.mkdir()
    cxx.write_text('#!/bin/sh\nprintf "%s\\n" "$*" >> "$CXX_LOG"\nexec /usr/bin/g++ "$@"\n')
    cxx.chmod(0o755)
    return cxx


def _builds(log: Path) -> list[str]:
    """The calls that compiled or linked something: not the probes (options only: --version, -v,
    -dumpversion), not the preprocessing torch does on every run to hash its header (-E)."""
    calls = log.read_text().splitlines() if log.exists() else []
    return [c for c in calls if not all(a.startswith("-") for a in c.split()) and " -E " not in f" {c} "]


def _node(tmp_path: Path, name: str, cxx: Path) -> dict[str, str]:
    """A machine of its own: empty home and temporary directory, its compiler log."""
    home, tmp = tmp_path / name / "home", tmp_path / name / "tmp"
    home.mkdir(parents=True)
    tmp.mkdir()
    return dict(os.environ, HOME=str(home), TMPDIR=str(tmp), CXX=str(cxx), CXX_LOG=str(tmp_path / name / "cxx.log"),
                MITHRILFS_WORKLOAD_EXTENSION="1", PATH=f"{Path(sys.executable).parent}:{os.environ['PATH']}")


def _run(m: Mount, env: dict[str, str]) -> tuple[dict, str]:
    res = run_cli("run", "--mount", str(m.mountpoint), "--", sys.executable, str(WORKLOAD), env=env, timeout=600)
    assert res.returncode == 0, res.stderr[-4000:]
    return json.loads(res.stdout.strip().splitlines()[-1]), res.stderr


@pytest.mark.timeout(900)
def test_a_new_node_compiles_nothing_with_every_cache_through_the_shared_tier(
        mount_factory: MountFactory, redis_server: RedisServer, tmp_path: Path):
    cxx = _compiler(tmp_path)
    m = mount_factory("node", "--remote", redis_server.url, "--min-age", "0")
    a_env = _node(tmp_path, "a", cxx)
    cold, _ = _run(m, a_env)
    assert cold["fxgraph_cache_miss"] > 0 and cold["extension"] == 42
    a_builds = _builds(tmp_path / "a" / "cxx.log")
    assert any("-x c++-header" in c for c in a_builds), "node A built no precompiled header"
    # the headers went to the mount, not to A's temporary directory
    link = catalog.headers_link(a_env)
    assert not os.path.lexists(link), "run left its link behind"
    assert any(p.name.endswith(".gch") for p in (m.mountpoint / "inductor-headers").iterdir())
    assert not any(p.is_file() for p in (tmp_path / "a" / "tmp").rglob("*.gch"))
    wait_uploaded(m, timeout=120)
    m.umount()

    # node B: the same mount path, an empty store, home and TMPDIR
    m.store = tmp_path / "b-store"
    m.mount()
    b_env = _node(tmp_path, "b", cxx)
    warm, stderr = _run(m, b_env)
    assert warm["fxgraph_cache_hit"] > 0 and warm["fxgraph_cache_miss"] == 0
    assert warm["autograd_cache_hit"] > 0 and warm["autograd_cache_miss"] == 0
    assert warm["output_sha"] == cold["output_sha"] and warm["extension"] == 42
    s = m.stats()  # shown with a failure: a lookup or fetch the tier did not answer in time is a recompile
    assert _builds(tmp_path / "b" / "cxx.log") == [], ("node B compiled", {k: v for k, v in s.items()
                                                                        if k.startswith("remote")})
    assert "outside the mount" not in stderr, stderr
    assert s["remote_hits"] > 0 and s["remote_fetched_bytes"] > 0 and s["remote_verify_failures"] == 0


def test_env_links_the_headers_where_torch_looks_for_them_from_a_shell_with_no_mithrilfs(
        mnt: Mount, tmp_path: Path):
    """An app container beside the sidecar evaluates ``.mithrilfs/env``: the shell alone links
    torch's precompiled-header directory into the mount, by torch's own rule (its user name
    sanitized, its temporary directory), and leaves a real directory alone."""
    snippet = (mnt.mountpoint / ".mithrilfs" / "env").read_text()
    assert snippet == run_cli("env", str(mnt.mountpoint), check=True).stdout
    probe = ("from torch._inductor.runtime.cache_dir_utils import default_cache_dir; import os; "
             "print(os.path.join(default_cache_dir(), 'precompiled_headers'))")
    for i, user in enumerate(["alice", 'we:ird/"n<a>m|e*?']):
        tmp = tmp_path / f"t{i}"
        tmp.mkdir()
        env = {"PATH": os.environ["PATH"], "HOME": str(tmp_path), "TMPDIR": str(tmp), "LOGNAME": user}
        out = subprocess.run(["sh", "-c", f'eval "$(cat {shlex.quote(str(mnt.mountpoint / ".mithrilfs" / "env"))})"'
                              f' && {shlex.quote(sys.executable)} -c "{probe}" && env'],
                             env=env, capture_output=True, text=True, check=True).stdout.splitlines()
        where = Path(out[0])
        assert where.is_symlink() and os.readlink(where) == str(mnt.mountpoint / "inductor-headers"), where
        assert where == catalog.headers_link(env)
        exported = dict(line.split("=", 1) for line in out[1:] if "=" in line)
        for var, value in catalog.variables(mnt.mountpoint).items():
            assert exported[var] == value
        assert not any(k.startswith("mithrilfs_") for k in exported), "the snippet left its variables"
    real = tmp_path / "t0" / "torchinductor_bob" / "precompiled_headers"
    real.mkdir(parents=True)
    subprocess.run(["sh", "-c", f'eval "$(cat {shlex.quote(str(mnt.mountpoint / ".mithrilfs" / "env"))})"'],
                   env={"PATH": os.environ["PATH"], "TMPDIR": str(tmp_path / "t0"), "LOGNAME": "bob"}, check=True)
    assert real.is_dir() and not real.is_symlink() and list(real.iterdir()) == []


def test_run_names_a_cache_written_outside_the_mount_and_is_silent_when_none_was(mnt: Mount, tmp_path: Path):
    env = dict(os.environ, HOME=str(tmp_path / "home"), TMPDIR=str(tmp_path))
    (tmp_path / "home").mkdir()
    quiet = run_cli("run", "--mount", str(mnt.mountpoint), "--", "sh", "-c",
                    'mkdir -p "$TRITON_CACHE_DIR/k" && echo x > "$TRITON_CACHE_DIR/k/a.json"', env=env)
    assert quiet.returncode == 0 and "outside the mount" not in quiet.stderr, quiet.stderr
    leak = run_cli("run", "--mount", str(mnt.mountpoint), "--", "sh", "-c",
                   'mkdir -p "$HOME/.cache/flashinfer/0.5/cached_ops" && '
                   'head -c 300000 /dev/zero > "$HOME/.cache/flashinfer/0.5/cached_ops/op.so"', env=env)
    assert leak.returncode == 0
    lines = [line for line in leak.stderr.splitlines() if "outside the mount" in line]
    assert len(lines) == 1, leak.stderr
    assert "293.0 KiB" in lines[0] and str(tmp_path / "home" / ".cache" / "flashinfer") in lines[0]
    assert "FLASHINFER_WORKSPACE_BASE" in lines[0]


def test_env_list_names_every_cache_and_how_it_is_reached():
    listing = run_cli("env", "--list", check=True).stdout
    for c in catalog.CATALOG:
        assert c.tool in listing and f"MOUNT/{c.subdir}" in listing
        assert all(var in listing for var in c.variables)
    assert "link $TMP/torchinductor_$USER/precompiled_headers" in listing
    res = run_cli("env")
    assert res.returncode == 2 and len(res.stderr.strip().splitlines()) == 1


def test_status_names_a_cache_written_outside_the_mount_since_it_was_mounted(mount_factory: MountFactory,
                                                                              tmp_path: Path):
    home = tmp_path / "home"
    home.mkdir()
    env = {"HOME": str(home), "TMPDIR": str(tmp_path)}
    m = mount_factory("st", env=env)
    clean = run_cli("status", str(m.mountpoint), env=dict(os.environ, **env))
    assert clean.returncode == 0 and "outside the mount" not in clean.stdout
    (home / ".cache" / "vllm" / "torch_compile_cache").mkdir(parents=True)
    (home / ".cache" / "vllm" / "torch_compile_cache" / "k.py").write_bytes(b"v" * 4096)
    res = run_cli("status", str(m.mountpoint), env=dict(os.environ, **env))
    assert res.returncode == 0
    assert f"4.0 KiB of vLLM's cache written outside the mount, in {home}/.cache/vllm: VLLM_CACHE_ROOT" in res.stdout
    doc = json.loads(run_cli("status", "--json", str(m.mountpoint), env=dict(os.environ, **env)).stdout)
    assert doc["outside_since_mount"] == [{"path": f"{home}/.cache/vllm", "bytes": 4096, "tool": "vLLM",
                                           "variables": ["VLLM_CACHE_ROOT"]}]
