"""Names in every store: the newest (version, node) wins whoever writes last, tombstones are versioned writes,
and what is read is hostile until checked (validation and the signature over namespace and path)."""

from __future__ import annotations

import json
import threading
import time
from typing import Any

import pytest

from mithrilfs.shared.stores.base import RemoteStore
from mithrilfs.shared.stores.entries import EntryCodec, RemoteEntry, RemoteError

from .conftest import Tier

HASH = "ab" * 32
OTHER_HASH = "cd" * 32


def file_entry(version: int, node: str, digest: str = HASH, size: int = 10) -> RemoteEntry:
    return RemoteEntry("f", version, node, digest, size, 0o644, 1)


def good_file(**changes: Any) -> bytes:
    """A valid, unsigned file entry's bytes with *changes* applied."""
    d: dict[str, Any] = {"t": "f", "v": 1_700_000_000_000_000, "n": "node-a", "h": HASH, "s": 123, "m": 0o644,
                         "mt": 1_700_000_000_000_000_000} | changes
    return json.dumps(d).encode()


@pytest.mark.parametrize("first,second,winner", [
    (file_entry(100, "node-a", HASH), file_entry(100, "node-b", OTHER_HASH), "node-b"),  # tie: node decides
    (file_entry(100, "node-b", OTHER_HASH), file_entry(100, "node-a", HASH), "node-b"),
    (file_entry(200, "node-a", HASH), file_entry(100, "node-z", OTHER_HASH), "node-a"),  # newer version wins
    (file_entry(100, "node-z", OTHER_HASH), file_entry(200, "node-a", HASH), "node-a"),
])
def test_two_writers_converge_on_the_newest_version_in_either_order(
        tier: Tier, first: RemoteEntry, second: RemoteEntry, winner: str) -> None:
    """Whatever order two nodes publish the same path in, the store ends with the newest (version, node), and
    each writer is told what it replaced or what stayed."""
    a, b = tier.node(), tier.node()
    assert a.publish_entries([("lib/k.so", first)]) == [(True, None)]
    written, other = b.publish_entries([("lib/k.so", second)])[0]
    expected = first if first.node == winner else second
    assert written == (expected is second)
    assert other == first
    for reader in (a, b, tier.node()):
        assert reader.list_dir("lib") == {b"k.so": expected}


