"""Blobs in every store: by blake3, streamed to exactly their size, verified where a batch is read, and
what the store lacks said before an upload."""

from __future__ import annotations

import io
import os
from collections.abc import Callable

from mithrilfs.shared.stores.base import RemoteStore
from mithrilfs.shared.stores.entries import RemoteEntry
from mithrilfs.store.cas import hash_bytes

from .conftest import Tier


def test_a_blob_uploaded_by_one_node_is_read_back_whole_by_another(
        tier: Tier, blob_file: Callable[[bytes], tuple[str, str]]) -> None:
    """What a node uploads is what the store says it holds; another node that read the names fetches each
    blob at its size (a batch of small ones verified, a large one streamed); another size is never read
    as the blob, an absent one is a miss, and a file gone before its upload is said."""
    a, b = tier.node(), tier.node()
    blobs = {f"f{i}": os.urandom(1000 * (i + 1)) for i in range(4)} | {"big": os.urandom(2 << 20), "empty": b""}
    files = {n: blob_file(d) for n, d in blobs.items()}
    sizes = {files[n][0]: len(d) for n, d in blobs.items()}
    assert sorted(a.missing_blobs(sizes)) == sorted(sizes)
    gone = "ef" * 32
    assert a.upload_blobs([files[n] if n != "empty" else (files[n][0], "") for n in blobs]
                          + [(gone, "/nonexistent/blob")]) == {gone}
    a.publish_entries([(f"k/{n}", RemoteEntry("f", 1, "a", files[n][0], len(d))) for n, d in blobs.items()])
    assert [h for h in a.missing_blobs(sizes) if sizes[h]] == []
    assert b.list_dir("k").keys() == {n.encode() for n in blobs}  # the names: where the blobs are
    assert b.missing_blobs({h: s for h, s in sizes.items() if s}) == []
    small = [(files[n][0], len(d)) for n, d in blobs.items() if n.startswith("f")]
    assert b.fetch_small_blobs(small) == [d for n, d in blobs.items() if n.startswith("f")]
    for n in ("f2", "big"):
        out = io.BytesIO()
        assert b.fetch_blob(files[n][0], len(blobs[n]), out) == bytes.fromhex(files[n][0])
        assert out.getvalue() == blobs[n]
    assert b.fetch_blob("ab" * 32, 10, io.BytesIO()) is None
    assert b.fetch_small_blobs([(files["f0"][0], 1000), ("ab" * 32, 3)]) == [blobs["f0"], None]
    assert b.counters["remote_verify_failures"] == 0
    assert b.counters["remote_fetched_bytes"] > 2 << 20
    not_its_size = io.BytesIO()
    assert b.fetch_blob(files["big"][0], (2 << 20) - 1, not_its_size) in (b"", None)  # never read as the blob


def test_a_small_blob_with_other_bytes_is_never_handed_out_but_counted(tier: Tier) -> None:
    """The store verifies what ``fetch_small_blobs`` gives (size and blake3; the prefetch does not hash it
    again): bytes of the right size that are not the blob are None and counted; the right ones pass."""
    store = tier.node()
    good = os.urandom(3000)
    h = hash_bytes(good).hex()
    tier.plant_blob(store, h, os.urandom(3000))
    assert store.fetch_small_blobs([(h, 3000)]) == [None]
    assert store.counters["remote_verify_failures"] >= 1
    tier.plant_blob(store, h, good)
    assert tier.node().fetch_small_blobs([(h, 3000)]) == [good]


def test_a_node_fetches_what_it_wrote_by_hash_and_what_it_says_it_knows_where(
        store: RemoteStore, blob_file: Callable[[bytes], tuple[str, str]]) -> None:
    """The node that wrote a blob fetches it by its hash alone; ``knows_where`` never promises a place the
    fetch does not find (a store that cannot say answers False, and the tier reads the names first)."""
    data = os.urandom(5000)
    h, path = blob_file(data)
    assert store.upload_blobs([(h, path)]) == set()
    store.publish_entries([("d/x", RemoteEntry("f", 1, "a", h, len(data)))])
    out = io.BytesIO()
    assert store.fetch_blob(h, len(data), out) == bytes.fromhex(h) and out.getvalue() == data
    if store.placement.knows_where(h):
        assert store.fetch_small_blobs([(h, len(data))]) == [data]
