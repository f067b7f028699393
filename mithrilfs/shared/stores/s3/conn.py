"""A connection to one bucket: its clients by timeout, errors mapped to RemoteError, the basic requests.

The base of ``stores.s3.store.S3Store`` and what its parts (``stores.s3.blobs``,
``stores.s3.packs``, ``stores.s3.repair``), the gc (``stores.s3.gc``), the purge and the change
feed talk through: the obstore clients (one per timeout, so a small request
never waits a large one's), the pool that runs a batch's requests in
parallel, one availability level with its back-off, and GET/PUT that count
what moved.  Errors name the cause in one line and never carry a secret.
"""

from __future__ import annotations

import logging
import random
import re
import threading
import time
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from datetime import timedelta
from typing import Any

from mithrilfs.shared.stores.base import Level, new_counters
from mithrilfs.shared.stores.clock import TierClock
from mithrilfs.shared.stores.s3.settings import S3Location, S3Settings

# obstore is imported where it is used: a mount without an s3 remote starts without it

log = logging.getLogger("mithrilfs.shared.s3_wire")  # the name operators know from the logs

#: Bodies are read in chunks of this size, each counted as it arrives: the mount's bound on a wait
#: (``REMOTE_WAIT`` without progress) then holds for links down to 128 KiB/s.
PROGRESS_BYTES = 256 << 10
#: A blob up to this size is put in one request; larger ones in parts of it, streamed from the file.
PART_BYTES = 8 << 20
#: Parallel requests of one batch (HEADs, GETs, manifest updates).
PARALLEL = 16
CONNECT_TIMEOUT = timedelta(seconds=1)
#: HEADs and small blobs: a stalled endpoint costs this, not a hang.
QUICK_TIMEOUT = timedelta(seconds=2)
#: Manifests, startup sets and the epoch: objects that grow with a directory (a 100,000-name manifest is 30 MB).
NAMES_TIMEOUT = timedelta(seconds=10)
#: Transfers of large blobs (a large blob over a slow link).
BULK_TIMEOUT = timedelta(seconds=120)
#: Blobs up to this size go through the quick client.
QUICK_BLOB_BYTES = 1 << 20
#: The first pause before a request the bucket asked to slow down for is sent again (the client's own two
#: quick retries spent); it doubles up to ``SLOWED_PAUSE_MAX``, each drawn at random below it (full jitter:
#: the nodes of a burst do not come back together).  Retried for ``SLOWED_WAIT`` at most.
SLOWED_PAUSE = 0.1
SLOWED_PAUSE_MAX = 1.0
#: How long a request the bucket keeps answering SlowDown is sent again: each such answer is the bucket
#: there and answering (progress for the mount's bound, ``RemoteStore.received``), not a stall.
SLOWED_WAIT = 30.0
#: An answer asking for fewer requests, not a failure of the bucket: S3's ``503 Slow Down`` (a HEAD's has no
#: body, only the status), a gateway's 503 or 429, the throttling codes of S3-compatible stores.
_SLOWED = re.compile(r"status code: (?:503|429)\b|<Code>(?:SlowDown|Throttling|ThrottlingException|"
                     r"RequestLimitExceeded|TooManyRequests|RequestThrottled)</Code>")


class Throttled(OSError):
    """The bucket kept asking for fewer requests for ``SLOWED_WAIT``: the request gave up (``call`` makes it a
    failure of the level, which backs off)."""


def slowed(e: BaseException) -> bool:
    """Whether a client error is the bucket asking for fewer requests (``_SLOWED``)."""
    return _SLOWED.search(str(e)) is not None