def test_many_writers_on_one_directory_lose_nothing_and_keep_the_newest(tier: Tier) -> None:
    """Six writers on three nodes publish into one directory at once: every name is there, each shared name
    holds its newest version, and an older write is refused with the newer entry returned."""
    nodes = [tier.node() for _ in range(3)]
    errors: list[Exception] = []

    def writer(i: int) -> None:
        try:
            for j in range(8):
                nodes[i % 3].publish_entries([(f"k/own-{i}-{j}", file_entry(1000 + j, f"node{i}")),
                                              (f"k/shared-{j}", file_entry(1000 + i, f"node{i}", size=i))])
        except RemoteError as e:
            errors.append(e)

    threads = [threading.Thread(target=writer, args=(i,)) for i in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors
    names = tier.node().list_dir("k")
    assert {f"own-{i}-{j}".encode() for i in range(6) for j in range(8)} <= set(names)
    assert all(names[f"shared-{j}".encode()].node == "node5" for j in range(8))
    written, other = nodes[1].publish_entries([("k/shared-0", file_entry(1, "node9"))])[0]
    assert not written and other is not None and other.node == "node5"


def test_a_newer_tombstone_deletes_and_an_older_one_does_not(store: RemoteStore) -> None:
    """Deletion is a versioned write too: it wins only when it is newer than the entry it meets, and an older
    entry does not bring the name back."""
    store.publish_entries([("d/gone.so", file_entry(100, "node-a")), ("d/kept.so", file_entry(300, "node-a"))])
    results = store.publish_entries([("d/gone.so", RemoteEntry("x", 200, "node-b")),
                                     ("d/kept.so", RemoteEntry("x", 200, "node-b"))])
    assert results == [(True, file_entry(100, "node-a")), (False, file_entry(300, "node-a"))]
    listed = store.list_dir("d")
    assert listed[b"gone.so"] == RemoteEntry("x", 200, "node-b") and listed[b"kept.so"] == file_entry(300, "node-a")
    assert store.publish_entries([("d/gone.so", file_entry(150, "node-c"))])[0][0] is False
    assert store.list_dir("d")[b"gone.so"].is_tombstone


def test_directories_are_listed_one_by_one_or_together_and_all_found(store: RemoteStore) -> None:
    """``list_dirs`` answers as ``list_dir`` does for each (empty for a directory with no names), and
    ``all_dirs`` names every directory holding an entry (Redis in front of a bucket may name one it knows
    empty too: its mark that the directory is complete)."""
    store.publish_entries([("a/x", file_entry(1, "n")), ("a/b/y", file_entry(2, "n")), ("c/z", file_entry(3, "n")),
                           ("a/b", RemoteEntry("d", 1, "n", mode=0o755)), ("top", file_entry(4, "n"))])
    together = store.list_dirs(["a", "a/b", "c", "none"])
    assert together == {d: store.list_dir(d) for d in ("a", "a/b", "c", "none")}
    assert set(together["a"]) == {b"x", b"b"} and together["none"] == {}
    assert {"", "a", "a/b", "c"} <= set(store.all_dirs())


def test_hostile_entries_are_ignored_and_counted(tier: Tier) -> None:
    """An entry that is no entry (a bool for a size, JSON nested past any limit) or a name that cannot be one
    vanishes from the listing, counted; the good entry beside it stays."""
    store = tier.node()
    store.publish_entries([("dir/good.so", file_entry(10, "node-a"))])
    tier.plant_entry(store, "dir", b"bool.so", good_file(s=True))
    tier.plant_entry(store, "dir", b"deep.so", b"[" * 4000 + b"]" * 4000)
    tier.plant_entry(store, "dir", b"..", good_file())
    reader = tier.node()
    assert reader.list_dir("dir") == {b"good.so": file_entry(10, "node-a")}
    assert reader.counters["remote_rejected"] >= 3
    assert reader.available()


def test_entries_signed_with_another_key_are_ignored_and_never_keep_a_write_out(tier: Tier) -> None:
    """With a key, only entries carrying our HMAC count; an unsigned or foreign entry does not get to stay by
    claiming a newer version: ours is written over it."""
    ours, theirs = tier.node(key=b"our key"), tier.node(key=b"their key")
    theirs.publish_entries([("d/theirs.so", file_entry(100, "node-t"))])
    ours.publish_entries([("d/ours.so", file_entry(100, "node-o"))])
    tier.plant_entry(ours, "d", b"unsigned.so", good_file())
    assert ours.list_dir("d") == {b"ours.so": file_entry(100, "node-o")}
    assert ours.counters["remote_rejected"] >= 2
    assert theirs.list_dir("d") == {b"theirs.so": file_entry(100, "node-t")}
    written, other = ours.publish_entries([("d/theirs.so", file_entry(50, "node-o"))])[0]
    assert written and other is None
    assert ours.list_dir("d")[b"theirs.so"] == file_entry(50, "node-o")


def test_the_signature_covers_namespace_and_path(tier: Tier) -> None:
    """A validly signed entry copied to another name, or into another namespace, is refused."""
    store = tier.node(key=b"k")
    store.publish_entries([("d/a.so", file_entry(100, "node-a"))])
    signed = EntryCodec(tier.namespace, b"k", {"remote_rejected": 0}).encode("d/a.so", file_entry(100, "node-a"))
    tier.plant_entry(store, "d", b"b.so", signed)
    assert set(store.list_dir("d")) == {b"a.so"}
    elsewhere = tier.node(key=b"k", namespace=tier.namespace + "-other")
    tier.plant_entry(elsewhere, "d", b"a.so", signed)
    assert elsewhere.list_dir("d") == {}


def test_an_entry_dated_past_the_tiers_time_is_refused_and_keeps_no_write_out(tier: Tier) -> None:
    """A writer whose clock runs a day ahead pins nothing: once a node measured the tier's time, the entry
    dated ahead is no entry when read, and an honest write replaces it."""
    ahead, honest = tier.node(), tier.node()
    day_ahead = (int(time.time()) + 86_400) * 1_000_000
    ahead.publish_entries([("d/pinned", file_entry(day_ahead, "node-ahead"))])
    honest.clock.measure()
    assert honest.list_dir("d") == {}
    now = honest.clock.now_us()
    written, _ = honest.publish_entries([("d/pinned", file_entry(now, "node-honest"))])[0]
    assert written
    assert honest.list_dir("d") == {b"pinned": file_entry(now, "node-honest")}


def test_the_tiers_clock_is_measured_against_the_store(store: RemoteStore) -> None:
    """``server_time`` is the store's clock (these servers run on this machine: within a few seconds of
    ours), and a clock measured against it dates by it."""
    assert abs(store.server_time() - time.time()) < 5
    store.clock.measure()
    assert store.clock.known and abs(store.clock.now() - time.time()) < 5


def test_the_epoch_is_made_once_and_then_stays(tier: Tier) -> None:
    """A new namespace's first node makes the epoch; every node then reads the same token."""
    token, made = tier.node().epoch()
    assert made and token
    assert tier.node().epoch() == (token, False)
