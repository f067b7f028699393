"""The shared tier: a namespace of names and blobs in a real Redis server, shared by many nodes.

Layout under ``mfs:{namespace}:``
  ``d:{dir path}``   a HASH per directory: field = entry name, value = JSON
                     {"t": "f"|"d"|"l", "h": blake3 hex, "s": size, "m": mode,
                      "mt": mtime_ns, "tg": symlink target, "mac": HMAC}
  ``b:{hex}:{i}``    blob content in chunks of CHUNK bytes (Redis values stay
                     far below its 512 MB limit)

Every call here is blocking network I/O with short timeouts; the filesystem
runs them in worker threads.  After a failure the tier counts the error and
stays away for a growing back-off (0.5 s up to 30 s), so a dead Redis costs
one timeout, not one per request.  Blobs are never trusted: the caller
verifies their blake3.  With a key, entries carry an HMAC over path and
fields; entries without a valid one are ignored and counted.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any
from urllib.parse import urlparse

import redis

log = logging.getLogger(__name__)

CHUNK = 32 << 20
CONNECT_TIMEOUT = 0.5
OP_TIMEOUT = 2.0
_MAX_BACKOFF = 30.0


class RemoteError(Exception):
    """The remote tier could not be reached or answered nonsense."""


@dataclass
class RemoteEntry:
    type: str  # "f", "d", "l"
    hash: str | None = None
    size: int = 0
    mode: int = 0o644
    mtime_ns: int = 0
    target: str | None = None

    def fields(self) -> dict[str, Any]:
        d: dict[str, Any] = {"t": self.type, "m": self.mode, "mt": self.mtime_ns}
        if self.type == "f":
            d.update(h=self.hash, s=self.size)
        if self.type == "l":
            d["tg"] = self.target
        return d


def check_url(url: str) -> None:
    """ValueError with a one-line reason unless *url* is a redis:// or rediss:// URL."""
    parsed = urlparse(url)
    if parsed.scheme not in ("redis", "rediss") or not parsed.hostname:
        raise ValueError(f"invalid remote {url!r} (use redis://[:password@]host:port/db or rediss://...)")
    if parsed.path not in ("", "/") and not parsed.path.lstrip("/").isdigit():
        raise ValueError(f"invalid remote {url!r}: the database must be a number")


