"""The sidecar image built from the Dockerfile and run for real, with podman, then through the compose file.

No registry: the base image is made with debootstrap and ``podman import``;
the build's pip gets its packages from a wheelhouse downloaded with the
host's own pip settings.  podman runs with a configuration, storage root and
run root of the tests' own (nothing of the machine's other podman state is
touched).  What takes time is cached under ``/var/cache/mithrilfs-test``
(``MITHRILFS_TEST_CACHE``), keyed by what it is made from: the base image
tarball, the wheelhouse, and podman's own layer cache.
"""

from __future__ import annotations

import hashlib
import os
import resource
import shutil
import subprocess
import sys
import time
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import yaml
from conftest import REPO, is_mounted, run_cli, wait_for, write_committed

pytestmark = [pytest.mark.container, pytest.mark.timeout(600)]

CACHE = Path(os.environ.get("MITHRILFS_TEST_CACHE", "/var/cache/mithrilfs-test"))
#: podman's run root and lock files (gone at reboot, as they must be), one per storage root
RUN = Path("/run") / f"mithrilfs-test-{hashlib.sha256(str(CACHE).encode()).hexdigest()[:8]}"
SUITE, PACKAGES = "bookworm", "python3,python3-venv,fuse3,ca-certificates"
#: PATH in the base image: its venv's python and pip first, as python:3.11-slim has them
PATH = "/opt/venv/bin:/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin"
HOST_CA = Path("/etc/ssl/certs/ca-certificates.crt")

if not (shutil.which("podman") and shutil.which("runc") and shutil.which("debootstrap")):
    pytest.skip("podman, runc or debootstrap missing (scripts/setup/install-system-deps.sh installs them)",
                allow_module_level=True)


def _key(*parts: bytes | str) -> str:
    h = hashlib.sha256()
    for p in parts:
        h.update(p if isinstance(p, bytes) else p.encode())
        h.update(b"\0")
    return h.hexdigest()[:16]


@dataclass
class Podman:
    conf_dir: Path
    names: list[str] = field(default_factory=list)

    @property
    def env(self) -> dict[str, str]:
        return dict(os.environ, CONTAINERS_CONF=str(self.conf_dir / "containers.conf"),
                    CONTAINERS_STORAGE_CONF=str(self.conf_dir / "storage.conf"))

    def __call__(self, *args: str, check: bool = True, timeout: float = 300) -> subprocess.CompletedProcess:
        res = subprocess.run(["podman", *args], capture_output=True, text=True, timeout=timeout, env=self.env)
        if check and res.returncode != 0:
            raise AssertionError(f"podman {' '.join(args)} failed ({res.returncode}): {res.stderr[-2000:]}")
        return res

    def name(self, what: str) -> str:
        n = f"mithrilfs-test-{os.getpid()}-{what}"
        self.names.append(n)
        return n

    def cleanup(self) -> None:
        for n in self.names:
            self("rm", "-f", "-t", "0", n, check=False)


def _write_conf(d: Path) -> None:
    # runc: crun cannot start containers on hosts with hybrid cgroups; cgroupfs: no systemd needed;
    # the host's network (no bridges or CNI files); rlimits low enough that runc never has to raise
    # a hard limit (root may lack CAP_SYS_RESOURCE, as on some VMs)
    nofile = min(resource.getrlimit(resource.RLIMIT_NOFILE)[1], 16384)
    nproc = min(resource.getrlimit(resource.RLIMIT_NPROC)[1], 16384)
    (d / "containers.conf").write_text(f"""\
[containers]
netns = "host"
default_ulimits = ["nofile={nofile}:{nofile}", "nproc={nproc}:{nproc}"]
[engine]
runtime = "runc"
cgroup_manager = "cgroupfs"
events_logger = "file"
events_logfile_path = "{RUN}/events.log"
tmp_dir = "{RUN}/libpod"
volume_path = "{CACHE}/podman/volumes"
[network]
network_config_dir = "{RUN}/cni"
""")
    (d / "storage.conf").write_text(f"""\
[storage]
driver = "overlay"
graphroot = "{CACHE}/podman/root"
runroot = "{RUN}/runroot"
""")


