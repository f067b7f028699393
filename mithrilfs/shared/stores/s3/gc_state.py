"""``gc-state``: the manifests the last ``fleet gc`` read, kept in the bucket so the next run reads only those
that changed.

A LIST of ``names/`` gives every manifest's ETag, a thousand to a request;
a run GETs only the manifests whose ETag is not in the state, and writes
the state again (one object, zlib-compressed) when what it read differs.
The state holds each manifest's *bytes as stored*, and an entry is used
only when the MD5 of those bytes is the ETag the LIST gives now (S3 and
SeaweedFS give a single-part object's MD5 as its ETag): the state proves
itself, whoever wrote it.  An entry that does not (planted, broken, a
bucket whose ETags are no MD5) is read again; a state that does not parse
is none at all (counted as refused): the run reads every manifest, as
with no state.  So a state can cost requests, never a live name or blob.
"""

from __future__ import annotations

import hashlib
import struct
import zlib

#: The state's key, beside ``gc`` (the summary).
STATE_KEY = "gc-state"
_MAGIC = b"mithrilfs-gc-state 1\n"
#: A state larger than this (compressed, or once decompressed) is never read: a planted one is no bound on memory.
MAX_STATE_BYTES = 4 << 30
_HEAD = struct.Struct(">IHI")


def proven(etag: str, data: bytes) -> bool:
    """Whether *data* is what an object whose ETag is *etag* holds (the ETag is the bytes' MD5)."""
    tag = etag.strip('"').lower()
    return len(tag) == 32 and hashlib.md5(data, usedforsecurity=False).hexdigest() == tag


def encode(manifests: dict[str, tuple[str, bytes]]) -> bytes:
    """directory -> (ETag, the manifest's bytes) as one object."""
    parts = []
    for d, (etag, data) in sorted(manifests.items()):
        name, tag = d.encode(errors="surrogateescape"), etag.encode()
        parts += [_HEAD.pack(len(name), len(tag), len(data)), name, tag, data]
    return _MAGIC + zlib.compress(b"".join(parts), 1)


def decode(blob: bytes) -> dict[str, tuple[str, bytes]]:
    """``encode``'s inverse; ValueError when *blob* is not a state (or one past ``MAX_STATE_BYTES``)."""
    if not blob.startswith(_MAGIC):
        raise ValueError("not a gc state")
    inflate = zlib.decompressobj()
    try:
        body = inflate.decompress(blob[len(_MAGIC):], MAX_STATE_BYTES)
    except zlib.error as e:
        raise ValueError(f"not zlib data ({e})") from None
    if inflate.unconsumed_tail or not inflate.eof:
        raise ValueError("truncated, or larger than the bound")
    out: dict[str, tuple[str, bytes]] = {}
    at = 0
    while at < len(body):
        if at + _HEAD.size > len(body):
            raise ValueError("truncated")
        n, t, m = _HEAD.unpack_from(body, at)
        at += _HEAD.size
        if at + n + t + m > len(body):
            raise ValueError("truncated")
        try:
            d = body[at:at + n].decode(errors="surrogateescape")
            tag = body[at + n:at + n + t].decode("ascii")
        except UnicodeError:
            raise ValueError("an ETag that is no text") from None
        out[d] = (tag, body[at + n + t:at + n + t + m])
        at += n + t + m
    return out
