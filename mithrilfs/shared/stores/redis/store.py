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
                        (``startup:{NAME}:ID``) one mount's first reads (``stores.records``)
  ``purges``            the records of ``forget --fleet`` kept for startup sets, by version
  ``epoch[:{tag}]``     a random token per server (per master in a cluster):
                        when it changes or vanishes, the server lost its data

A conditional write (a Lua script) keeps the newest (version, node) per
name (``entries``).  Blobs are streamed chunk by chunk, never allocated by a
claimed size, and must come to exactly the entry's size and hash.  One of
the ``stores.base.RemoteStore`` implementations; error messages and logs never
carry the password (``redact``).
"""

from __future__ import annotations

from typing import Any, BinaryIO

from mithrilfs.shared.stores.base import RemoteStore
from mithrilfs.shared.stores.clock import FUTURE_SLACK_US
from mithrilfs.shared.stores.entries import (  # noqa: F401  (the entry model, re-exported for its older users)
    MAX_ENTRY_BYTES,
    BlobBytes,
    EntryCodec,
    RemoteEntry,
    RemoteError,
    parse_entry,
)
from mithrilfs.shared.stores.redis.blobs import CHUNK, RedisBlobs
from mithrilfs.shared.stores.redis.conn import BATCH, RedisConnection
from mithrilfs.shared.stores.redis.records import RedisShelf
from mithrilfs.shared.stores.summary import parse_summary

#: The field that marks a directory hash complete (no entry name holds a NUL byte); its value is when.
COMPLETE = b"\0complete"
#: A mark is trusted this long (seconds): a write Redis missed, a mark set by a reader that raced a
#: writer, an old snapshot Redis restarted from are all forgotten after it.
COMPLETE_SECONDS = 600.0


def _fresh_mark(value: bytes | None, now: float) -> bool:
    try:
        return value is not None and 0 <= now - float(value) < COMPLETE_SECONDS
    except ValueError:
        return False

# KEYS[1] directory hash; ARGV: name, value, version, node, force, slack.  Keeps the newest
# (version, node); returns {1, previous entry or nothing} when ours was written,
# {0, the newer entry} when it was not.  An entry dated more than *slack* microseconds
# past the server's TIME (a writer's clock ahead) is no newer than anything.
_SET_IF_NEWER = """
local cur = redis.call('HGET', KEYS[1], ARGV[1])
if cur and ARGV[5] ~= '1' then
  local ok, d = pcall(cjson.decode, cur)
  if ok and type(d) == 'table' and type(d.v) == 'number' and type(d.n) == 'string' then
    local v = tonumber(ARGV[3])
    local t = redis.call('TIME')
    local horizon = tonumber(t[1]) * 1000000 + tonumber(t[2]) + tonumber(ARGV[6])
    if d.v <= horizon and (d.v > v or (d.v == v and d.n > ARGV[4])) then return {0, cur} end
  end
