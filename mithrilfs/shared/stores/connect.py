"""The one place that knows which backend a store is: Redis, a bucket, or Redis in front of one.

``--remote`` names one store, or two (``--remote redis://... --remote
s3://...``: Redis in front of the bucket); the URL's scheme names the
backend package (``redis``, ``s3``, ``layered``; ``memory``, which tests
build themselves).  Each package has the
store (``store``), its change feed (``feed``) and its half of ``fleet gc``
(``gc``); this module builds them (``open_remote``, ``open_feed``,
``collector_for``), and everything above it sees one ``base.RemoteStore``,
one ``feed.FeedWire`` and one ``collector.Collector``, never which backend
they are.

The bucket's and the layered packages are imported when a store is opened:
a command that only checks a URL starts without them (the bucket's modules
bring its client code and trio, about 0.2 s).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from mithrilfs.shared.stores.base import RemoteStore, new_counters
from mithrilfs.shared.stores.collector import Collector
from mithrilfs.shared.stores.entries import RemoteError
from mithrilfs.shared.stores.feed import FeedWire, NullFeed
from mithrilfs.shared.stores.redis import url as redis_url
from mithrilfs.shared.stores.redis.feed import RedisFeed
from mithrilfs.shared.stores.redis.gc import RedisCollector
from mithrilfs.shared.stores.redis.store import RedisStore
from mithrilfs.shared.stores.s3.settings import S3Location, S3Settings

__all__ = ["RemoteError", "RemoteSpec", "check_remotes", "collector_for", "is_s3", "open_bucket", "open_feed",
           "open_remote"]


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
    from mithrilfs.shared.stores.s3.store import S3Store  # see the module doc

    url = spec.url if is_s3(spec.url) else spec.behind
    if url is None:
        raise ValueError("no bucket: the remote is Redis alone")
    return S3Store(S3Location.parse(url), spec.namespace, spec.key, spec.s3 or S3Settings())


def open_remote(spec: RemoteSpec) -> RemoteStore:
    """The store *spec* names; nothing connects until its first request."""
    from mithrilfs.shared.stores.layered.store import HOT_TTL, LayeredStore  # see the module doc
    from mithrilfs.shared.stores.s3.store import S3Store

    counters = new_counters()
    s3 = spec.s3 or S3Settings()
    if is_s3(spec.url):
        return S3Store(S3Location.parse(spec.url), spec.namespace, spec.key, s3, counters=counters)
    front = RedisStore(spec.url, spec.namespace, spec.key, password=spec.password, cluster=spec.cluster,
                       counters=counters, blob_ttl=HOT_TTL if spec.behind else None)
    if spec.behind is None:
        return front
    return LayeredStore(front, S3Store(S3Location.parse(spec.behind), spec.namespace, spec.key, s3, counters=counters))


@dataclass(frozen=True)
class _Parts:
    """What a backend package builds on one of its stores besides the store itself."""

    feed: Callable[[], FeedWire]
    collector: Callable[[], Collector]
    #: The key the feed's records are signed with (None: unsigned).
    key: bytes | None


def _parts(store: RemoteStore) -> _Parts:
    """The one dispatch on a store's class: its backend's feed and collector."""
    if isinstance(store, RedisStore):
        return _Parts(lambda: RedisFeed(store), lambda: RedisCollector(store), store.codec.key)
    from mithrilfs.shared.stores.layered.feed import LayeredFeed  # see the module doc
    from mithrilfs.shared.stores.layered.gc import LayeredCollector
    from mithrilfs.shared.stores.layered.store import LayeredStore
    from mithrilfs.shared.stores.s3.feed import S3Feed
    from mithrilfs.shared.stores.s3.gc import S3Collector
    from mithrilfs.shared.stores.s3.store import S3Store

    if isinstance(store, S3Store):
        return _Parts(lambda: S3Feed(store), lambda: S3Collector(store), store.codec.key)
    if isinstance(store, LayeredStore):
        front, back = _parts(store.front), _parts(store.back)
        return _Parts(lambda: LayeredFeed(front.feed(), back.feed()),
                      lambda: LayeredCollector(store, front.collector(), back.collector()), front.key)
    from mithrilfs.shared.stores.memory.feed import MemoryFeed
    from mithrilfs.shared.stores.memory.gc import MemoryCollector
    from mithrilfs.shared.stores.memory.store import MemoryStore

    if isinstance(store, MemoryStore):
        return _Parts(lambda: MemoryFeed(store), lambda: MemoryCollector(store), store.codec.key)
    return _Parts(NullFeed, lambda: _no_gc(store), None)


def _no_gc(store: RemoteStore) -> Collector:
    raise RemoteError(f"no gc for {store.url}")


def open_feed(store: RemoteStore) -> tuple[FeedWire, bytes | None]:
    """The change feed of *store* and the key its records are signed with (a store with none: ``NullFeed``)."""
    parts = _parts(store)
    return parts.feed(), parts.key


def collector_for(store: RemoteStore) -> Collector:
    """*store*'s half of ``fleet gc``; RemoteError for a store gc cannot collect."""
    return _parts(store).collector()