def _base_image(podman: Podman) -> str:
    """debootstrap's minbase with python3 (a venv on PATH), fuse3 and the host's CA bundle, imported."""
    key = _key(SUITE, PACKAGES, PATH, HOST_CA.read_bytes() if HOST_CA.exists() else b"")
    tag = f"localhost/mithrilfs-test-base:{key}"
    if podman("image", "exists", tag, check=False).returncode == 0:
        return tag
    tarball = CACHE / f"base-{key}.tar"
    if not tarball.exists():
        rootfs = CACHE / f"rootfs-{key}.{os.getpid()}"
        subprocess.run(["debootstrap", "--variant=minbase", f"--include={PACKAGES}", SUITE, str(rootfs)],
                       check=True, capture_output=True, timeout=500)
        subprocess.run(["chroot", str(rootfs), "python3", "-m", "venv", "/opt/venv"], check=True, timeout=120)
        if HOST_CA.exists():  # pip and apps inside trust what the host trusts (a proxy's CA, say)
            shutil.copyfile(HOST_CA, rootfs / "etc/ssl/certs/ca-certificates.crt")
        for junk in (rootfs / "var/cache/apt/archives").glob("*.deb"):
            junk.unlink()
        tmp = tarball.with_suffix(f".{os.getpid()}.tmp")
        try:
            subprocess.run(["tar", "-C", str(rootfs), "-cf", str(tmp), "."], check=True, timeout=300)
            tmp.rename(tarball)
        finally:
            tmp.unlink(missing_ok=True)
            shutil.rmtree(rootfs, ignore_errors=True)
    podman("import", "--change", f"ENV PATH={PATH}", "--change", 'CMD ["/bin/bash"]', str(tarball), tag)
    return tag


def _host_pip_settings() -> tuple[list[str], list[str]]:
    """The host's pip settings (any config file or PIP_ variable) as podman -e and -v arguments."""
    out = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True,
                         timeout=60).stdout
    envs, vols = [], []
    for line in out.splitlines():
        key, sep, value = line.partition("=")
        if not sep or "." not in key:
            continue
        name, value = key.split(".", 1)[1], value.strip().strip("'\"")
        envs += ["-e", f"PIP_{name.upper().replace('-', '_')}={value}"]
        for word in value.split():
            path = word.removeprefix("file://")
            if word.startswith("file://"):  # a local index: its pages point next to it (ROOT/simple -> ROOT/files)
                path = os.path.dirname(path.rstrip("/"))
            if path.startswith("/") and os.path.exists(path):
                vols += ["-v", f"{path}:{path}:ro"]
    return envs, vols


def _wheelhouse(podman: Podman, base: str) -> Path:
    """mithrilfs's dependencies and build requirements, for the base image's python, fetched as the host's pip would."""
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    reqs = [*project["build-system"]["requires"], "wheel", *project["project"]["dependencies"]]
    wh = CACHE / f"wheelhouse-{_key(base, *reqs)}"
    if not wh.exists():
        tmp = wh.with_suffix(f".{os.getpid()}.tmp")
        tmp.mkdir(parents=True)
        try:
            envs, vols = _host_pip_settings()
            podman("run", "--rm", "-v", f"{tmp}:/wheelhouse", *vols, *envs, base,
                   "pip", "download", "-q", "-d", "/wheelhouse", *reqs)
            (tmp / "pip.conf").write_text("[global]\nno-index = true\nfind-links = /wheelhouse\n")
            tmp.rename(wh)
        finally:
            shutil.rmtree(tmp, ignore_errors=True)
    return wh


@dataclass
class Images:
    podman: Podman
    base: str
    image: str
    build_seconds: float


