"""``fleet gc`` on Redis alone: names in directory hashes, use records and blob times in sorted sets.

Every delete is a Lua script that checks what gc listed is still there: a
name goes only if it holds the value gc listed (a name published meanwhile
stays); a blob goes only if its time (``bt``, written by the uploader
before the blob's bytes) is still older than the grace, so a writer that
uploads it again meanwhile keeps it.  In a Redis Cluster a blob's time and
its chunks live in different slots: the time is checked just before the
chunks are deleted (not atomically; the grace covers a writer that trusted
the blob, not one that re-uploads it in that instant).
"""

from __future__ import annotations

from typing import Any

from mithrilfs.shared.stores import ages
from mithrilfs.shared.stores.collector import Collector, Container
from mithrilfs.shared.stores.entries import is_hex_digest
from mithrilfs.shared.stores.redis.conn import BATCH
from mithrilfs.shared.stores.redis.store import COMPLETE, RedisStore, glob_escape

# KEYS[1] a directory hash; ARGV: name, value, name, value...: each name deleted if it holds that value
_REMOVE_IF = """
local n = 0
for i = 1, #ARGV, 2 do
  if redis.call('HGET', KEYS[1], ARGV[i]) == ARGV[i + 1] then
    redis.call('HDEL', KEYS[1], ARGV[i]); n = n + 1
  end
end
return n
"""

# KEYS[1] blob times, KEYS[2] the blob's name note; ARGV: hex, cutoff, chunk key prefix.  The bytes freed,
# or -1 when the blob was written again since (or has no time: kept until a run gives it one).
_DELETE_BLOB = """
local t = redis.call('ZSCORE', KEYS[1], ARGV[1])
if not t or tonumber(t) >= tonumber(ARGV[2]) then return -1 end
local freed = 0
local i = 0
while true do
  local k = ARGV[3] .. i
  if redis.call('EXISTS', k) == 0 then break end
  freed = freed + redis.call('STRLEN', k)
  redis.call('DEL', k)
  i = i + 1
end
redis.call('DEL', KEYS[2])
redis.call('ZREM', KEYS[1], ARGV[1])
return freed
"""