class S3Connection:
    """One namespace's clients, pool, level and counters in one bucket."""

    def __init__(self, location: S3Location, namespace: str, settings: S3Settings, *,
                 counters: dict[str, int] | None = None) -> None:
        self.location = location
        self.settings = settings
        self.namespace = namespace
        self.base = f"{location.prefix}/{namespace}/" if location.prefix else f"{namespace}/"
        self.url = location.shown(settings.endpoint)
        self.counters = counters if counters is not None else new_counters()
        self.level = Level("s3", self.url, self.counters)
        self._clients: dict[timedelta, Any] = {}
        self._pool = ThreadPoolExecutor(PARALLEL, thread_name_prefix="s3")
        self._lock = threading.Lock()
        self.clock = TierClock(self.server_time)
        #: How long a request answered SlowDown is sent again (``SLOWED_WAIT``; a test lowers it).
        self.slowed_wait = SLOWED_WAIT

    # -- clients and errors ---------------------------------------------------
    def _client(self, timeout: timedelta) -> Any:
        from obstore.store import S3Store as Client

        s = self.settings
        config: Any = {"region": s.region}  # obstore types it as a TypedDict
        if s.endpoint:
            config["endpoint"] = s.endpoint
            config["virtual_hosted_style_request"] = False
        if s.access_key_id:
            config.update(access_key_id=s.access_key_id, secret_access_key=s.secret_access_key)
            if s.session_token:
                config["session_token"] = s.session_token
        elif not s.ambient_credentials:
            config["skip_signature"] = True  # no credentials anywhere: an anonymous (public) bucket
        return Client(self.location.bucket, config=config,
                      client_options={"allow_http": True, "timeout": timeout, "connect_timeout": CONNECT_TIMEOUT},
                      retry_config={"max_retries": 2, "retry_timeout": timeout,
                                    "backoff": {"init_backoff": timedelta(milliseconds=100),
                                                "max_backoff": timedelta(seconds=1), "base": 2}})

    def _made(self, timeout: timedelta) -> Any:
        client = self._clients.get(timeout)
        if client is None:
            client = self._clients.setdefault(timeout, self._client(timeout))
        return client

    @property
    def quick(self) -> Any:
        return self._made(QUICK_TIMEOUT)

    @property
    def names(self) -> Any:
        return self._made(NAMES_TIMEOUT)

    def blobs_for(self, size: int) -> Any:
        """The client for a blob of *size* bytes: a small one must not wait minutes on a stalled endpoint."""
        return self._made(QUICK_TIMEOUT if size <= QUICK_BLOB_BYTES else BULK_TIMEOUT)

    def count(self, counter: str, n: int = 1) -> None:
        """Counters are added to from the pool's threads."""
        with self._lock:
            self.counters[counter] += n

    def levels(self) -> list[Level]:
        return [self.level]

    def why(self, e: BaseException) -> str:
        """One line naming the cause of a failed request (the client's messages run to many lines)."""
        text = str(e)
        endpoint = self.settings.endpoint or "AWS S3"
        bucket = self.location.bucket
        if "NoSuchBucket" in text:
            how = f"aws s3 mb s3://{bucket}" + (f" --endpoint-url {self.settings.endpoint}" if self.settings.endpoint
                                                else "")
            return f"bucket {bucket!r} does not exist at {endpoint} (create it: {how})"
        for code in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "AccessDenied", "InvalidToken", "ExpiredToken"):
            if code in text:
                return f"access to bucket {bucket!r} refused ({code}): check the credentials"
        if "403 Forbidden" in text:
            return f"access to bucket {bucket!r} refused (403): check the credentials"
        if "timed out" in text.lower() or "operation timed out" in text.lower() or "deadline" in text.lower():
            return f"{endpoint} did not answer in time"
        if "error sending request" in text or "Connection refused" in text or "tcp connect" in text:
            return f"cannot connect to {endpoint}"
        first = next((line.strip() for line in text.splitlines() if line.strip()), type(e).__name__)
        return first[:300]

    def call(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run *fn* against the bucket: its failures become a RemoteError and a back-off.

        Data the bucket holds is never a failure of the bucket: every parser
        here handles what it cannot read itself (counted in ``remote_rejected``).
        Nor is the bucket asking for fewer requests: the requests that carry
        a node's work (GETs, HEADs, PUTs: ``unless_absent``, ``put_object``) are sent
        again one by one (``patiently``); *fn* as a whole is run again when one
        of its other requests (a listing, a delete) was answered so.
        """
        if not self.level.available():
            raise self.level.refuse()
        import obstore.exceptions

        try:
            result = self.patiently(lambda: fn(*args))
        except (obstore.exceptions.BaseError, OSError) as e:
            raise self.level.failed(self.why(e), log) from None
        except BaseException as e:
            if type(e).__name__ != "PanicException":  # the Rust client's panic is no Exception
                raise
            raise self.level.failed(f"the S3 client failed: {str(e).splitlines()[0][:200]}", log) from None
        self.level.succeeded()
        return result

    def patiently(self, call: Callable[[], Any]) -> Any:
        """``call()``, sent again while the bucket answers that it wants fewer requests (``slowed``: S3's
        ``503 SlowDown`` under a burst), after a jittered pause that doubles (``SLOWED_PAUSE``), for at most
        ``slowed_wait`` (``SLOWED_WAIT``) from the first such answer; then ``Throttled``.  The level counts and logs it
        (``Level.slowed``: a line a minute, not one per request), and does not back off for it.

        The client cannot show the answer's ``Retry-After`` (S3 sends none with SlowDown): the pauses are
        ours.  Other errors propagate unchanged."""
        import obstore.exceptions

        deadline = 0.0
        pause = SLOWED_PAUSE
        while True:
            try:
                return call()
            except obstore.exceptions.BaseError as e:
                if not slowed(e):
                    raise
                now = time.monotonic()
                deadline = deadline or now + self.slowed_wait
                self.level.slowed(log)
                if now >= deadline:
                    raise Throttled(f"asked to slow down for {self.slowed_wait:g} s: {self.why(e)}") from None
                time.sleep(min(random.uniform(0, pause), deadline - now))
                pause = min(2 * pause, SLOWED_PAUSE_MAX)

    def unless_absent(self, call: Callable[[], Any]) -> Any:
        """*call*'s answer (a GET or HEAD, counted as one request), None when the object does not exist;
        a missing bucket is no missing object, but an error."""
        try:
            result = self.patiently(call)
        except FileNotFoundError as e:
            if "NoSuchBucket" in str(e):
                raise
            result = None
        self.level.moved()
        return result

    def get_object(self, client: Any, key: str, limit: int) -> tuple[bytes | None, str | None] | None:
        """(an object's bytes, its ETag), None when absent; the bytes are None when it holds more than
        *limit* (never read: hostile or broken), the ETag None when the server gave none."""
        result = self.unless_absent(lambda: obstore_api().get(client, self.base + key))
        if result is None:
            return None
        etag = result.meta.get("e_tag") or None
        if result.meta["size"] > limit:
            return None, etag
        parts = []
        for chunk in result.stream(min_chunk_size=PROGRESS_BYTES):
            parts.append(bytes(chunk))
            self.level.moved(down=len(parts[-1]), requests=0)  # as it arrives: the bound on a wait sees progress
        return b"".join(parts), etag

    def put_object(self, client: Any, key: str, data: Any, mode: Any, size: int) -> bool:
        """Put an object; False when the condition failed (someone else wrote it first)."""
        import obstore.exceptions

        try:
            self.patiently(lambda: obstore_api().put(client, self.base + key, data, mode=mode, chunk_size=PART_BYTES))
        except (obstore.exceptions.AlreadyExistsError, obstore.exceptions.PreconditionError):
            self.level.moved()
            return False
        self.level.moved(up=size)
        return True

    def first_page(self, prefix: str) -> list[str]:
        """The keys under *prefix* (relative to the namespace), one LIST page: a few records are listed there,
        and a flood of planted keys costs one request."""
        keys = []
        for batch in obstore_api().list(self.names, prefix=self.base + prefix, chunk_size=1000):
            keys += [meta["path"][len(self.base):] for meta in batch]
            break
        self.level.moved()
        return keys

    def server_time(self) -> float:
        """The bucket's clock, unix seconds: the ``Last-Modified`` of an object written now (``clock``, one
        per namespace, a few bytes; a PUT and a HEAD), plus half a second: it has whole seconds, cut down,
        so the middle of its second is the best guess (``stores.clock`` allows for the error)."""
        def ask() -> float:
            self.put_object(self.quick, "clock", b"t", "overwrite", 1)
            meta = self.unless_absent(lambda: obstore_api().head(self.quick, self.base + "clock"))
            if meta is None:
                raise FileNotFoundError("the clock object vanished as it was written")
            return float(meta["last_modified"].timestamp()) + 0.5

        return float(self.call(ask))

    def parallel(self, fn: Callable[[Any], Any], items: Iterable[Any]) -> list[Any]:
        return list(self._pool.map(fn, items))

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)


def obstore_api() -> Any:
    """The obstore module, imported at first use (a mount without an s3 remote starts without it)."""
    import obstore

    return obstore
