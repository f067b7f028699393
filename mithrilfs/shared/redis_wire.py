"""The shared tier's wire layer: names and blobs in a real Redis server or Redis Cluster.

Layout under ``mfs:{namespace}:``
  ``d:{dir path}``      a HASH per directory: field = entry name, value = JSON
                        {"t": "f"|"d"|"l"|"x", "v": version, "n": node,
                         "h": blake3 hex, "s": size, "m": mode, "mt": mtime_ns,
                         "tg": symlink target, "mac": HMAC}; "x" is a tombstone
  ``b:{<hex>}:{i}``     blob content in chunks (at most CHUNK bytes each); the
                        hex in braces is a Redis Cluster hash tag, so all
                        chunks of a blob live in one slot
  ``startup:{NAME}``    a startup set: a sorted set of record ids by time, each record
                        (``startup:{NAME}:ID``) one mount's first reads (``startup_sets``)
  ``epoch[:{tag}]``     a random token per server (per master in a cluster):
                        when it changes or vanishes, the server lost its data

A conditional write (a Lua script) keeps the newest (version, node) per
name (``entries``).  Blobs are streamed chunk by chunk, never allocated by a
claimed size, and must come to exactly the entry's size and hash.  One of
the ``wire.RemoteStore`` implementations; error messages and logs never
carry the password (``redact``).
"""

from __future__ import annotations

import logging
import os
import secrets
import threading
import time
from collections.abc import Callable
from typing import Any, BinaryIO
from urllib.parse import urlparse, urlunparse

import blake3

from mithrilfs.shared import usage
from mithrilfs.shared.entries import (  # noqa: F401  (the entry model, re-exported for its older users)
    MAX_ENTRY_BYTES,
    EntryCodec,
    RemoteEntry,
    RemoteError,
    parse_entry,
)
from mithrilfs.shared.startup_sets import (
    MAX_RECORD_BYTES,
    RECORDS_KEPT,
    RECORDS_READ,
    Record,
    decode_record,
    encode_record,
    record_time,
    valid_record_id,
)
from mithrilfs.shared.wire import Level, RemoteStore, new_counters

# redis-py is imported where it is used: a mount without --remote (and every CLI command)
# starts without it, 0.15 s sooner

log = logging.getLogger(__name__)

#: Largest chunk of a blob in one Redis value (far below Redis's 512 MB limit).
CHUNK = int(os.environ.get("MITHRILFS_REMOTE_CHUNK_BYTES", 32 << 20))
CONNECT_TIMEOUT = 0.5
OP_TIMEOUT = 2.0
#: Bytes of small blobs sent in one pipeline.
_PIPELINE_BYTES = 16 << 20
#: Keys per pipelined batch of reads.
_BATCH = 512
#: A startup set's records stay this long after their last write (seconds).
RECORD_TTL = 30 * 24 * 3600
#: The field that marks a directory hash complete (no entry name holds a NUL byte); its value is when.
COMPLETE = b"\0complete"
#: A mark is trusted this long (seconds): a write Redis missed, a mark set by a reader that raced a
#: writer, an old snapshot Redis restarted from are all forgotten after it.
COMPLETE_SECONDS = 600.0


def _fresh_mark(value: bytes | None) -> bool:
    try:
        return value is not None and 0 <= time.time() - float(value) < COMPLETE_SECONDS
    except ValueError:
        return False

# KEYS[1] directory hash; ARGV: name, value, version, node, force.  Keeps the newest
# (version, node); returns {1, previous entry or nothing} when ours was written,
# {0, the newer entry} when it was not.
_SET_IF_NEWER = """
local cur = redis.call('HGET', KEYS[1], ARGV[1])
if cur and ARGV[5] ~= '1' then
  local ok, d = pcall(cjson.decode, cur)
  if ok and type(d) == 'table' and type(d.v) == 'number' and type(d.n) == 'string' then
    local v = tonumber(ARGV[3])
    if d.v > v or (d.v == v and d.n > ARGV[4]) then return {0, cur} end
  end
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
if cur then return {1, cur} end
return {1}
"""