@pytest.fixture(scope="module")
def images(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Images]:
    conf = tmp_path_factory.mktemp("podman")
    for d in (CACHE / "podman", RUN):
        d.mkdir(parents=True, exist_ok=True)
    _write_conf(conf)
    podman = Podman(conf)
    probe = podman("info", check=False)
    if probe.returncode != 0:
        pytest.skip(f"podman cannot run here: {probe.stderr.strip().splitlines()[-1:]}")
    base = _base_image(podman)
    wh = _wheelhouse(podman, base)
    image = f"localhost/mithrilfs-test:{os.getpid()}"
    t0 = time.monotonic()
    podman("build", "--format", "docker", "--network", "host", "--build-arg", f"BASE={base}",
           "--build-arg", "PIP_CONFIG_FILE=/wheelhouse/pip.conf", "-v", f"{wh}:/wheelhouse:ro",
           "-t", image, str(REPO), timeout=500)
    built = Images(podman, base, image, time.monotonic() - t0)
    size = podman("image", "inspect", image, "--format", "{{.Size}}").stdout.strip()
    print(f"\nimage {image}: built in {built.build_seconds:.1f} s, {int(size) / 1e6:.0f} MB")
    try:
        yield built
    finally:
        podman.cleanup()
        podman("rmi", "-f", image, check=False)




def _mounted_and_answering(mp: Path) -> bool:
    return is_mounted(mp) and (mp / ".mithrilfs" / "pid").exists()


def _mountinfo(images: Images, container: str) -> str:
    return images.podman("exec", container, "cat", "/proc/self/mountinfo").stdout


def test_sidecar_image(images: Images, shared_dir: Path, tmp_path: Path):
    podman, store = images.podman, tmp_path / "store"
    store.mkdir()
    cache = shared_dir / "cache"
    side = podman.name("side")
    sidecar = ["run", "-d", "--name", side, "--device", "/dev/fuse", "--cap-add", "SYS_ADMIN",
               "-v", f"{shared_dir}:/mithrilfs:rshared", "-v", f"{store}:/store", images.image]
    podman(*sidecar)
    wait_for(lambda: _mounted_and_answering(cache), what="the sidecar's mount to reach the host")

    # host -> app container (rslave), and app container -> host
    write_committed(cache / "from-host", b"written on the host")
    app = ["run", "--rm", "-v", f"{shared_dir}:/mithrilfs:rslave", images.base]
    res = podman(*app, "sh", "-c", "cat /mithrilfs/cache/from-host && printf 'written in the app' "
                 "> /mithrilfs/cache/from-app && sync /mithrilfs/cache/from-app")
    assert res.stdout == "written on the host"
    assert (cache / "from-app").read_bytes() == b"written in the app"
    # the app image has no mithrilfs: the sidecar's .mithrilfs/env puts every JIT cache on the mount,
    # Inductor's precompiled headers through a link in the app's own /tmp
    res = podman(*app, "sh", "-c", 'eval "$(cat /mithrilfs/cache/.mithrilfs/env)" && echo "$TORCH_EXTENSIONS_DIR" '
                 '&& readlink "/tmp/torchinductor_$(id -un)/precompiled_headers" && ! command -v mithrilfs')
    assert res.stdout.split() == ["/mithrilfs/cache/torch_extensions", "/mithrilfs/cache/inductor-headers"]
    assert (cache / "inductor-headers").is_dir()

    # stats and the image's HEALTHCHECK (podman healthcheck run fails when the image has none)
    stats = podman("exec", side, "mithrilfs", "stats", "/mithrilfs/cache")
    assert "files" in stats.stdout and "hit rate" in stats.stdout
    assert podman("healthcheck", "run", side, check=False).returncode == 0
    assert podman("inspect", side, "--format", "{{.State.Health.Status}}").stdout.strip() == "healthy"

    # an app started after the mount exists sees a restarted sidecar's new mount
    running_app = podman.name("app")
    podman("run", "-d", "--name", running_app, "-v", f"{shared_dir}:/mithrilfs:rslave", images.base, "sleep", "600")
    assert podman("exec", running_app, "cat", "/mithrilfs/cache/from-host").stdout == "written on the host"
    podman("stop", "-t", "30", side)
    assert podman("inspect", side, "--format", "{{.State.ExitCode}}").stdout.strip() == "0"
    assert not is_mounted(cache), "a dead mount was left on the host"
    assert " /mithrilfs/cache " not in _mountinfo(images, running_app), "the unmount did not reach the app"
    podman("start", side)
    wait_for(lambda: _mounted_and_answering(cache), what="the restarted sidecar's mount")
    wait_for(lambda: " /mithrilfs/cache " in _mountinfo(images, running_app), what="the new mount in the app")
    assert podman("exec", running_app, "cat", "/mithrilfs/cache/from-app").stdout == "written in the app"

    # SIGTERM: clean unmount, exit 0, nothing left on the host, a store that passes fsck
    podman("stop", "-t", "30", side)
    assert podman("inspect", side, "--format", "{{.State.ExitCode}}").stdout.strip() == "0"
    assert not is_mounted(cache)
    assert " /mithrilfs/cache " not in _mountinfo(images, running_app)
    fsck = run_cli("fsck", "--store", str(store))
    assert fsck.returncode == 0, fsck.stdout + fsck.stderr