class RedisCollector(Collector):
    store: RedisStore

    def __init__(self, store: RedisStore) -> None:
        super().__init__(store, store.codec)
        self.r = store
        self._remove_if: Any = None
        self._delete_blob: Any = None
        #: Directories whose recorded use is no time (``ages.use_time``): ``adopt`` writes over it.
        self._refused: set[str] = set()

    def _script(self, name: str, text: str) -> Any:
        if getattr(self, name) is None:
            setattr(self, name, self.r.client.register_script(text))
        return getattr(self, name)

    def _scan(self, pattern: str) -> list[bytes]:
        import redis.cluster  # redis-py is imported where it is used (``redis.conn``)

        kwargs = {"target_nodes": redis.cluster.RedisCluster.PRIMARIES} if self.r.cluster else {}
        return list(self.r.client.scan_iter(match=pattern, count=1000, **kwargs))

    # -- names ---------------------------------------------------------------
    def list_names(self) -> dict[str, dict[bytes, bytes]]:
        prefix = self.r.dir_key("")

        def get() -> dict[str, dict[bytes, bytes]]:
            keys = self._scan(glob_escape(prefix) + "*")
            out = {}
            for start in range(0, len(keys), BATCH):
                batch = keys[start:start + BATCH]
                pipe = self.r.client.pipeline(transaction=False)
                for k in batch:
                    pipe.hgetall(k)
                for k, raw in zip(batch, pipe.execute()):
                    raw.pop(COMPLETE, None)
                    if raw:
                        out[k[len(prefix):].decode(errors="surrogateescape")] = raw
            return out

        return self.r.call(get)

    def names_of(self, dir_path: str) -> dict[bytes, bytes]:
        raw = self.r.call(lambda: self.r.client.hgetall(self.r.dir_key(dir_path)))
        raw.pop(COMPLETE, None)
        return raw

    def is_empty(self, dir_path: str) -> bool:
        return not self.names_of(dir_path)

    def remove_names(self, dir_path: str, raw: dict[bytes, bytes]) -> int:
        args = [x for pair in raw.items() for x in pair]
        n = 0
        for start in range(0, len(args), 2 * BATCH):
            n += self.r.call(lambda a=args[start:start + 2 * BATCH]: self._script("_remove_if", _REMOVE_IF)(
                keys=[self.r.dir_key(dir_path)], args=a))
        return n

    def put_back(self, dir_path: str, name: bytes, raw: bytes) -> None:
        self.r.call(lambda: self.r.client.hsetnx(self.r.dir_key(dir_path), name, raw))

    # -- use records ------------------------------------------------------------
    def use_times(self) -> dict[str, float]:
        """The recorded uses; a score that is no time (``inf``: nodes' ``ZADD GT`` could never lower it) is
        refused, counted, and written over by ``adopt``."""
        def get() -> dict[str, float]:
            out, refused = {}, set()
            for k, v in self.r.client.zscan_iter(self.r.used_key, count=1000):
                d, t = k.decode(errors="surrogateescape"), ages.use_time(v)
                if t is None:
                    refused.add(d)
                else:
                    out[d] = t
            self._refused = refused
            self.r.counters["remote_rejected"] += len(refused)
            return out

        return self.r.call(get)

    def adopt(self, dirs: list[str], when: float, *, replace: bool = False) -> None:
        def add() -> None:
            pipe = self.r.client.pipeline(transaction=False)
            for start in range(0, len(dirs), BATCH):
                batch = dirs[start:start + BATCH]
                if replace:  # records dated past *when*: lowered to it (LT)
                    pipe.zadd(self.r.used_key, dict.fromkeys(batch, when), lt=True)
                    continue
                pipe.zadd(self.r.used_key, dict.fromkeys(batch, when), nx=True)
                over = [d for d in batch if d in self._refused]
                if over:
                    pipe.zadd(self.r.used_key, dict.fromkeys(over, when), xx=True)
            pipe.execute()

        if dirs:
            self.r.call(add)

    def forget_use(self, dirs: list[str]) -> None:
        def rem() -> None:
            pipe = self.r.client.pipeline(transaction=False)
            for start in range(0, len(dirs), BATCH):
                pipe.zrem(self.r.used_key, *dirs[start:start + BATCH])
            pipe.execute()

        if dirs:
            self.r.call(rem)

    # -- blobs -------------------------------------------------------------------
    def containers(self, *, adopt: bool = True) -> list[Container]:
        """Every blob (chunk 0 found by SCAN) with its time; blobs with none (uploaded by an older
        mithrilfs, or their time evicted) are given "now"."""
        prefix = f"{self.r.prefix}b:"

        def get() -> list[Container]:
            times = {k.decode(): float(v) for k, v in self.r.client.zscan_iter(self.r.blob_times_key, count=1000)}
            hexes = []
            for k in self._scan(glob_escape(prefix) + "{*}:0"):
                h = k[len(prefix):].decode(errors="replace")[1:-3]
                if is_hex_digest(h):
                    hexes.append(h)
            now = self.r.clock.now()
            untimed = [h for h in hexes if h not in times] if adopt else []
            sizes: list[int] = []
            pipe = self.r.client.pipeline(transaction=False)
            for start in range(0, len(untimed), BATCH):
                pipe.zadd(self.r.blob_times_key, dict.fromkeys(untimed[start:start + BATCH], now), nx=True)
            for h in hexes:
                pipe.strlen(self.r.blob_key(h, 0))
            sizes = pipe.execute()[-len(hexes):] if hexes else []
            return [Container(h, (h,), int(size), times.get(h, now)) for h, size in zip(hexes, sizes)]

        return self.r.call(get)

    def delete_container(self, c: Container, older_than: float) -> int | None:
        h = c.id
        bt, note = self.r.blob_times_key, f"{self.r.prefix}bn:{{{h}}}"
        if not self.r.cluster:
            freed = self.r.call(lambda: self._script("_delete_blob", _DELETE_BLOB)(
                keys=[bt, note], args=[h, older_than, self.r.blob_key(h, 0)[:-1]]))
            return None if freed < 0 else int(freed)

        def delete() -> int | None:  # a cluster: the time and the chunks are in different slots
            t = self.r.client.zscore(bt, h)
            if t is None or float(t) >= older_than:
                return None
            freed, i = 0, 0
            while True:
                k = self.r.blob_key(h, i)
                n = self.r.client.strlen(k)
                if not self.r.client.delete(k):
                    break
                freed += n
                i += 1
            self.r.client.delete(note)
            self.r.client.zrem(bt, h)
            return freed

        return self.r.call(delete)

    def write_summary(self, data: bytes) -> None:
        self.r.call(lambda: self.r.client.set(f"{self.r.prefix}gc", data))
