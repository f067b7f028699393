"""Deployment pieces: the container entrypoint run directly, and the manifests' shape."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import urllib.request

import yaml
from conftest import (
    ENTRYPOINT,
    MITHRILFS_BIN,
    REPO,
    free_port,
    is_mounted,
    run_cli,
    running_entrypoint,
    wait_for,
    write_committed,
)

from mithrilfs.daemon.umount import store_free


def test_entrypoint_mounts_from_environment_and_stops_cleanly_on_sigterm(tmp_path):
    mp, store = tmp_path / "cache", tmp_path / "store"
    port = free_port()
    env = dict(os.environ, MITHRILFS_MOUNTPOINT=str(mp), MITHRILFS_STORE=str(store), MITHRILFS_MAX_SIZE="123M",
               MITHRILFS_METRICS_PORT=str(port), MITHRILFS_MIN_AGE="0", MITHRILFS_BIN=MITHRILFS_BIN)
    with running_entrypoint(env, mp, store) as proc:
        wait_for(lambda: is_mounted(mp) and (mp / ".mithrilfs" / "stats.json").exists(), what="the mount")
        stats = json.loads((mp / ".mithrilfs" / "stats.json").read_text())
        assert stats["max_bytes"] == 123 << 20
        # exec'd: the container's main process is mithrilfs itself, which stays while daemons come and go
        with open(f"/proc/{stats['pid']}/stat") as f:
            assert int(f.read().rsplit(")", 1)[1].split()[1]) == proc.pid
        (mp / "inductor").mkdir()
        write_committed(mp / "inductor" / "artifact.so", b"kept across restarts")
        os.kill(stats["pid"], signal.SIGKILL)  # a crash: a successor takes over, the container goes on
        wait_for(lambda: json.loads((mp / ".mithrilfs" / "stats.json").read_text())["restarts"] == 1,
                 what="the successor")
        assert proc.poll() is None and (mp / "inductor" / "artifact.so").read_bytes() == b"kept across restarts"
        wait_for(lambda: b"mithrilfs_files" in urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read(),
                 what="the metrics")
        assert run_cli("status", str(mp)).returncode == 0  # what HEALTHCHECK runs
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
        # the container's main process exits only once the daemon has closed the store: a runtime
        # killing what is left then would otherwise interrupt it half-way
        assert not is_mounted(mp) and store_free(store)
    assert run_cli("fsck", "--store", str(store)).returncode == 0
    # the next start of the container finds everything
    with running_entrypoint(env, mp, store) as proc:
        wait_for(lambda: is_mounted(mp) and (mp / "inductor").exists(), what="the second mount")
        assert (mp / "inductor" / "artifact.so").read_bytes() == b"kept across restarts"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0


def dockerfile_env() -> dict[str, str]:
    """The variables the image's ``ENV`` lines set (what the entrypoint sees in a container that sets none)."""
    import shlex

    text = (REPO / "Dockerfile").read_text().replace("\\\n", " ")
    env: dict[str, str] = {}
    for line in text.splitlines():
        if line.startswith("ENV "):
            env.update(word.split("=", 1) for word in shlex.split(line[4:]))
    return env


def test_image_environment_leaves_the_budget_to_the_store(tmp_path):
    """A budget kept with ``mithrilfs config`` is the sidecar's, unless the container sets MITHRILFS_MAX_SIZE:
    the image's own environment must not fix one (it set 10G, which overrode the store's)."""
    mp, store = tmp_path / "cache", tmp_path / "store"
    run_cli("config", str(store), "--max-size", "77M", check=True)
    image = dockerfile_env()
    assert image["MITHRILFS_MOUNTPOINT"] == "/mithrilfs/cache" and image["MITHRILFS_STORE"] == "/store"
    env = {k: v for k, v in os.environ.items() if not k.startswith("MITHRILFS_")}
    env.update(image, MITHRILFS_MOUNTPOINT=str(mp), MITHRILFS_STORE=str(store), MITHRILFS_BIN=MITHRILFS_BIN)
    with running_entrypoint(env, mp, store) as proc:
        wait_for(lambda: is_mounted(mp) and (mp / ".mithrilfs" / "stats.json").exists(), what="the mount")
        assert json.loads((mp / ".mithrilfs" / "stats.json").read_text())["max_bytes"] == 77 << 20
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0


