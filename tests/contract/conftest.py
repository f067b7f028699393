"""The contract suite's backends: every scenario in tests/contract runs once on each (fsspec's tests/abstract).

``tier`` is parametrized over the backends: Redis, a Redis Cluster, a bucket
(SeaweedFS) with small blobs in packs and with every blob loose, Redis in
front of the bucket, and the in-memory store.  The servers live for the
session (started by the first test that needs them, killed by PID); each
test gets a namespace of its own on them, which is what makes a tier fresh.
The real stores are opened through ``connect.open_remote``, as a mount opens
them.  A test plants data the way another writer with access would (a
``redis-cli`` HSET, an S3 PUT, the memory server's dicts): ``Tier.plant_entry``
and ``Tier.plant_blob`` (into both levels of a layered store).
"""

from __future__ import annotations

import itertools
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
from conftest import RedisCluster, RedisServer, SeaweedFS, free_port

from mithrilfs.shared.stores import records
from mithrilfs.shared.stores.base import RemoteStore
from mithrilfs.shared.stores.connect import RemoteSpec, open_remote
from mithrilfs.shared.stores.layered.store import LayeredStore
from mithrilfs.shared.stores.memory.store import MemoryServer, MemoryStore
from mithrilfs.shared.stores.redis.store import RedisStore
from mithrilfs.shared.stores.s3 import blobs as s3_blobs
from mithrilfs.shared.stores.s3 import packs as s3_packs
from mithrilfs.shared.stores.s3.settings import S3Settings
from mithrilfs.shared.stores.s3.store import S3Store

BACKENDS = ["memory", "redis", "redis-cluster", "s3-packs", "s3-loose", "redis+s3"]
BUCKET = "contract"
_namespaces = itertools.count()


def _running(server: Any) -> Iterator[Any]:
    """*server* started for the session, stopped (by PID) after its last test."""
    try:
        yield server.start()
    finally:
        server.stop()


@pytest.fixture(scope="session")
def contract_redis() -> Iterator[RedisServer]:
    yield from _running(RedisServer(free_port()))


@pytest.fixture(scope="session")
def contract_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[RedisCluster]:
    yield from _running(RedisCluster(tmp_path_factory.mktemp("cluster")))


@pytest.fixture(scope="session")
def contract_seaweedfs(tmp_path_factory: pytest.TempPathFactory) -> Iterator[SeaweedFS]:
    for weed in _running(SeaweedFS(tmp_path_factory.mktemp("seaweedfs"))):
        weed.create_bucket(BUCKET)
        yield weed


@dataclass
class Tier:
    """A fresh namespace on one backend: ``node()`` opens a store on it (one node of a fleet) each call."""

    backend: str
    namespace: str
    opener: Callable[[str, bytes | None], RemoteStore]
    made: list[RemoteStore] = field(default_factory=list)

    def node(self, key: bytes | None = None, namespace: str | None = None) -> RemoteStore:
        store = self.opener(namespace or self.namespace, key)
        self.made.append(store)
        return store

    def plant_entry(self, store: RemoteStore, dir_path: str, name: bytes, raw: bytes) -> None:
        """Write *raw* as the value of *name* in *dir_path*, unchecked, as a writer with access could."""
        for level in _levels(store):
            if isinstance(level, MemoryStore):
                with level.server.lock:
                    level.space.dirs.setdefault(dir_path, {})[name] = raw
            elif isinstance(level, RedisStore):
                level.client.hset(level.dir_key(dir_path), name, raw)
            else:
                assert isinstance(level, S3Store)
                held, etag = level.read_manifest(dir_path)
                assert level.write_manifest(dir_path, held | {name: raw}, etag)

    def plant_blob(self, store: RemoteStore, hex_digest: str, data: bytes) -> None:
        """Put *data* where the store keeps the blob *hex_digest* (in its own object), unchecked."""
        import obstore

        for level in _levels(store):
            if isinstance(level, MemoryStore):
                with level.server.lock:
                    level.space.blobs[hex_digest] = (data, level.server.time())
            elif isinstance(level, RedisStore):
                level.client.set(level.blob_key(hex_digest, 0), data)
            else:
                assert isinstance(level, S3Store)
                obstore.put(level.quick, level.base + level.blobs.blob_key(hex_digest), data)


def _levels(store: RemoteStore) -> list[RemoteStore]:
    return [store.front, store.back] if isinstance(store, LayeredStore) else [store]


@pytest.fixture(params=BACKENDS)
def tier(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[Tier]:
    backend: str = request.param
    namespace = f"c{next(_namespaces)}-{time.time_ns() % 10**9}"
    if backend == "memory":
        server = MemoryServer()

        def opener(ns: str, key: bytes | None) -> RemoteStore:
            return MemoryStore(server, ns, key)
    else:
        spec = _spec(request, backend)
        if backend == "s3-loose":  # every blob its own object: no packs
            monkeypatch.setattr(s3_packs, "PACK_BLOB_BYTES", 0)
            monkeypatch.setattr(s3_blobs, "PACK_BLOB_BYTES", 0)

        def opener(ns: str, key: bytes | None) -> RemoteStore:
            return open_remote(RemoteSpec(**spec, namespace=ns, key=key))
    made = Tier(backend, namespace, opener)
    try:
        yield made
    finally:
        for store in made.made:
            store.close()


def _spec(request: pytest.FixtureRequest, backend: str) -> dict:
    """The ``RemoteSpec`` fields of a real backend (its servers started on first use)."""
    if backend == "redis":
        return {"url": request.getfixturevalue("contract_redis").url}
    if backend == "redis-cluster":
        return {"url": request.getfixturevalue("contract_cluster").url, "cluster": True}
    weed: SeaweedFS = request.getfixturevalue("contract_seaweedfs")
    s3 = {"s3": S3Settings(endpoint=weed.endpoint, access_key_id=weed.access_key, secret_access_key=weed.secret_key)}
    if backend == "redis+s3":
        return {"url": request.getfixturevalue("contract_redis").url, "behind": f"s3://{BUCKET}/p", **s3}
    return {"url": f"s3://{BUCKET}/p", **s3}


@pytest.fixture
def store(tier: Tier) -> RemoteStore:
    """A fresh store of each backend (a new namespace on the backend's server)."""
    return tier.node()


@pytest.fixture
def limits(monkeypatch: pytest.MonkeyPatch) -> Callable[..., None]:
    """Lower the record limits (``RECORDS_KEPT``, ``PURGES_READ``, ...) where they are read (``stores.records``)."""
    def lower(**values: int) -> None:
        for module in (records,):
            for name, value in values.items():
                if hasattr(module, name):
                    monkeypatch.setattr(module, name, value)

    return lower


@pytest.fixture
def blob_file(tmp_path: Path) -> Callable[[bytes], tuple[str, str]]:
    """A blob's (hex, file path) as the uploader hands it over."""
    from mithrilfs.store.cas import hash_bytes

    def make(data: bytes) -> tuple[str, str]:
        h = hash_bytes(data).hex()
        path = tmp_path / h
        path.write_bytes(data)
        return h, str(path)

    return make
