"""The one place a mount's shared store is built from its options: Redis, a bucket, or Redis in front of one.

``--remote`` names one store, or two (``--remote redis://... --remote
s3://...``: Redis in front of the bucket).  Everything above this module
sees one ``wire.RemoteStore``.
"""

from __future__ import annotations

from dataclasses import dataclass

from mithrilfs.shared.stores.base import RemoteStore, new_counters
from mithrilfs.shared.stores.entries import RemoteError
from mithrilfs.shared.stores.redis import store as redis_wire
from mithrilfs.shared.stores.redis import url as redis_url
from mithrilfs.shared.stores.s3.settings import S3Location, S3Settings

__all__ = ["RemoteError", "RemoteSpec", "check_remotes", "is_s3", "open_bucket", "open_remote"]


def is_s3(url: str) -> bool:
    return url.startswith("s3://")


def check_url(url: str) -> None:
    """ValueError with a one-line reason unless *url* is a Redis URL or an ``s3://BUCKET/PREFIX``."""
    if is_s3(url):
        S3Location.parse(url)
    elif url.startswith(("redis://", "rediss://")) or "://" not in url:
        redis_url.check_url(url)
    else:
        raise ValueError(f"invalid remote {redis_url.redact(url)!r} (use redis://host:port/db, rediss://... or"
                         " s3://BUCKET/PREFIX)")


def check_remotes(urls: list[str]) -> None:
    """ValueError unless the list is one store, or Redis in front of a bucket."""
    if len(urls) > 2:
        raise ValueError("--remote names at most two stores (Redis in front of a bucket)")
    if len(urls) == 2 and (is_s3(urls[0]) or not is_s3(urls[1])):
        raise ValueError("two --remote stores are Redis in front of a bucket: --remote redis://... --remote s3://...")


@dataclass(frozen=True)
class RemoteSpec:
    """What a mount asked for (``--remote`` once or twice, and the options that go with them)."""

    url: str
    namespace: str = "default"
    key: bytes | None = None
    password: str | None = None
    cluster: bool = False
    #: A bucket behind the Redis of *url*.
    behind: str | None = None
    s3: S3Settings | None = None


def open_bucket(spec: RemoteSpec) -> RemoteStore:
    """The bucket *spec* names (alone, or the one behind its Redis)."""
    from mithrilfs.shared.stores.s3.store import S3Store

    url = spec.url if is_s3(spec.url) else spec.behind
    if url is None:
        raise ValueError("no bucket: the remote is Redis alone")
    return S3Store(S3Location.parse(url), spec.namespace, spec.key, spec.s3 or S3Settings())


def open_remote(spec: RemoteSpec) -> RemoteStore:
    """The store *spec* names; nothing connects until its first request."""
    from mithrilfs.shared.stores.layered.store import HOT_TTL, LayeredStore
    from mithrilfs.shared.stores.s3.store import S3Store

    counters = new_counters()
    s3 = spec.s3 or S3Settings()
    if is_s3(spec.url):
        return S3Store(S3Location.parse(spec.url), spec.namespace, spec.key, s3, counters=counters)
    front = redis_wire.RedisStore(spec.url, spec.namespace, spec.key, password=spec.password, cluster=spec.cluster,
                                  counters=counters, blob_ttl=HOT_TTL if spec.behind else None)
    if spec.behind is None:
        return front
    return LayeredStore(front, S3Store(S3Location.parse(spec.behind), spec.namespace, spec.key, s3, counters=counters))
