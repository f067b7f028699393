"""``push`` against a real redis-server and a real SeaweedFS bucket: when it returns, a node mounted at
that moment finds what it pushed."""

from __future__ import annotations

import os
import re
import subprocess
import sys

import pytest
from conftest import MountFactory, RedisServer, SeaweedFS, run_cli

TRIES = 20


@pytest.fixture(params=["redis", "s3"])
def remote(request: pytest.FixtureRequest, redis_server: RedisServer) -> tuple[tuple[str, ...], dict[str, str]]:
    """A node's ``--remote`` arguments and environment: Redis alone, or a bucket of this test's own."""
    if request.param == "redis":
        return ("--remote", redis_server.url, "--min-age", "0"), {}
    weed: SeaweedFS = request.getfixturevalue("shared_seaweedfs")
    bucket = "push-" + re.sub(r"[^a-z0-9]+", "-", request.node.name.lower())[-40:].strip("-")
    weed.create_bucket(bucket)
    return ("--remote", f"s3://{bucket}/cache", "--min-age", "0"), weed.env()


def test_a_node_mounted_when_push_returns_finds_what_it_pushed(mount_factory: MountFactory,
                                                               remote: tuple[tuple[str, ...], dict[str, str]]):
    """A compile's cache files written, ``sync``, ``push``: a new node mounted the moment ``push`` returns
    opens them at its first try, every time (each try new directories, a new node: a first lookup)."""
    args, env = remote
    a = mount_factory("a", *args, env=env)
    for i in range(TRIES):
        kernel = a.mountpoint / "triton" / f"h{i:02d}"
        kernel.mkdir(parents=True)
        files = {f"triton/h{i:02d}/k.py": os.urandom(2000), f"triton/h{i:02d}/k.json": b"{}",
                 f"triton/h{i:02d}/k.cubin": os.urandom(30_000)}
        for path, data in files.items():
            (a.mountpoint / path).write_bytes(data)  # closed, not fsynced: a compiler's way
        os.sync()
        res = run_cli("push", str(a.mountpoint))
        assert res.returncode == 0 and res.stdout.startswith("pushed "), res.stderr
        b = mount_factory(f"b{i}", *args, env=env)
        # another process opens each file once: a miss would be the kernel's answer for seconds
        read = subprocess.run([sys.executable, "-c", "import sys\nfor p in sys.argv[1:]:\n"
                               "    sys.stdout.buffer.write(open(p, 'rb').read())",
                               *(str(b.mountpoint / p) for p in files)], capture_output=True, timeout=60)
        assert read.returncode == 0, f"try {i}: {read.stderr.decode()[-300:]}"
        assert read.stdout == b"".join(files.values()), f"try {i}"
        b.umount()
