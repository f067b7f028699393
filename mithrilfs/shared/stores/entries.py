"""What every shared store holds about a name: an entry, its validation, and its signature.

An entry's version is the microsecond its name got its content on the node
that wrote it (``n``), on the tier's clock as that node measures it
(``tier_clock``), never its own; every store keeps the newest (version,
node) per name, so every node converges on one version per path whatever
the store.  A version dated past the tier's time is refused when read and
keeps no write out (a writer with a clock ahead pins nothing).
Everything read from a store is hostile until proven otherwise: entries are
validated field by field (``parse_entry``) and a bad one is ignored and
counted.  With a key, entries carry an HMAC over namespace, path and every
field including the version (``EntryCodec``), so an entry means the same in
Redis and in a bucket, and one copied from one into the other stays valid.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from mithrilfs.store.namespace import join_path, valid_name

log = logging.getLogger(__name__)

#: A directory holding more names than this in a store is refused as hostile (counted in
#: ``remote_rejected``, read as empty): merging it would hold the mount, and compile caches hold a few
#: thousand names per directory.  Writers add no new name past it (``s3_wire``).
MAX_DIR_NAMES = 50_000
#: Entries larger than this are not entries (a name, a hash and a few numbers fit in far less).
MAX_ENTRY_BYTES = 8192
#: Versions are microseconds: exact in the doubles Lua compares them as.
MAX_VERSION = 1 << 53
MAX_SIZE = 1 << 53
MAX_TARGET = 4095
#: A pack object (``s3_wire``'s ``packs/``) is at most this large: a location past it is not one.
MAX_PACK_BYTES = 64 << 20
NODE_RE = re.compile(r"[A-Za-z0-9._-]{1,64}")
_PACK_RE = re.compile(r"[0-9a-f]{32}")
_KEYS = {"t", "v", "n", "h", "s", "m", "mt", "tg", "pk", "po", "pt", "mac"}
#: A pack's write time (``pt``, unix seconds) is below this (year 2286): a bound, not a check of the clock.
MAX_PACK_TIME = 10**10


#: A small blob's verified bytes as a store hands them over: bytes, or a view of a bucket's range (``s3_packs``
#: reads a range once and hands out views of its blobs: a prefetch moves every byte of a startup set).
BlobBytes = bytes | memoryview


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
    #: Where a bucket holds the file's blob: a pack's id and the blob's offset in it (``s3_wire``'s
    #: packs); None: in its own object.  Signed like every other field, so it cannot be redirected.
    pack: str | None = None
    offset: int = 0
    #: When the writer wrote that pack (unix seconds, its clock before the PUT; 0: unknown, an entry from
    #: before ``fleet gc`` collected packs).  A writer trusts a place only while this is younger than
    #: ``ages.BLOB_TRUST_SECONDS`` (``s3_blobs.missing``), so gc may delete a pack no listed name locates.
    packed: int = 0

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
            if self.pack is not None:
                d.update(pk=self.pack, po=self.offset)
                if self.packed:
                    d["pt"] = self.packed
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
    if not isinstance(node, str) or not NODE_RE.fullmatch(node):
        raise ValueError("bad node")
    version = _int(d, "v", 1, MAX_VERSION)
    mac = d.get("mac")
    if mac is not None and not isinstance(mac, str):
        raise ValueError("bad mac")
    if t != "f" and ("pk" in d or "po" in d or "pt" in d):
        raise ValueError("a location on an entry that is no file")
    if t == "x":
        return RemoteEntry("x", version, node), mac
    mode = _int(d, "m", 0, 0o10000)
    mtime = _int(d, "mt", 0, 1 << 63)
    if t == "f":
        h = d.get("h")
        if not is_hex_digest(h):
            raise ValueError("bad hash")
        size = _int(d, "s", 0, MAX_SIZE)
        pack, offset, packed = _location(d, size)
        return RemoteEntry("f", version, node, h, size, mode, mtime, pack=pack, offset=offset, packed=packed), mac
    if t == "l":
        tg = d.get("tg")
        if not isinstance(tg, str) or not 0 < len(tg.encode(errors="surrogateescape")) <= MAX_TARGET or "\0" in tg:
            raise ValueError("bad symlink target")
        return RemoteEntry("l", version, node, mode=mode, mtime_ns=mtime, target=tg), mac
    return RemoteEntry("d", version, node, mode=mode, mtime_ns=mtime), mac


def _location(d: dict, size: int) -> tuple[str | None, int, int]:
    """A file entry's pack, offset and the pack's write time (None, 0, 0 without one): pack and offset both
    or neither, inside one pack; the time optional (entries written before it was kept have none)."""
    if "pk" not in d and "po" not in d:
        if "pt" in d:
            raise ValueError("a pack time without a pack")
        return None, 0, 0
    pack = d.get("pk")
    if not is_pack_id(pack):
        raise ValueError("bad pack id")
    offset = _int(d, "po", 0, MAX_PACK_BYTES)
    if offset + size > MAX_PACK_BYTES:
        raise ValueError("location past the end of any pack")
    packed = _int(d, "pt", 1, MAX_PACK_TIME) if "pt" in d else 0
    return pack, offset, packed


_HEX_DIGEST = re.compile(r"[0-9a-f]{64}")


def is_hex_digest(value: Any) -> bool:
    return isinstance(value, str) and _HEX_DIGEST.fullmatch(value) is not None


def is_pack_id(value: Any) -> bool:
    return isinstance(value, str) and _PACK_RE.fullmatch(value) is not None


class EntryCodec:
    """Entries to and from bytes for one namespace, signed with *key* when there is one."""

    def __init__(self, namespace: str, key: bytes | None, counters: dict[str, int], *,
                 horizon: Callable[[], int] = lambda: MAX_VERSION) -> None:
        self.namespace = namespace
        self.key = key
        self.counters = counters
        #: Versions past this are refused: dated ahead of the tier's time (``tier_clock.TierClock.horizon_us``).
        self.horizon = horizon

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
        entry, why = self.check(path, raw)
        if entry is None:
            self.counters["remote_rejected"] += 1
            log.warning("remote entry %r %s", path, why)
        return entry

    def check(self, path: str, raw: bytes) -> tuple[RemoteEntry | None, str]:
        """``decode`` without counting or logging: (the entry, "") or (None, why it is refused)."""
        try:
            entry, mac = parse_entry(raw)
        except ValueError as e:
            return None, f"ignored: {e}"
        if self.key is not None and (mac is None or not hmac.compare_digest(mac, self._mac(path, entry.fields()))):
            return None, "has no valid signature: ignored"
        if entry.version > self.horizon():
            return None, "ignored: dated past the tier's time (its writer's clock runs ahead)"
        return entry, ""

    def entries(self, dir_path: str, raw: dict[bytes, bytes]) -> dict[bytes, RemoteEntry]:
        """The valid entries of one directory's raw name -> value map (the rest counted and dropped)."""
        out = {}
        for name, value in raw.items():
            if not valid_name(name):
                self.counters["remote_rejected"] += 1
                continue
            entry = self.decode(join_path(dir_path, name), value)
            if entry is not None:
                out[name] = entry
        return out


def newest(a: RemoteEntry | None, b: RemoteEntry | None) -> RemoteEntry | None:
    """The newer of two entries for one name (None: absent): the rule every store converges by."""
    if a is None:
        return b
    if b is None:
        return a
    return b if b.newer_than(a.version, a.node) else a