def test_entrypoint_bad_environment_fails_with_one_line(tmp_path):
    env = dict(os.environ, MITHRILFS_MOUNTPOINT=str(tmp_path / "c"), MITHRILFS_STORE=str(tmp_path / "s"),
               MITHRILFS_MAX_SIZE="lots", MITHRILFS_BIN=MITHRILFS_BIN)
    res = subprocess.run(["sh", str(ENTRYPOINT)], env=env, capture_output=True, text=True, timeout=60)
    assert res.returncode == 2 and "invalid size" in res.stderr and len(res.stderr.strip().splitlines()) == 1


#: How an app container beside the sidecar puts every JIT cache on the mount (no mithrilfs installed in it).
ENV_EVAL = 'eval "$(cat /mithrilfs/cache/.mithrilfs/env)" && exec '


def test_kubernetes_pod_shape():
    pod = yaml.safe_load((REPO / "deploy" / "kubernetes.yaml").read_text())
    assert pod["kind"] == "Pod"
    sidecar = next(c for c in pod["spec"]["initContainers"] if c["name"] == "mithrilfs")
    assert sidecar["restartPolicy"] == "Always"
    sec = sidecar["securityContext"]
    assert sec.get("privileged") or "SYS_ADMIN" in sec.get("capabilities", {}).get("add", [])
    assert {"name": "cache", "mountPath": "/mithrilfs", "mountPropagation": "Bidirectional"} in sidecar["volumeMounts"]
    # the mount sits on a subdirectory of the shared volume (a restarted sidecar's mount reaches running apps)
    assert {"name": "MITHRILFS_MOUNTPOINT", "value": "/mithrilfs/cache"} in sidecar["env"]
    assert sidecar["startupProbe"]["exec"]["command"] == ["mithrilfs", "status", "--ready", "/mithrilfs/cache"]
    app = pod["spec"]["containers"][0]
    assert {"name": "cache", "mountPath": "/mithrilfs", "mountPropagation": "HostToContainer"} in app["volumeMounts"]
    assert app["command"][:2] == ["sh", "-c"] and app["command"][2].startswith(ENV_EVAL)
    assert "env" not in app  # the catalog comes from the sidecar's .mithrilfs/env, not a list of its own
    volumes = {v["name"]: v for v in pod["spec"]["volumes"]}
    assert volumes["cache"]["hostPath"]["path"] and volumes["store"]["hostPath"]["path"]


def test_compose_shape():
    compose = yaml.safe_load((REPO / "deploy" / "docker-compose.yaml").read_text())
    side, app = compose["services"]["mithrilfs"], compose["services"]["app"]
    # no privileged: the device and SYS_ADMIN are all a FUSE mount needs (tests/container runs it so)
    assert "privileged" not in side and "/dev/fuse" in side["devices"] and side["cap_add"] == ["SYS_ADMIN"]
    assert side["healthcheck"]["test"] == ["CMD", "mithrilfs", "status", "/mithrilfs/cache"]
    assert side["environment"]["MITHRILFS_MOUNTPOINT"] == "/mithrilfs/cache"
    shared = next(v for v in side["volumes"] if isinstance(v, dict) and v["target"] == "/mithrilfs")
    seen = next(v for v in app["volumes"] if isinstance(v, dict) and v["target"] == "/mithrilfs")
    assert shared["bind"]["propagation"] == "rshared" and seen["bind"]["propagation"] == "rslave"
    assert shared["source"] == seen["source"]
    assert app["depends_on"]["mithrilfs"]["condition"] == "service_healthy"
    assert app["command"][:2] == ["sh", "-c"] and app["command"][2].startswith(ENV_EVAL)
    assert "environment" not in app


def test_dockerfile_and_systemd_unit():
    docker = (REPO / "Dockerfile").read_text()
    assert "ARG BASE=python:3.11-slim" in docker and "FROM ${BASE}" in docker and "fuse3" in docker
    assert "ENV MITHRILFS_MOUNTPOINT=/mithrilfs/cache" in docker
    assert 'HEALTHCHECK' in docker and 'mithrilfs status' in docker
    assert 'CMD ["/usr/local/bin/mithrilfs-entrypoint"]' in docker
    assert "COPY deploy/entrypoint.sh /usr/local/bin/mithrilfs-entrypoint" in docker
    unit = (REPO / "deploy" / "mithrilfs.service").read_text()
    assert "--foreground" in unit and "KillSignal=SIGTERM" in unit and "[Install]" in unit
    assert "ExecReload=/usr/local/bin/mithrilfs restart /var/cache/torch-compile" in unit
