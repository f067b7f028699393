"""The entry model (``entries.parse_entry``): what an attacker with write access to any store could put there
is refused with a reason, and every valid entry reads back field for field."""

from __future__ import annotations

import json
from typing import Any

import pytest

from mithrilfs.shared.stores.entries import (
    MAX_ENTRY_BYTES,
    MAX_PACK_BYTES,
    MAX_SIZE,
    MAX_VERSION,
    RemoteEntry,
    parse_entry,
)

HASH = "ab" * 32


def good_file(**changes: Any) -> dict[str, Any]:
    """A valid file entry's fields, with *changes* applied (None removes a field)."""
    d: dict[str, Any] = {"t": "f", "v": 1_700_000_000_000_000, "n": "node-a", "h": HASH, "s": 123,
                         "m": 0o644, "mt": 1_700_000_000_000_000_000}
    for k, v in changes.items():
        if v is None:
            d.pop(k, None)
        else:
            d[k] = v
    return d


def raw(d: dict[str, Any]) -> bytes:
    return json.dumps(d).encode()


# -- parse_entry: everything read from Redis is hostile ------------------------------------------

@pytest.mark.parametrize("value,why", [
    (b'{"t":"d","v":1,"n":"a","m":0,"mt":0,"pad":"' + b"x" * MAX_ENTRY_BYTES + b'"}', "too large"),
    (b"[" * 4000 + b"]" * 4000, "not JSON"),  # deep nesting under the size limit: no RecursionError escapes
    (b'{"t":"f"', "not JSON"),
    (b"[1, 2]", "not an entry object"),
    (raw(good_file(extra="field")), "not an entry object"),
    (raw(good_file(t="q")), "unknown type"),
    (raw(good_file(n="has space")), "bad node"),
    (raw(good_file(n="")), "bad node"),
    (raw(good_file(n="x" * 65)), "bad node"),
    (raw(good_file(n=7)), "bad node"),
    (raw(good_file(v=True)), "'v' out of range"),
    (raw(good_file(v=1.0)), "'v' out of range"),
    (raw(good_file(v=0)), "'v' out of range"),
    (raw(good_file(v=MAX_VERSION)), "'v' out of range"),
    (raw(good_file(s=True)), "'s' out of range"),
    (raw(good_file(s=-1)), "'s' out of range"),
    (raw(good_file(s=MAX_SIZE)), "'s' out of range"),
    (raw(good_file(s="123")), "'s' out of range"),
    (raw(good_file(m=False)), "'m' out of range"),
    (raw(good_file(m=0o10000)), "'m' out of range"),
    (raw(good_file(mt=-1)), "'mt' out of range"),
    (raw(good_file(h=HASH.upper())), "bad hash"),
    (raw(good_file(h=HASH[:-1])), "bad hash"),
    (raw(good_file(h=HASH[:-1] + "g")), "bad hash"),
    (raw(good_file(h=None)), "bad hash"),
    (raw(good_file(mac=5)), "bad mac"),
    (raw({"t": "l", "v": 1, "n": "a", "m": 0o777, "mt": 0, "tg": ""}), "bad symlink target"),
    (raw({"t": "l", "v": 1, "n": "a", "m": 0o777, "mt": 0, "tg": "a\0b"}), "bad symlink target"),
    (raw({"t": "l", "v": 1, "n": "a", "m": 0o777, "mt": 0, "tg": "x" * 4096}), "bad symlink target"),
    # a blob's place in a pack: both fields or neither, a pack id, inside one pack, only on files
    (raw(good_file(pk="ab" * 16)), "'po' out of range"),
    (raw(good_file(po=0)), "bad pack id"),
    (raw(good_file(pk="AB" * 16, po=0)), "bad pack id"),
    (raw(good_file(pk="ab" * 15, po=0)), "bad pack id"),
    (raw(good_file(pk=7, po=0)), "bad pack id"),
    (raw(good_file(pk="ab" * 16, po=-1)), "'po' out of range"),
    (raw(good_file(pk="ab" * 16, po=True)), "'po' out of range"),
    (raw(good_file(pk="ab" * 16, po=MAX_PACK_BYTES)), "'po' out of range"),
    (raw(good_file(pk="ab" * 16, po=MAX_PACK_BYTES - 100, s=101)), "past the end of any pack"),
    (raw({"t": "d", "v": 1, "n": "a", "m": 0o755, "mt": 0, "pk": "ab" * 16, "po": 0}), "no file"),
    (raw({"t": "x", "v": 1, "n": "a", "po": 0}), "no file"),
    # the pack's write time: optional, only with a place, a positive whole number of seconds
    (raw(good_file(pt=1_700_000_000)), "pack time without a pack"),
    (raw(good_file(pk="ab" * 16, po=0, pt=0)), "'pt' out of range"),
    (raw(good_file(pk="ab" * 16, po=0, pt=1.5)), "'pt' out of range"),
    (raw(good_file(pk="ab" * 16, po=0, pt=True)), "'pt' out of range"),
    (raw(good_file(pk="ab" * 16, po=0, pt=10**10)), "'pt' out of range"),
    (raw({"t": "d", "v": 1, "n": "a", "m": 0o755, "mt": 0, "pt": 5}), "no file"),
])
def test_parse_entry_rejects_hostile_entries(value: bytes, why: str) -> None:
    """Each way an entry can be wrong is refused with a reason (and never raises anything but ValueError)."""
    with pytest.raises(ValueError, match=why):
        parse_entry(value)


def test_parse_entry_accepts_good_entries() -> None:
    """Valid entries of every type come back field for field, with their mac."""
    entry, mac = parse_entry(raw(good_file(mac="m" * 64, s=MAX_SIZE - 1)))
    assert entry == RemoteEntry("f", 1_700_000_000_000_000, "node-a", HASH, MAX_SIZE - 1, 0o644,
                                1_700_000_000_000_000_000)
    assert mac == "m" * 64
    tomb, mac = parse_entry(b'{"t":"x","v":5,"n":"b"}')
    assert tomb.is_tombstone and (tomb.version, tomb.node, mac) == (5, "b", None)
    link, _ = parse_entry(raw({"t": "l", "v": 2, "n": "c", "m": 0o777, "mt": 3, "tg": "../lib.so"}))
    assert (link.type, link.target) == ("l", "../lib.so")
    d, _ = parse_entry(raw({"t": "d", "v": MAX_VERSION - 1, "n": "d", "m": 0o755, "mt": 0}))
    assert (d.type, d.version) == ("d", MAX_VERSION - 1)
    located, _ = parse_entry(raw(good_file(pk="0f" * 16, po=MAX_PACK_BYTES - 123)))
    assert (located.pack, located.offset) == ("0f" * 16, MAX_PACK_BYTES - 123)
    assert parse_entry(raw(located.fields()))[0] == located  # the place survives a round trip
    assert located.packed == 0 and "pt" not in located.fields()  # an entry from before pack times: unchanged
    timed, _ = parse_entry(raw(good_file(pk="0f" * 16, po=0, pt=1_700_000_000)))
    assert timed.packed == 1_700_000_000 and parse_entry(raw(timed.fields()))[0] == timed