end
redis.call('HSET', KEYS[1], ARGV[1], ARGV[2])
if cur then return {1, cur} end
return {1}
"""

class RedisStore(RedisConnection, RemoteStore):
    """One namespace in one Redis server or cluster; every method may raise RemoteError.

    The connection (client, errors, epoch) is its base (``stores.redis.conn``);
    blobs and records are parts of their own (``stores.redis.blobs``, its
    shelf ``stores.redis.records``); the entries -- directory hashes and their
    conditional write -- are here.
    """

    small_blob_bytes = CHUNK

    def __init__(self, url: str, namespace: str, key: bytes | None = None, *, password: str | None = None,
                 cluster: bool = False, counters: dict[str, int] | None = None,
                 blob_ttl: int | None = None) -> None:
        super().__init__(url, namespace, key, password=password, cluster=cluster, counters=counters)
        self._script_sha: str | None = None
        self.blobs = RedisBlobs(self, blob_ttl)
        self.shelf = RedisShelf(self)

    @property
    def blob_ttl(self) -> int | None:
        return self.blobs.blob_ttl

    # -- entries -----------------------------------------------------------
    def dir_key(self, dir_path: str) -> str:
        return f"{self.prefix}d:{dir_path}"

    def encode(self, path: str, entry: RemoteEntry) -> bytes:
        return self.codec.encode(path, entry)

    def decode(self, path: str, raw: bytes) -> RemoteEntry | None:
        return self.codec.decode(path, raw)

    def list_dirs_complete(self, dir_paths: list[str]) -> dict[str, tuple[dict[bytes, RemoteEntry], bool]]:
        """Directories' entries, and whether each was marked complete (``mark_complete``), pipelined."""
        out = {}
        for start in range(0, len(dir_paths), BATCH):
            batch = dir_paths[start:start + BATCH]
            for d, raw in zip(batch, self.call(self._hgetall_many, batch)):
                complete = _fresh_mark(raw.pop(COMPLETE, None), self.clock.now())
                out[d] = (self._entries(d, raw), complete)
        return out

    def list_dir_complete(self, dir_path: str) -> tuple[dict[bytes, RemoteEntry], bool]:
        return self.list_dirs_complete([dir_path])[dir_path]

    def unmark_complete(self, dir_paths: list[str]) -> None:
        """These directories may lack names the store behind Redis has (Redis missed their writes)."""
        def unmark() -> None:
            pipe = self.client.pipeline(transaction=False)
            for d in dir_paths:
                pipe.hdel(self.dir_key(d), COMPLETE)
            pipe.execute()

        if dir_paths:
            self.call(unmark)

    def mark_complete(self, dir_paths: list[str]) -> None:
        """These directories hold every name of the store behind Redis (``stores.layered.store``): read them alone."""
        def mark() -> None:
            pipe = self.client.pipeline(transaction=False)
            now = str(self.clock.now()).encode()
            for d in dir_paths:
                pipe.hset(self.dir_key(d), COMPLETE, now)
            pipe.execute()

        if dir_paths:
            self.call(mark)

    def publish_entries(self, items: list[tuple[str, RemoteEntry]]) -> list[tuple[bool, RemoteEntry | None]]:
        """Write entries where they are newer than what Redis holds.

        For each: (written, the other entry) -- the one replaced when ours
        was written, the newer one that stayed when not.  A newer entry that
        is not valid for us (forged, unsigned, broken) does not get to stay:
        ours is written over it.
        """
        if not items:
            return []
        out = self.call(self._publish_entries, items)
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
            calls.append((self.dir_key(dir_path), name.encode(errors="surrogateescape"), self.encode(path, entry),
                          entry.version, entry.node, "1" if force else "0", FUTURE_SLACK_US))
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

    # -- blobs (``stores.redis.blobs``) ----------------------------------------
    def note_blob_names(self, names: dict[str, str]) -> None:
        self.blobs.note_blob_names(names)

    def blob_names(self, hashes: list[str]) -> dict[str, str]:
        return self.blobs.blob_names(hashes)

    def fetch_blob(self, hex_digest: str, size: int, out: BinaryIO) -> bytes | None:
        return self.blobs.fetch_blob(hex_digest, size, out)

    def missing_blobs(self, blobs: dict[str, int]) -> list[str]:
        return self.blobs.missing_blobs(blobs)

    def upload_blobs(self, files: list[tuple[str, str]]) -> set[str]:
        return self.blobs.upload_blobs(files)

    def put_blobs(self, blobs: list[tuple[str, BlobBytes]]) -> None:
        self.blobs.put_blobs(blobs)

    def fetch_small_blobs(self, blobs: list[tuple[str, int]]) -> list[BlobBytes | None]:
        return self.blobs.fetch_small_blobs(blobs)

    # -- batches (prefetch) -------------------------------------------------
    def list_dirs(self, dir_paths: list[str]) -> dict[str, dict[bytes, RemoteEntry]]:
        """Every valid entry of many directories, pipelined (a cluster pipeline splits by master)."""
        return {d: entries for d, (entries, _) in self.list_dirs_complete(dir_paths).items()}

    def _hgetall_many(self, dir_paths: list[str]) -> list[dict]:
        pipe = self.client.pipeline(transaction=False)
        for d in dir_paths:
            pipe.hgetall(self.dir_key(d))
        return pipe.execute()

    def _entries(self, dir_path: str, raw: dict) -> dict[bytes, RemoteEntry]:
        raw.pop(COMPLETE, None)
        return self.codec.entries(dir_path, raw)

    def all_dirs(self) -> list[str]:
        """The path of every directory hash in the namespace (SCAN: never blocks the server)."""
        prefix = self.dir_key("")

        def scan() -> list[str]:
            import redis.cluster

            kwargs = {"target_nodes": redis.cluster.RedisCluster.PRIMARIES} if self.cluster else {}
            keys = self.client.scan_iter(match=glob_escape(prefix) + "*", count=1000, **kwargs)
            return sorted({k[len(prefix):].decode(errors="surrogateescape") for k in keys})

        return self.call(scan)
    # -- use records (``fleet.usage``) -------------------------------------------------
    def record_use(self, records: dict[str, float]) -> None:
        """``ZADD GT`` into a sorted set of directories by last use: a record never moves one back."""
        def add() -> None:
            pipe = self.client.pipeline(transaction=False)
            items = list(records.items())
            for start in range(0, len(items), BATCH):
                pipe.zadd(self.used_key, dict(items[start:start + BATCH]), gt=True)
            pipe.execute()

        if records:
            self.call(add)

    def tier_summary(self) -> dict[str, Any] | None:

        return parse_summary(self.call(lambda: self.client.get(f"{self.prefix}gc")))


def glob_escape(text: str) -> str:
    return "".join("\\" + c if c in "*?[]\\" else c for c in text)
