"""The shared tier's wire layer: names and blobs in a real Redis server or Redis Cluster.

Layout under ``mfs:{namespace}:``
  ``d:{dir path}``      a HASH per directory: field = entry name, value = JSON
                        {"t": "f"|"d"|"l"|"x", "v": version, "n": node,
                         "h": blake3 hex, "s": size, "m": mode, "mt": mtime_ns,
                         "tg": symlink target, "mac": HMAC}; "x" is a tombstone
  ``b:{<hex>}:{i}``     blob content in chunks (at most CHUNK bytes each); the
                        hex in braces is a Redis Cluster hash tag, so all
                        chunks of a blob live in one slot
  ``epoch[:{tag}]``     a random token per server (per master in a cluster):
                        when it changes or vanishes, the server lost its data

An entry's version is the microsecond its name got its content on the node
that wrote it (``n``); a conditional write (a Lua script) keeps the newest
(version, node) per name, so every node converges on one version per path.
Everything read from Redis is hostile until proven otherwise: entries are
validated field by field (``parse_entry``) and a bad one is ignored and
counted; blobs are streamed chunk by chunk, never allocated by a claimed
size, and must come to exactly the entry's size and hash.  With a key,
entries carry an HMAC over namespace, path and every field including the
version.

Every call here is blocking network I/O with short timeouts; the filesystem
runs them in worker threads.  After a failure the tier counts the error and
stays away for a growing back-off (0.5 s up to 30 s), so a dead Redis costs
one timeout, not one per request.  Error messages and logs never carry the
password (``redact``).
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import os
import re
import secrets
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, BinaryIO
from urllib.parse import urlparse, urlunparse

import blake3

from mithrilfs.store.namespace import join_path, valid_name

# redis-py is imported where it is used: a mount without --remote (and every CLI command)
# starts without it, 0.15 s sooner

log = logging.getLogger(__name__)

#: Largest chunk of a blob in one Redis value (far below Redis's 512 MB limit).
CHUNK = int(os.environ.get("MITHRILFS_REMOTE_CHUNK_BYTES", 32 << 20))
CONNECT_TIMEOUT = 0.5
OP_TIMEOUT = 2.0
_MAX_BACKOFF = 30.0
#: Entries larger than this are not entries (a name, a hash and a few numbers fit in far less).
MAX_ENTRY_BYTES = 8192
#: Versions are microseconds: exact in the doubles Lua compares them as.
MAX_VERSION = 1 << 53
MAX_SIZE = 1 << 53
MAX_TARGET = 4095
_NODE_RE = re.compile(r"[A-Za-z0-9._-]{1,64}")
#: Bytes of small blobs sent in one pipeline.
_PIPELINE_BYTES = 16 << 20
#: Keys per pipelined batch of reads.
_BATCH = 512
#: A startup set larger than this is read only this far.
MAX_SET_PATHS = 1_000_000
_KEYS = {"t", "v", "n", "h", "s", "m", "mt", "tg", "mac"}

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


class RemoteError(Exception):
    """The remote tier could not be reached or answered nonsense (the message names the cause)."""


@dataclass(frozen=True)
class RemoteEntry:
    type: str  # "f" file, "d" directory, "l" symlink, "x" tombstone
    version: int
    node: str
    hash: str | None = None
    size: int = 0
    mode: int = 0o644
    mtime_ns: int = 0
    target: str | None = None

    @property
    def is_tombstone(self) -> bool:
        return self.type == "x"

    def newer_than(self, version: int, node: str) -> bool:
        return (self.version, self.node) > (version, node)

    def fields(self) -> dict[str, Any]:
        d: dict[str, Any] = {"t": self.type, "v": self.version, "n": self.node}
        if self.type != "x":
            d.update(m=self.mode, mt=self.mtime_ns)
        if self.type == "f":
            d.update(h=self.hash, s=self.size)
        if self.type == "l":
            d["tg"] = self.target
        return d


def _int(d: dict, key: str, lo: int, hi: int) -> int:
    v = d.get(key)
    if type(v) is not int or not lo <= v < hi:  # bool is not an int here
        raise ValueError(f"field {key!r} out of range")
    return v


def parse_entry(raw: bytes) -> tuple[RemoteEntry, str | None]:
    """(entry, its mac) from a Redis value; ValueError naming what is wrong with it."""
    if len(raw) > MAX_ENTRY_BYTES:
        raise ValueError("entry too large")
    try:
        d = json.loads(raw)
    except (ValueError, RecursionError):
        raise ValueError("not JSON") from None
    if not isinstance(d, dict) or not set(d) <= _KEYS:
        raise ValueError("not an entry object")
    t = d.get("t")
    if t not in ("f", "d", "l", "x"):
        raise ValueError("unknown type")
    node = d.get("n")
    if not isinstance(node, str) or not _NODE_RE.fullmatch(node):
        raise ValueError("bad node")
    version = _int(d, "v", 1, MAX_VERSION)
    mac = d.get("mac")
    if mac is not None and not isinstance(mac, str):
        raise ValueError("bad mac")
    if t == "x":
        return RemoteEntry("x", version, node), mac
    mode = _int(d, "m", 0, 0o10000)
    mtime = _int(d, "mt", 0, 1 << 63)
    if t == "f":
        h = d.get("h")
        if not is_hex_digest(h):
            raise ValueError("bad hash")
        return RemoteEntry("f", version, node, h, _int(d, "s", 0, MAX_SIZE), mode, mtime), mac
    if t == "l":
        tg = d.get("tg")
        if not isinstance(tg, str) or not 0 < len(tg.encode(errors="surrogateescape")) <= MAX_TARGET or "\0" in tg:
            raise ValueError("bad symlink target")
        return RemoteEntry("l", version, node, mode=mode, mtime_ns=mtime, target=tg), mac
    return RemoteEntry("d", version, node, mode=mode, mtime_ns=mtime), mac


def is_hex_digest(value: Any) -> bool:
    return isinstance(value, str) and len(value) == 64 and all(c in "0123456789abcdef" for c in value)


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


class RemoteTier:
    """One namespace in one Redis server or cluster; every method may raise RemoteError."""

    def __init__(self, url: str, namespace: str, key: bytes | None = None, *, password: str | None = None,
                 cluster: bool = False) -> None:
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
        self._script_sha: str | None = None
        self._lock = threading.Lock()
        self._backoff = 0.0
        self._down_until = 0.0
        #: The last error, in one line (for ``stats`` and ``push``).
        self.last_error = ""
        self.counters = dict.fromkeys(
            ("remote_hits", "remote_misses", "remote_fetched_bytes", "remote_uploaded_bytes",
             "remote_uploaded_entries", "remote_tombstones", "remote_verify_failures", "remote_rejected",
             "remote_errors", "remote_conflicts", "remote_adopted", "remote_data_lost"), 0)

    @property
    def client(self) -> Any:
        """The redis-py client, made at first use: a cluster client connects as it is made, and a
        tier that is down at mount time must cost a counted error, not the mount."""
        if self._client is None:
            import redis.cluster

            if self.cluster:
                self._client = redis.cluster.RedisCluster.from_url(
                    self._url, cluster_error_retry_attempts=1, require_full_coverage=True, **self._kwargs)
            else:
                self._client = redis.Redis.from_url(self._url, health_check_interval=0, **self._kwargs)
        return self._client

    # -- availability ----------------------------------------------------
    def available(self) -> bool:
        return time.monotonic() >= self._down_until

    def _scrub(self, text: str) -> str:
        return text.replace(self._password, "***") if self._password else text

    def _call(self, fn: Callable[..., Any], *args: Any) -> Any:
        if not self.available():
            raise RemoteError(f"{self.url} unavailable ({self.last_error}); backing off")
        import redis

        try:
            result = fn(*args)
        except (redis.RedisError, redis.exceptions.RedisClusterException, OSError) as e:
            why = self._scrub(str(e).strip() or type(e).__name__)
            with self._lock:
                self.counters["remote_errors"] += 1
                self._backoff = min(_MAX_BACKOFF, max(0.5, self._backoff * 2))
                self._down_until = time.monotonic() + self._backoff
                self.last_error = why
            log.warning("remote tier %s: %s (retrying in %.1f s)", self.url, why, self._backoff)
            raise RemoteError(why) from None
        with self._lock:
            self._backoff = 0.0
            self.last_error = ""
        return result

    def ping(self) -> None:
        """Raise RemoteError naming the cause unless the server answers now (ignores the back-off)."""
        self._down_until = 0.0
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

    def _mac(self, path: str, fields: dict[str, Any]) -> str:
        assert self.key is not None
        msg = json.dumps([self.namespace, path, fields], sort_keys=True).encode()
        return hmac.new(self.key, msg, hashlib.sha256).hexdigest()

    def encode(self, path: str, entry: RemoteEntry) -> bytes:
        fields = entry.fields()
        if self.key is not None:
            fields["mac"] = self._mac(path, entry.fields())
        return json.dumps(fields, sort_keys=True).encode()

    def decode(self, path: str, raw: bytes) -> RemoteEntry | None:
        """The entry, or None (counted) when it is malformed, out of range, or not signed with our key."""
        try:
            entry, mac = parse_entry(raw)
        except ValueError as e:
            self.counters["remote_rejected"] += 1
            log.warning("remote entry %r ignored: %s", path, e)
            return None
        if self.key is not None and (mac is None or not hmac.compare_digest(mac, self._mac(path, entry.fields()))):
            self.counters["remote_rejected"] += 1
            log.warning("remote entry %r has no valid signature: ignored", path)
            return None
        return entry

    def list_dir(self, dir_path: str) -> dict[bytes, RemoteEntry]:
        """Every valid entry of a directory (tombstones included), by name."""
        return self._entries(dir_path, self._call(lambda: self.client.hgetall(self._dir_key(dir_path))))

    def publish_entries(self, items: list[tuple[str, RemoteEntry]]) -> list[tuple[bool, RemoteEntry | None]]:
        """Write entries where they are newer than what Redis holds.

        For each: (written, the other entry) -- the one replaced when ours
        was written, the newer one that stayed when not.  A newer entry that
        is not valid for us (forged, unsigned, broken) does not get to stay:
        ours is written over it.
        """
        if not items:
            return []
        return self._call(self._publish_entries, items)

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
            part = self.client.get(self._blob_key(hex_digest, i))
            if part is None:
                return None
            if len(part) > size - got or (not part and size):
                return b""
            hasher.update(part)
            out.write(part)
            got += len(part)
            i += 1
            if got == size:
                break
        self.counters["remote_fetched_bytes"] += got
        return hasher.digest()

    def _chunk_count(self, size: int) -> int:
        return max(1, -(-size // CHUNK))

    def missing_blobs(self, blobs: dict[str, int]) -> list[str]:
        """Which of these blobs (hex → size) Redis lacks in full: every chunk is checked."""
        if not blobs:
            return []

        def check() -> list[str]:
            pipe = self.client.pipeline(transaction=False)
            order = []
            for h, size in blobs.items():
                n = self._chunk_count(size)
                order.append((h, n))
                for i in range(n):
                    pipe.exists(self._blob_key(h, i))
            flags = iter(pipe.execute())
            return [h for h, n in order if not all([bool(next(flags)) for _ in range(n)])]

        return self._call(check)

    def upload_blobs(self, files: list[tuple[str, str]]) -> set[str]:
        """Upload blobs (hex, file path; "" for empty content); the hashes whose files were gone.

        Small blobs share pipelines of up to ``_PIPELINE_BYTES``; a large one
        is sent a chunk at a time, so memory stays bounded by the chunk size.
        """
        return self._call(self._upload_blobs, files)

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
                    pipe.set(self._blob_key(h, i), part)
                    pending += len(part)
                    self.counters["remote_uploaded_bytes"] += len(part)
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

    # -- batches (prefetch) -------------------------------------------------
    def list_dirs(self, dir_paths: list[str]) -> dict[str, dict[bytes, RemoteEntry]]:
        """Every valid entry of many directories, pipelined (a cluster pipeline splits by master)."""
        out: dict[str, dict[bytes, RemoteEntry]] = {}
        for start in range(0, len(dir_paths), _BATCH):
            batch = dir_paths[start:start + _BATCH]
            for d, raw in zip(batch, self._call(self._hgetall_many, batch)):
                out[d] = self._entries(d, raw)
        return out

    def _hgetall_many(self, dir_paths: list[str]) -> list[dict]:
        pipe = self.client.pipeline(transaction=False)
        for d in dir_paths:
            pipe.hgetall(self._dir_key(d))
        return pipe.execute()

    def _entries(self, dir_path: str, raw: dict) -> dict[bytes, RemoteEntry]:
        out = {}
        for name, value in raw.items():
            if not valid_name(name):
                self.counters["remote_rejected"] += 1
                continue
            entry = self.decode(join_path(dir_path, name), value)
            if entry is not None:
                out[name] = entry
        return out

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
                pipe.get(self._blob_key(h, 0))
            return pipe.execute()

        parts = self._call(get)
        out: list[bytes | None] = []
        for (_, size), part in zip(blobs, parts):
            ok = part is not None and len(part) == size
            out.append(part if ok else None)
            if ok:
                self.counters["remote_fetched_bytes"] += size
        return out

    def add_to_set(self, name: str, paths: list[str]) -> None:
        """Add paths to a startup set (a Redis SET: sets from several nodes merge by union)."""
        def add() -> None:
            pipe = self.client.pipeline(transaction=False)
            for start in range(0, len(paths), _BATCH):
                pipe.sadd(f"{self.prefix}set:{name}", *paths[start:start + _BATCH])
            pipe.execute()

        if paths:
            self._call(add)

    def startup_set(self, name: str) -> list[str]:
        """The paths of a startup set (SSCAN: never blocks the server), at most MAX_SET_PATHS."""
        def scan() -> list[str]:
            out = []
            for p in self.client.sscan_iter(f"{self.prefix}set:{name}", count=1000):
                out.append(p.decode(errors="surrogateescape"))
                if len(out) >= MAX_SET_PATHS:
                    break
            return out

        return self._call(scan)

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
