"""The change feed's records: what a node announces reads back the same; anything else is refused."""

from __future__ import annotations

import json

import pytest

from mithrilfs.shared.sync.changes import RECORD_PATHS, ChangeCodec, path_parts


def test_a_record_reads_back_as_written_and_signed_ones_must_match_the_key():
    plain = ChangeCodec("default", None)
    changes = [("triton/abc", 1_700_000_000_000_000, True), ("a b/\udcff.so", 5, False)]
    assert plain.decode(plain.encode("node-1", changes)) == ("node-1", changes)
    signed = ChangeCodec("default", b"k" * 32)
    raw = signed.encode("node-1", changes)
    assert signed.decode(raw) == ("node-1", changes)
    with pytest.raises(ValueError, match="signature"):
        ChangeCodec("default", b"other key").decode(raw)
    with pytest.raises(ValueError, match="signature"):
        ChangeCodec("elsewhere", b"k" * 32).decode(raw)  # another namespace's record
    with pytest.raises(ValueError, match="signature"):
        signed.decode(plain.encode("node-1", changes))  # unsigned
    doc = json.loads(raw)
    doc["x"][0][1] += 1  # a version raised
    with pytest.raises(ValueError, match="signature"):
        signed.decode(json.dumps(doc).encode())


@pytest.mark.parametrize("path", ["", "..", "a/..", "../a", "/a", "a/", "a//b", ".", "a/./b", "a\0b", "x" * 256,
                                  "/".join(["d"] * 2100), 5, None, ["a"]])
def test_paths_that_cannot_be_a_mount_path_are_refused(path):
    assert path_parts(path) is None
    raw = json.dumps({"mithrilfs_change": 1, "n": "node-1", "x": [[path, 5, 1]]}).encode()
    with pytest.raises(ValueError):
        ChangeCodec("default", None).decode(raw)


@pytest.mark.parametrize("raw", [
    None, b"", b"{", b"[" * 100_000, b"[]", b'"x"', b"{}",
    b'{"mithrilfs_change": 2, "n": "n", "x": [["a", 5, 1]]}',
    b'{"mithrilfs_change": 1, "n": "../x", "x": [["a", 5, 1]]}',
    b'{"mithrilfs_change": 1, "n": "n", "x": []}',
    b'{"mithrilfs_change": 1, "n": "n", "x": [["a", 5, 2]]}',
    b'{"mithrilfs_change": 1, "n": "n", "x": [["a", 5, true]]}',
    b'{"mithrilfs_change": 1, "n": "n", "x": [["a", true, 1]]}',
    b'{"mithrilfs_change": 1, "n": "n", "x": [["a", 9007199254740993, 1]]}',
    b'{"mithrilfs_change": 1, "n": "n", "x": [["a", 0, 1]]}',
    b'{"mithrilfs_change": 1, "n": "n", "x": [["a", 5]]}',
    b'{"mithrilfs_change": 1, "n": "n", "x": [["a", 5, 1]], "more": 1}',
    json.dumps({"mithrilfs_change": 1, "n": "n", "x": [["a", 5, 1]] * (RECORD_PATHS + 1)}).encode(),
])
def test_malformed_records_are_refused(raw):
    with pytest.raises(ValueError):
        ChangeCodec("default", None).decode(raw)