def check_url(url: str) -> None:
    """ValueError with a one-line reason unless *url* is a redis:// or rediss:// URL."""
    parsed = urlparse(url)
    shown = redact(url)
    try:
        port = parsed.port
    except ValueError:
        raise ValueError(f"invalid remote {shown!r}: the port must be a number") from None
    if parsed.scheme not in ("redis", "rediss") or not parsed.hostname:
        raise ValueError(f"invalid remote {shown!r} (use redis://host:port/db or rediss://...)")
    if port == 0:
        raise ValueError(f"invalid remote {shown!r}: port 0")
    if parsed.path not in ("", "/") and not parsed.path.lstrip("/").isdigit():
        raise ValueError(f"invalid remote {shown!r}: the database must be a number")


def _with_password(url: str, replacement: str | None) -> str:
    """*url* with its password replaced (None: dropped, with its colon); unchanged when it has none."""
    parsed = urlparse(url)
    if parsed.password is None:
        return url
    user = parsed.username or ""
    host = parsed.hostname or ""
    if ":" in host:
        host = f"[{host}]"
    port = f":{parsed.port}" if parsed.port else ""
    userinfo = f"{user}:{replacement}@" if replacement is not None else (f"{user}@" if user else "")
    return urlunparse(parsed._replace(netloc=f"{userinfo}{host}{port}"))


def redact(url: str) -> str:
    """*url* with its password replaced by ``***`` (for logs, errors and process titles)."""
    try:
        return _with_password(url, "***")
    except ValueError:
        return "redis://***"


def url_password(url: str) -> str | None:
    return urlparse(url).password


def without_password(url: str) -> str:
    """*url* with no password at all (it is passed separately)."""
    return _with_password(url, None)


