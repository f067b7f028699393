"""A connection to one Redis server or cluster: the client, errors mapped to RemoteError, the epoch.

The base of ``stores.redis.store.RedisStore`` and what its parts (``stores.redis.blobs``,
``stores.redis.records``) and the gc (``stores.redis.gc``) talk through: one client made at
first use, one availability level with its back-off, and the key names that
several parts share.  Error messages and logs never carry the password.
"""

from __future__ import annotations

import logging
import secrets
import threading
from collections.abc import Callable
from typing import Any

from mithrilfs.shared.stores.base import Level, new_counters
from mithrilfs.shared.stores.clock import TierClock
from mithrilfs.shared.stores.entries import EntryCodec
from mithrilfs.shared.stores.redis.url import check_url, redact, url_password

# redis-py is imported where it is used: a mount without --remote (and every CLI command)
# starts without it, 0.15 s sooner

log = logging.getLogger("mithrilfs.shared.redis_wire")  # the name operators know from the logs

CONNECT_TIMEOUT = 0.5
OP_TIMEOUT = 2.0
#: Keys per pipelined batch of reads.
BATCH = 512


class RedisConnection:
    """One namespace's client, level and counters in one Redis server or cluster."""

    def __init__(self, url: str, namespace: str, key: bytes | None = None, *, password: str | None = None,
                 cluster: bool = False, counters: dict[str, int] | None = None) -> None:
        check_url(url)
        self.url = redact(url)
        self.namespace = namespace
        self.prefix = f"mfs:{namespace}:"
        self.key = key
        self.cluster = cluster
        self._password = password or url_password(url)
        self._url = url
        self._kwargs: dict[str, Any] = dict(socket_connect_timeout=CONNECT_TIMEOUT, socket_timeout=OP_TIMEOUT)
        if password:
            self._kwargs["password"] = password
        self._client: Any = None
        self._client_lock = threading.Lock()
        #: The client of requests that wait in the server (``waiting_client``), made at first use.
        self._waiting: Any = None
        self.counters = counters if counters is not None else new_counters()
        self.level = Level("redis", self.url, self.counters)
        self.clock = TierClock(self.server_time)
        self.codec = EntryCodec(namespace, key, self.counters, horizon=self.clock.horizon_us)
        import redis.cluster  # noqa: F401  here, once: two worker threads importing it at once can each
        # find it half made ("partially initialized module")

    @property
    def client(self) -> Any:
        """The redis-py client, made at first use: a cluster client connects as it is made, and a
        tier that is down at mount time must cost a counted error, not the mount."""
        if self._client is None:
            # worker threads ask at once at mount time: a second client made beside the first would be
            # dropped, and a dropped client closes its pool, the socket another thread is reading included
            # (the "Bad file descriptor" a new node's first listing met)
            with self._client_lock:
                if self._client is None:
                    import redis.cluster

                    if self.cluster:
                        self._client = redis.cluster.RedisCluster.from_url(
                            self._url, cluster_error_retry_attempts=1, require_full_coverage=True, **self._kwargs)
                    else:
                        self._client = redis.Redis.from_url(self._url, health_check_interval=0, **self._kwargs)
        return self._client

    def waiting_client(self, timeout: float) -> Any:
        """A second client, for requests that wait in the server for news (``XREAD BLOCK``): its sockets
        time out after *timeout* seconds, not ``OP_TIMEOUT``, and a wait holds none of the first client's
        connections."""
        with self._client_lock:
            if self._waiting is None:
                import redis.cluster

                kwargs = dict(self._kwargs, socket_timeout=timeout)
                if self.cluster:
                    self._waiting = redis.cluster.RedisCluster.from_url(
                        self._url, cluster_error_retry_attempts=1, require_full_coverage=True, **kwargs)
                else:
                    self._waiting = redis.Redis.from_url(self._url, health_check_interval=0, **kwargs)
        return self._waiting

    # -- availability ----------------------------------------------------
    def levels(self) -> list[Level]:
        return [self.level]

    def _scrub(self, text: str) -> str:
        return text.replace(self._password, "***") if self._password else text

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        if not self.level.available():
            raise self.level.refuse()
        import redis

        try:
            result = fn(*args)
        except redis.exceptions.ResponseError as e:
            if "maxmemory" not in str(e):
                raise self.level.failed(self._scrub(str(e).strip()), log) from None
            # at maxmemory under noeviction: writes are refused, reads still served (no back-off); the
            # uploader retries later, and status and stats name the cause until a write succeeds
            raise self.level.failed("Redis is at its maxmemory and refuses writes (maxmemory-policy noeviction);"
                                    " uploads wait, reads are served", log, back_off=False) from None
        except (redis.RedisError, redis.exceptions.RedisClusterException, OSError) as e:
            raise self.level.failed(self._scrub(str(e).strip() or type(e).__name__), log) from None
        self.level.succeeded()
        self.level.moved()
        return result

    def ping(self) -> None:
        """Raise RemoteError naming the cause unless the server answers now (ignores the back-off)."""
        self.level.retry_now()
        self.call(lambda: self.client.ping())

    def date_by(self, clock: TierClock) -> None:
        self.clock = clock
        self.codec.horizon = clock.horizon_us

    def server_time(self) -> float:
        """The server's clock (``TIME``; a cluster's first answer), unix seconds."""
        def ask() -> float:
            answer = self.client.time()
            if isinstance(answer, dict):  # a cluster client asks its nodes: any one is the tier's time
                answer = next(iter(answer.values()))
            return int(answer[0]) + int(answer[1]) / 1e6

        return float(self.call(ask))

    # -- epoch -------------------------------------------------------------
    def _epoch_keys(self) -> list[str]:
        """One key per server: in a cluster, a key in a slot of each master."""
        if not self.cluster:
            return [f"{self.prefix}epoch"]
        keys: dict[str, str] = {}
        masters = {n.name for n in self.client.get_primaries()}
        for i in range(1 << 14):
            key = f"{self.prefix}epoch:{{e{i}}}"
            owner = self.client.nodes_manager.get_node_from_slot(self.client.keyslot(key)).name
            keys.setdefault(owner, key)
            if len(keys) == len(masters):
                break
        return sorted(keys.values())

    def epoch(self) -> tuple[str, bool]:
        """(the tier's epoch token, True when it was just made because a server had none).

        A server restarted empty (or a cluster master that lost its data)
        has no epoch key: a new token is written to every server, and each
        node, seeing a token it does not know, uploads what it has again.
        """
        def check() -> tuple[str, bool]:
            keys = self._epoch_keys()
            values = [self.client.get(k) for k in keys]
            if values[0] is not None and all(v == values[0] for v in values):
                return values[0].decode(errors="replace"), False
            token = secrets.token_hex(8)
            for k in keys:
                self.client.set(k, token)
            return token, True

        return self.call(check)

    # -- key names shared by the parts ----------------------------------------
    def blob_key(self, hex_digest: str, i: int) -> str:
        return f"{self.prefix}b:{{{hex_digest}}}:{i}"

    @property
    def blob_times_key(self) -> str:
        """A sorted set: blob hex -> when it was last written (unix seconds)."""
        return f"{self.prefix}bt"

    @property
    def used_key(self) -> str:
        """A sorted set: directory path -> when a node last used it (unix seconds)."""
        return f"{self.prefix}used"

    @property
    def purges_key(self) -> str:
        """A sorted set: the records of ``forget --fleet`` kept for startup sets -> their version."""
        return f"{self.prefix}purges"

    def redis_memory(self) -> int:
        """Bytes of memory the server (all masters) uses, for benchmarks."""
        info = self.call(lambda: self.client.info("memory"))
        if self.cluster:
            return sum(v["used_memory"] for v in info.values())
        return info["used_memory"]

    def close(self) -> None:
        """Close both clients: a request waiting in the server ends with an error."""
        for client in (self._client, self._waiting):
            if client is not None:
                client.close()