def test_sidecar_on_a_volume_root_warns(images: Images, shared_dir: Path, tmp_path: Path):
    """Mounting on the shared volume's root is what strands apps on a dead mount: the entrypoint says so."""
    podman = images.podman
    side = podman.name("root")
    (tmp_path / "store").mkdir()
    podman("run", "-d", "--name", side, "--device", "/dev/fuse", "--cap-add", "SYS_ADMIN",
           "-e", "MITHRILFS_MOUNTPOINT=/cache", "-v", f"{shared_dir}:/cache:rshared", "-v", f"{tmp_path}/store:/store",
           images.image)
    wait_for(lambda: _mounted_and_answering(shared_dir), what="the sidecar's mount")
    logs = podman("logs", side).stderr
    assert "/cache is a volume's root" in logs and "subdirectory" in logs
    podman("stop", "-t", "30", side)
    assert not is_mounted(shared_dir)


def _compose_for_test(shared_dir: Path, store: Path, images: Images) -> dict:
    """deploy/docker-compose.yaml with only the host-specific parts replaced: this test's directories and
    images, no build section (the image is built already).  podman-compose gives the project a bridge
    network of its own (its CNI file under the tests' run root), removed afterwards."""
    compose = yaml.safe_load((REPO / "deploy" / "docker-compose.yaml").read_text())
    side, app = compose["services"]["mithrilfs"], compose["services"]["app"]
    side.pop("build")
    side["image"] = images.image
    side["volumes"] = [
        {**v, "source": str(shared_dir)} if isinstance(v, dict) and v["target"] == "/mithrilfs"
        else f"{store}:/store" for v in side["volumes"]]
    app["image"], app["command"] = images.base, ["sleep", "600"]
    app["volumes"] = [{**v, "source": str(shared_dir)} for v in app["volumes"]]
    compose.pop("volumes")
    return compose


def test_compose_file(images: Images, shared_dir: Path, tmp_path: Path):
    podman, store = images.podman, tmp_path / "store"
    store.mkdir()
    cache = shared_dir / "cache"
    f = tmp_path / "compose.yaml"
    f.write_text(yaml.safe_dump(_compose_for_test(shared_dir, store, images)))
    project = f"mithrilfs-test-{os.getpid()}"
    compose = ["podman-compose", "-p", project, "-f", str(f)]

    def run(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run([*compose, *args], capture_output=True, text=True, timeout=300, env=podman.env,
                              cwd=tmp_path)

    side, app = f"{project}_mithrilfs_1", f"{project}_app_1"
    podman.names += [side, app]
    try:
        res = run("up", "-d")
        assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
        wait_for(lambda: _mounted_and_answering(cache), what="the compose sidecar's mount")
        write_committed(cache / "from-host", b"host")
        wait_for(lambda: podman("exec", app, "cat", "/mithrilfs/cache/from-host", check=False).stdout == "host",
                 what="the app container to see the mount")
        podman("exec", app, "sh", "-c", "printf app > /mithrilfs/cache/from-app && sync /mithrilfs/cache/from-app")
        assert (cache / "from-app").read_bytes() == b"app"
        assert podman("exec", side, "mithrilfs", "stats", "/mithrilfs/cache").returncode == 0
        assert podman("healthcheck", "run", side, check=False).returncode == 0
        res = run("down")
        assert res.returncode == 0, res.stderr[-2000:]
        assert not is_mounted(cache), "a dead mount was left on the host"
        fsck = run_cli("fsck", "--store", str(store))
        assert fsck.returncode == 0, fsck.stdout + fsck.stderr
    finally:
        run("down")
        podman("network", "rm", "-f", f"{project}_default", check=False)
        podman("pod", "rm", "-f", f"pod_{project}", check=False)