class RedisStore(RemoteStore):
    """One namespace in one Redis server or cluster; every method may raise RemoteError."""

    small_blob_bytes = CHUNK

    def __init__(self, url: str, namespace: str, key: bytes | None = None, *, password: str | None = None,
                 cluster: bool = False, counters: dict[str, int] | None = None,
                 blob_ttl: int | None = None) -> None:
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
        self._script_sha: str | None = None
        self.counters = counters if counters is not None else new_counters()
        self.level = Level("redis", self.url, self.counters)
        self.codec = EntryCodec(namespace, key, self.counters)
        #: Seconds a blob stays after its last write or read (in front of a bucket: Redis holds the hot
        #: set, the bucket everything); None: for good.
        self.blob_ttl = blob_ttl

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

    # -- availability ----------------------------------------------------
    def levels(self) -> list[Level]:
        return [self.level]

    def _scrub(self, text: str) -> str:
        return text.replace(self._password, "***") if self._password else text

    def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
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
        self._call(lambda: self.client.ping())

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

        return self._call(check)

    # -- entries -----------------------------------------------------------
    def _dir_key(self, dir_path: str) -> str:
        return f"{self.prefix}d:{dir_path}"

    def encode(self, path: str, entry: RemoteEntry) -> bytes:
        return self.codec.encode(path, entry)

    def decode(self, path: str, raw: bytes) -> RemoteEntry | None:
        return self.codec.decode(path, raw)

    def list_dir(self, dir_path: str) -> dict[bytes, RemoteEntry]:
        """Every valid entry of a directory (tombstones included), by name."""
        return self.list_dir_complete(dir_path)[0]

    def list_dirs_complete(self, dir_paths: list[str]) -> dict[str, tuple[dict[bytes, RemoteEntry], bool]]:
        """Directories' entries, and whether each was marked complete (``mark_complete``), pipelined."""
        out = {}
        for start in range(0, len(dir_paths), _BATCH):
            batch = dir_paths[start:start + _BATCH]
            for d, raw in zip(batch, self._call(self._hgetall_many, batch)):
                complete = _fresh_mark(raw.pop(COMPLETE, None))
                out[d] = (self._entries(d, raw), complete)
        return out

    def list_dir_complete(self, dir_path: str) -> tuple[dict[bytes, RemoteEntry], bool]:
        return self.list_dirs_complete([dir_path])[dir_path]

    def unmark_complete(self, dir_paths: list[str]) -> None:
        """These directories may lack names the store behind Redis has (Redis missed their writes)."""
        def unmark() -> None:
            pipe = self.client.pipeline(transaction=False)
            for d in dir_paths:
                pipe.hdel(self._dir_key(d), COMPLETE)
            pipe.execute()

        if dir_paths:
            self._call(unmark)

    def mark_complete(self, dir_paths: list[str]) -> None:
        """These directories hold every name of the store behind Redis (``layered``): read them alone."""
        def mark() -> None:
            pipe = self.client.pipeline(transaction=False)
            now = str(time.time()).encode()
            for d in dir_paths:
                pipe.hset(self._dir_key(d), COMPLETE, now)
            pipe.execute()

        if dir_paths:
            self._call(mark)

    def publish_entries(self, items: list[tuple[str, RemoteEntry]]) -> list[tuple[bool, RemoteEntry | None]]:
        """Write entries where they are newer than what Redis holds.

        For each: (written, the other entry) -- the one replaced when ours
        was written, the newer one that stayed when not.  A newer entry that
        is not valid for us (forged, unsigned, broken) does not get to stay:
        ours is written over it.
        """
        if not items:
            return []
        out = self._call(self._publish_entries, items)
        self.level.wrote()
        return out

    def _publish_entries(self, items: list[tuple[str, RemoteEntry]]) -> list[tuple[bool, RemoteEntry | None]]:
        results = self._run_script(items, force=False)
        out: list[tuple[bool, RemoteEntry | None]] = []
        forced: list[tuple[str, RemoteEntry]] = []
        for (path, entry), (written, *raw) in zip(items, results):
            other = self.decode(path, raw[0]) if raw else None
            if not written and other is None:
                forced.append((path, entry))
                written = 1
            out.append((bool(written), other))
        if forced:
            self._run_script(forced, force=True)
        self.counters["remote_uploaded_entries"] += sum(1 for w, _ in out if w)
        return out

    def _run_script(self, items: list[tuple[str, RemoteEntry]], *, force: bool) -> list[Any]:
        """Run the conditional write for each item, pipelined (per master in a cluster)."""
        if self._script_sha is None:
            self._script_sha = self.client.script_load(_SET_IF_NEWER)
        calls = []
        for path, entry in items:
            dir_path, _, name = path.rpartition("/")
            calls.append((self._dir_key(dir_path), name.encode(errors="surrogateescape"), self.encode(path, entry),
                          entry.version, entry.node, "1" if force else "0"))
        if not self.cluster:
            return self._pipelined_script(self.client, calls)
        # redis-py's cluster pipeline refuses scripts: one plain pipeline per master instead
        import redis

        by_node: dict[str, tuple[Any, list[int]]] = {}
        for i, call in enumerate(calls):
            node = self.client.get_node_from_key(call[0])
            by_node.setdefault(node.name, (node.redis_connection, []))[1].append(i)
        results: list[Any] = [None] * len(calls)
        for conn, indices in by_node.values():
            try:
                out = self._pipelined_script(conn, [calls[i] for i in indices])
            except redis.exceptions.ResponseError:  # a slot moved meanwhile: the cluster client follows it
                out = [self.client.evalsha(self._script_sha, 1, *calls[i]) for i in indices]
            for i, r in zip(indices, out):
                results[i] = r
        return results

    def _pipelined_script(self, client: Any, calls: list[tuple]) -> list[Any]:
        import redis

        for attempt in (0, 1):
            pipe = client.pipeline(transaction=False)
            for call in calls:
                pipe.evalsha(self._script_sha, 1, *call)
            try:
                return pipe.execute()
            except redis.exceptions.NoScriptError:
                if attempt:
                    raise
                self._script_sha = self.client.script_load(_SET_IF_NEWER)  # the server restarted
        raise AssertionError("unreachable")

    # -- blobs -------------------------------------------------------------
    def _blob_key(self, hex_digest: str, i: int) -> str:
        return f"{self.prefix}b:{{{hex_digest}}}:{i}"

    def note_blob_names(self, names: dict[str, str]) -> None:
        """One key per blob, set only if absent (the first node's path stays), living as long as the blob:
        ``NODE<tab>PATH``."""
        def note() -> None:
            pipe = self.client.pipeline(transaction=False)
            for h, path in names.items():
                pipe.set(f"{self.prefix}bn:{{{h}}}", path.encode(errors="surrogateescape"), nx=True, ex=self.blob_ttl)
            pipe.execute()

        if names:
            self._call(note)

    def blob_names(self, hashes: list[str]) -> dict[str, str]:
        """Paths kept by ``note_blob_names``; a value that is not a plain relative path is ignored (anyone
        with write access to Redis can put one there, and it is only ever shown)."""
        def get() -> list[Any]:
            pipe = self.client.pipeline(transaction=False)
            for h in hashes:
                pipe.get(f"{self.prefix}bn:{{{h}}}")
            return pipe.execute()

        if not hashes:
            return {}
        out = {}
        for h, raw in zip(hashes, self._call(get)):
            path = raw.decode(errors="replace") if isinstance(raw, bytes) else None
            if path and len(path) < 4096 and "\0" not in path and not path.startswith("/") \
                    and ".." not in path.split("/"):
                out[h] = path
        return out

    def fetch_blob(self, hex_digest: str, size: int, out: BinaryIO) -> bytes | None:
        """Stream a blob of *size* bytes into *out*; its blake3, or None when Redis lacks (part of) it.

        Chunk by chunk: memory never depends on the claimed size.  The bytes
        must come to exactly *size*: more is bad data (``b""`` is returned,
        which matches no digest), a missing chunk before the end is a miss.
        The caller compares the digest.
        """
        return self._call(self._fetch_blob, hex_digest, size, out)

    def _fetch_blob(self, hex_digest: str, size: int, out: BinaryIO) -> bytes | None:
        hasher = blake3.blake3()
        got = 0
        i = 0
        while True:
            part = self._get(self.client, self._blob_key(hex_digest, i))
            if part is None:
                return None
            if len(part) > size - got or (not part and size):
                return b""
            hasher.update(part)
            out.write(part)
            got += len(part)
            self.level.moved(down=len(part), requests=0)  # as it arrives: the bound on a wait sees progress
            i += 1
            if got == size:
                break
        self.counters["remote_fetched_bytes"] += got
        return hasher.digest()

    def _get(self, client: Any, key: str) -> Any:
        """GET, or GETEX renewing the blob's time to live (a hot blob stays)."""
        return client.get(key) if self.blob_ttl is None else client.getex(key, ex=self.blob_ttl)

    def _chunk_count(self, size: int) -> int:
        return max(1, -(-size // CHUNK))

    def missing_blobs(self, blobs: dict[str, int]) -> list[str]:
        """Which of these blobs (hex → size) Redis lacks in full: every chunk is checked."""
        if not blobs:
            return []

        timed = self.blob_ttl is None  # alone, Redis keeps blobs for good: ``fleet gc`` deletes old ones

        def check() -> list[str]:
            pipe = self.client.pipeline(transaction=False)
            order = []
            for h, size in blobs.items():
                n = self._chunk_count(size)
                order.append((h, n))
                for i in range(n):
                    pipe.exists(self._blob_key(h, i))
                if timed:
                    pipe.zscore(self.blob_times_key, h)
            flags = iter(pipe.execute())
            trusted_since = time.time() - usage.BLOB_TRUST_SECONDS
            out = []
            for h, n in order:
                whole = all([bool(next(flags)) for _ in range(n)])
                written = next(flags) if timed else None
                # a blob written long ago (or before times were kept) may be gc's next: written again
                if not whole or (timed and (written is None or float(written) < trusted_since)):
                    out.append(h)
            return out

        return self._call(check)

    def upload_blobs(self, files: list[tuple[str, str]]) -> set[str]:
        """Upload blobs (hex, file path; "" for empty content); the hashes whose files were gone.

        Small blobs share pipelines of up to ``_PIPELINE_BYTES``; a large one
        is sent a chunk at a time, so memory stays bounded by the chunk size.
        """
        gone = self._call(self._upload_blobs, files)
        self.level.wrote()
        return gone

    def _upload_blobs(self, files: list[tuple[str, str]]) -> set[str]:
        gone: set[str] = set()
        pipe = self.client.pipeline(transaction=False)
        pending = 0
        for h, path in files:
            try:
                f = open(path, "rb") if path else None
            except FileNotFoundError:
                gone.add(h)  # evicted before it could be uploaded: publish nothing for it
                continue
            try:
                i = 0
                while True:
                    part = f.read(CHUNK) if f is not None else b""
                    if not part and i:
                        break
                    if i == 0 and self.blob_ttl is None:
                        # when it was written (gc's grace, ``shared.usage``), before its bytes: a gc deleting
                        # the old copy meanwhile either goes first or sees it young
                        pipe.zadd(self.blob_times_key, {h: time.time()})
                    pipe.set(self._blob_key(h, i), part, ex=self.blob_ttl)
                    pending += len(part)
                    self.counters["remote_uploaded_bytes"] += len(part)
                    self.level.moved(up=len(part), requests=0)
                    i += 1
                    if pending >= _PIPELINE_BYTES:
                        pipe.execute()
                        pending = 0
                    if len(part) < CHUNK:
                        break
            finally:
                if f is not None:
                    f.close()
        pipe.execute()
        return gone

    def put_blobs(self, blobs: list[tuple[str, bytes]]) -> None:
        """Small verified blobs (one chunk each) read from the store behind Redis: into the hot set."""
        def put() -> None:
            pipe = self.client.pipeline(transaction=False)
            for h, data in blobs:
                pipe.set(self._blob_key(h, 0), data, ex=self.blob_ttl)
                self.level.moved(up=len(data), requests=0)
            pipe.execute()

        if blobs:
            self._call(put)

    # -- batches (prefetch) -------------------------------------------------
    def list_dirs(self, dir_paths: list[str]) -> dict[str, dict[bytes, RemoteEntry]]:
        """Every valid entry of many directories, pipelined (a cluster pipeline splits by master)."""
        return {d: entries for d, (entries, _) in self.list_dirs_complete(dir_paths).items()}

    def _hgetall_many(self, dir_paths: list[str]) -> list[dict]:
        pipe = self.client.pipeline(transaction=False)
        for d in dir_paths:
            pipe.hgetall(self._dir_key(d))
        return pipe.execute()

    def _entries(self, dir_path: str, raw: dict) -> dict[bytes, RemoteEntry]:
        raw.pop(COMPLETE, None)
        return self.codec.entries(dir_path, raw)

    def all_dirs(self) -> list[str]:
        """The path of every directory hash in the namespace (SCAN: never blocks the server)."""
        prefix = self._dir_key("")

        def scan() -> list[str]:
            import redis.cluster

            kwargs = {"target_nodes": redis.cluster.RedisCluster.PRIMARIES} if self.cluster else {}
            keys = self.client.scan_iter(match=_glob_escape(prefix) + "*", count=1000, **kwargs)
            return sorted({k[len(prefix):].decode(errors="surrogateescape") for k in keys})

        return self._call(scan)

    def fetch_small_blobs(self, blobs: list[tuple[str, int]]) -> list[bytes | None]:
        """Single-chunk blobs (hex, size), one pipelined GET each; None where missing or not that size."""
        def get() -> list[bytes | None]:
            pipe = self.client.pipeline(transaction=False)
            for h, _ in blobs:
                self._get(pipe, self._blob_key(h, 0))
            return pipe.execute()

        parts = self._call(get)
        out: list[bytes | None] = []
        for (_, size), part in zip(blobs, parts):
            ok = part is not None and len(part) == size
            if part is not None and not ok:  # one chunk, another size than its entry says: bad data
                self.counters["remote_verify_failures"] += 1
            out.append(part if ok else None)
            if ok:
                self.counters["remote_fetched_bytes"] += size
                self.level.moved(down=size, requests=0)
        return out

    # -- startup sets -------------------------------------------------------
    def _set_key(self, name: str) -> str:
        """The set's index (a sorted set of record ids by time); the name in braces is a cluster hash tag,
        so the index and its records live in one slot."""
        return f"{self.prefix}startup:{{{name}}}"

    def write_startup_record(self, name: str, record_id: str, items: list[tuple[str, RemoteEntry]], *,
                             last: bool = False) -> None:
        """This mount's record, written over (one pipeline): the value, and its id in the set's index; the
        last write also drops the records past the ``RECORDS_KEPT`` newest."""
        def write() -> None:
            data = encode_record(self.codec, items)
            index = self._set_key(name)
            pipe = self.client.pipeline(transaction=False)
            pipe.set(f"{index}:{record_id}", data, ex=RECORD_TTL)
            pipe.zadd(index, {record_id: record_time(record_id)})
            pipe.expire(index, RECORD_TTL)
            pipe.execute()
            self.level.moved(up=len(data), requests=0)
            if last:
                old = [m.decode() for m in self.client.zrange(index, 0, -(RECORDS_KEPT + 1))]
                if old:
                    pipe = self.client.pipeline(transaction=False)
                    pipe.delete(*[f"{index}:{r}" for r in old])
                    pipe.zrem(index, *old)
                    pipe.execute()

        self._call(write)

    def startup_records(self, name: str) -> list[Record]:
        """The newest records: their ids (ZREVRANGE), then their values (one pipeline of GETRANGEs, each
        at most ``MAX_RECORD_BYTES`` + 1: a planted giant is never read whole); never a write."""
        def read() -> list[Record]:
            index = self._set_key(name)
            ids = [m.decode(errors="replace") for m in self.client.zrevrange(index, 0, RECORDS_READ - 1)]
            ids = [r for r in ids if valid_record_id(r)]
            if not ids:
                return []
            pipe = self.client.pipeline(transaction=False)
            for r in ids:
                pipe.getrange(f"{index}:{r}", 0, MAX_RECORD_BYTES)
            out = []
            for r, data in zip(ids, pipe.execute()):
                if data:  # gone (its time to live): nothing to read
                    self.level.moved(down=len(data), requests=0)
                    record = decode_record(self.codec, r, data if len(data) <= MAX_RECORD_BYTES else None)
                    if record is not None:
                        out.append(record)
            return out

        return self._call(read)

    # -- fleet gc (``shared.gc``) ----------------------------------------------
    @property
    def blob_times_key(self) -> str:
        """A sorted set: blob hex -> when it was last written (unix seconds)."""
        return f"{self.prefix}bt"

    @property
    def used_key(self) -> str:
        """A sorted set: directory path -> when a node last used it (unix seconds)."""
        return f"{self.prefix}used"

    def record_use(self, records: dict[str, float]) -> None:
        """``ZADD GT``: a record never moves a directory's last use back."""
        def add() -> None:
            pipe = self.client.pipeline(transaction=False)
            items = list(records.items())
            for start in range(0, len(items), _BATCH):
                pipe.zadd(self.used_key, dict(items[start:start + _BATCH]), gt=True)
            pipe.execute()

        if records:
            self._call(add)

    def tier_summary(self) -> dict[str, Any] | None:
        from mithrilfs.shared.gc_summary import parse_summary

        return parse_summary(self._call(lambda: self.client.get(f"{self.prefix}gc")))

    def redis_memory(self) -> int:
        """Bytes of memory the server (all masters) uses, for benchmarks."""
        info = self._call(lambda: self.client.info("memory"))
        if self.cluster:
            return sum(v["used_memory"] for v in info.values())
        return info["used_memory"]

    def close(self) -> None:
        if self._client is not None:
            self._client.close()


def _glob_escape(text: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)
