"""``gc-state`` as a bucket's gc reads it: whatever is not a state is refused in one ValueError, and a manifest's
bytes count only when their MD5 is the ETag listed now."""

from __future__ import annotations

import hashlib
import zlib

import pytest

from mithrilfs.shared.stores.s3 import gc_state

MANIFEST = b'{"entries": {"f": "{}"}, "mithrilfs": 1}'
ETAG = '"' + hashlib.md5(MANIFEST).hexdigest() + '"'


def test_a_state_reads_back_what_was_written_and_proves_only_the_bytes_its_etag_names() -> None:
    state = {"triton/k0": (ETAG, MANIFEST), "caf\udcc3": (ETAG, MANIFEST)}
    assert gc_state.decode(gc_state.encode(state)) == state
    assert gc_state.proven(ETAG, MANIFEST)
    assert not gc_state.proven(ETAG, MANIFEST + b" ")
    assert not gc_state.proven('"' + hashlib.md5(MANIFEST).hexdigest() + '-2"', MANIFEST)  # a multipart ETag


@pytest.mark.parametrize("blob", [
    b"", b"not a state", gc_state.encode({"d": (ETAG, MANIFEST)})[:-3],  # truncated
    gc_state.encode({})[:-8] + b"\xff" * 8,  # broken zlib
    b"mithrilfs-gc-state 1\n" + zlib.compress(b"\x00\x00\x00\x05\x00\x01\x00\x00\x00\x01ab"),  # a record past its end
    b"mithrilfs-gc-state 1\n" + zlib.compress(b"\x00\x00\x00\x01\x00\x01\x00\x00\x00\x00d\xff"),  # an ETag no text
])
def test_what_is_no_state_is_refused(blob: bytes) -> None:
    with pytest.raises(ValueError):
        gc_state.decode(blob)


def test_a_state_inflating_past_the_bound_is_refused(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(gc_state, "MAX_STATE_BYTES", 1000)
    with pytest.raises(ValueError):
        gc_state.decode(gc_state.encode({"d": (ETAG, bytes(5000))}))