class RemoteTier:
    def __init__(self, url: str, namespace: str, key: bytes | None = None) -> None:
        check_url(url)
        self.url = url
        self.prefix = f"mfs:{namespace}:"
        self.key = key
        self.client = redis.Redis.from_url(
            url, socket_connect_timeout=CONNECT_TIMEOUT, socket_timeout=OP_TIMEOUT, health_check_interval=0
        )
        self._lock = threading.Lock()
        self._backoff = 0.0
        self._down_until = 0.0
        self.counters = dict.fromkeys(
            ("remote_hits", "remote_misses", "remote_fetched_bytes", "remote_uploaded_bytes",
             "remote_uploaded_entries", "remote_verify_failures", "remote_rejected", "remote_errors"), 0)

    # -- availability ----------------------------------------------------
    def available(self) -> bool:
        return time.monotonic() >= self._down_until

    def _call(self, fn, *args: Any) -> Any:
        if not self.available():
            raise RemoteError("remote tier backing off after errors")
        try:
            result = fn(*args)
        except (redis.RedisError, OSError) as e:
            with self._lock:
                self.counters["remote_errors"] += 1
                self._backoff = min(_MAX_BACKOFF, max(0.5, self._backoff * 2))
                self._down_until = time.monotonic() + self._backoff
            log.warning("remote tier %s: %s (retrying in %.1f s)", self.url, e, self._backoff)
            raise RemoteError(str(e)) from None
        with self._lock:
            self._backoff = 0.0
        return result

    # -- entries -----------------------------------------------------------
    def _dir_key(self, dir_path: str) -> str:
        return f"{self.prefix}d:{dir_path}"

    def _mac(self, path: str, fields: dict[str, Any]) -> str:
        assert self.key is not None
        msg = json.dumps([path, fields], sort_keys=True).encode()
        return hmac.new(self.key, msg, hashlib.sha256).hexdigest()

    def _encode(self, path: str, entry: RemoteEntry) -> bytes:
        fields = entry.fields()
        if self.key is not None:
            fields["mac"] = self._mac(path, entry.fields())
        return json.dumps(fields, sort_keys=True).encode()

    def _decode(self, path: str, raw: bytes) -> RemoteEntry | None:
        try:
            d = json.loads(raw)
            entry = RemoteEntry(d["t"], d.get("h"), int(d.get("s", 0)), int(d.get("m", 0o644)),
                                int(d.get("mt", 0)), d.get("tg"))
            if entry.type not in ("f", "d", "l") or (entry.type == "f" and not _is_hex_digest(entry.hash)):
                raise ValueError(entry.type)
        except (ValueError, KeyError, TypeError):
            self.counters["remote_rejected"] += 1
            return None
        if self.key is not None:
            mac = d.get("mac")
            if not isinstance(mac, str) or not hmac.compare_digest(mac, self._mac(path, entry.fields())):
                self.counters["remote_rejected"] += 1
                log.warning("remote entry %s has no valid HMAC: ignored", path)
                return None
        return entry

    def get_entry(self, dir_path: str, name: str) -> RemoteEntry | None:
        raw = self._call(self.client.hget, self._dir_key(dir_path), name)
        entry = self._decode(_join(dir_path, name), raw) if raw is not None else None
        self.counters["remote_hits" if entry else "remote_misses"] += 1
        return entry

    def list_dir(self, dir_path: str) -> dict[str, RemoteEntry]:
        raw = self._call(self.client.hgetall, self._dir_key(dir_path))
        out = {}
        for name_b, value in raw.items():
            name = name_b.decode(errors="surrogateescape")
            entry = self._decode(_join(dir_path, name), value)
            if entry is not None:
                out[name] = entry
        return out

    # -- blobs -------------------------------------------------------------
    def _blob_key(self, hex_digest: str, i: int) -> str:
        return f"{self.prefix}b:{hex_digest}:{i}"

    def fetch_blob(self, hex_digest: str, size: int) -> bytes | None:
        """The blob's bytes, or None when Redis lacks (part of) it.  Not verified here."""
        n = max(1, -(-size // CHUNK))
        parts = self._call(self.client.mget, [self._blob_key(hex_digest, i) for i in range(n)])
        if any(p is None for p in parts):
            return None
        data = b"".join(parts)
        self.counters["remote_fetched_bytes"] += len(data)
        return data

    def upload(self, items: list[tuple[str, RemoteEntry, str | None]]) -> None:
        """Publish (path, entry, blob file to upload if Redis lacks it) items, pipelined."""
        # blob_path "" means empty content; None means no blob (directories, symlinks)
        blobs = {e.hash: blob_path for _, e, blob_path in items if e.type == "f" and blob_path is not None}
        missing: list[str] = []
        if blobs:
            hexes = list(blobs)
            exists = self._call(self._exists_many, hexes)
            missing = [h for h, ok in zip(hexes, exists) if not ok]
        pipe = self.client.pipeline(transaction=False)
        uploaded = 0
        gone: set[str] = set()
        for h in missing:
            try:
                data = b""
                if blobs[h]:
                    with open(blobs[h], "rb") as f:  # type: ignore[arg-type]
                        data = f.read()
            except FileNotFoundError:
                gone.add(h)  # evicted before it could be uploaded: publish nothing for it
                continue
            for i in range(max(1, -(-len(data) // CHUNK))):
                pipe.set(self._blob_key(h, i), data[i * CHUNK:(i + 1) * CHUNK])
            uploaded += len(data)
        items = [it for it in items if it[1].hash not in gone]
        for path, entry, _ in items:
            dir_path, _, name = path.rpartition("/")
            pipe.hset(self._dir_key(dir_path), name, self._encode(path, entry))
        self._call(pipe.execute)
        self.counters["remote_uploaded_bytes"] += uploaded
        self.counters["remote_uploaded_entries"] += len(items)

    def _exists_many(self, hexes: list[str]) -> list[bool]:
        pipe = self.client.pipeline(transaction=False)
        for h in hexes:
            pipe.exists(self._blob_key(h, 0))
        return [bool(x) for x in pipe.execute()]

    def close(self) -> None:
        self.client.close()


def _join(dir_path: str, name: str) -> str:
    return f"{dir_path}/{name}" if dir_path else name


def _is_hex_digest(value: Any) -> bool:
    if not isinstance(value, str) or len(value) != 64:
        return False
    try:
        bytes.fromhex(value)
    except ValueError:
        return False
    return True
