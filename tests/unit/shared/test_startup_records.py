"""A startup set's records: read newest first, each entry checked once, merged as if each record were read alone."""

from __future__ import annotations

import collections
import json

from mithrilfs.shared.stores.entries import EntryCodec, RemoteEntry
from mithrilfs.shared.stores.records import decode_record, decode_records, encode_record, merged

KEY = b"k" * 32


def _file(i: int, version: int = 1_700_000_000_000_000) -> RemoteEntry:
    return RemoteEntry("f", version + i, "node-a", f"{i:064x}", 100 + i, 0o644, 1)


def _record_id(age: int) -> str:
    return f"{(1 << 62) + age:019d}-0123abcd"  # a larger number sorts later: an older record


def test_paths_a_newer_record_gave_are_checked_once_and_merge_to_the_same_set():
    codec = EntryCodec("default", KEY, collections.Counter())
    shared = [(f"triton/k{i}/kernel.bin", _file(i)) for i in range(50)]
    newest = encode_record(codec, shared + [("triton/only-new", _file(99))])
    changed = [(p, _file(i, 1_800_000_000_000_000) if i == 7 else e) for i, (p, e) in enumerate(shared)]
    older = encode_record(codec, changed + [("triton/only-old", _file(98))])
    raw = [(_record_id(2), older), (_record_id(1), newest), (_record_id(3), older)]  # any order given
    alone = merged([r for r in (decode_record(codec, i, d) for i, d in raw) if r is not None])
    checked = collections.Counter()
    codec.decode = lambda path, data, _decode=codec.decode: checked.update([path]) or _decode(path, data)
    records = decode_records(codec, raw)
    assert [r.id for r in records] == sorted(i for i, _ in raw)  # newest first
    assert merged(records) == alone  # the same set: path order, and the newer version of kernel 7 wins
    assert dict(alone)["triton/k7/kernel.bin"].version == 1_800_000_000_000_007
    # each path's entry checked once: kernel 7's twice (the older records give it another entry)
    assert checked.pop("triton/k7/kernel.bin") == 2 and set(checked.values()) == {1} and len(checked) == 51


def test_an_item_equal_to_a_newer_one_in_path_only_is_still_checked():
    """A planted older record naming a path the newest gave, with another (unsigned) entry: refused, counted."""
    counters = collections.Counter()
    codec = EntryCodec("default", KEY, counters)
    newest = encode_record(codec, [("a/b", _file(1))])
    forged = json.loads(encode_record(EntryCodec("default", None, collections.Counter()), [("a/b", _file(1, 2 << 60))]))
    forged["order"] += [[["a/b"], "x"], ["a/b", {"t": "f"}], [1, 2]]  # not a path and an entry: counted
    records = decode_records(codec, [(_record_id(1), newest), (_record_id(2), json.dumps(forged).encode())])
    assert [len(r.items) for r in records] == [1, 0] and counters["remote_rejected"] == 4
    assert merged(records) == [("a/b", _file(1))]


def test_a_record_of_more_paths_than_a_writer_records_is_refused_whole():
    """No writer records more than ``MAX_RECORD_PATHS``: a record naming more is planted, refused unread past
    its shape (counted once), and a record at the limit is read; a path over ``MAX_PATH_BYTES`` is no path."""
    from mithrilfs.shared.stores.records import MAX_PATH_BYTES, MAX_RECORD_PATHS, valid_path

    counters = collections.Counter()
    codec = EntryCodec("default", None, counters)
    entry = codec.encode("d/f", _file(1)).decode()
    full = [[f"d/f{i}", entry] for i in range(MAX_RECORD_PATHS)]
    over = json.dumps({"mithrilfs": 1, "order": [*full, ["d/one-more", entry]]}).encode()
    assert decode_record(codec, _record_id(1), over) is None and counters["remote_rejected"] == 1
    at_limit = decode_record(codec, _record_id(2), json.dumps({"mithrilfs": 1, "order": full}).encode())
    assert at_limit is not None and len(at_limit.items) == MAX_RECORD_PATHS and counters["remote_rejected"] == 1
    deepest = "/".join(["d"] * (MAX_PATH_BYTES // 2)) + "/x"
    assert valid_path(deepest[:MAX_PATH_BYTES]) and not valid_path(deepest[:MAX_PATH_BYTES] + "x")
