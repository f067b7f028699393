"""The shared tier's wire layer against a real redis-server: hostile entries, convergence, tombstones, HMAC.

``parse_entry`` is fed what an attacker with write access to Redis could
store; the conditional write (the Lua script behind
``RedisStore.publish_entries``) is exercised by two writers publishing the
same path in both orders on a real server (the ``redis_server`` fixture of
tests/conftest.py, stopped by PID).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from conftest import RedisServer

from mithrilfs.shared.stores.entries import (
    MAX_ENTRY_BYTES,
    MAX_PACK_BYTES,
    MAX_SIZE,
    MAX_VERSION,
    RemoteEntry,
    parse_entry,
)
from mithrilfs.shared.stores.redis.store import RedisStore

HASH = "ab" * 32
OTHER_HASH = "cd" * 32


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


def file_entry(version: int, node: str, digest: str = HASH, size: int = 10) -> RemoteEntry:
    return RemoteEntry("f", version, node, digest, size, 0o644, 1)


@pytest.fixture
def tiers(redis_server: RedisServer) -> Iterator[Callable[..., RedisStore]]:
    """Make RemoteTiers on the test's redis-server; every client made is closed afterwards."""
    made: list[RedisStore] = []

    def make(namespace: str = "t", key: bytes | None = None) -> RedisStore:
        tier = RedisStore(redis_server.url, namespace, key)
        made.append(tier)
        return tier

    try:
        yield make
    finally:
        for tier in made:
            tier.close()


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


def test_hostile_entries_in_redis_are_ignored_and_counted(redis_server: RedisServer,
                                                          tiers: Callable[..., RedisStore]) -> None:
    """What ``list_dir`` reads goes through the same checks: bad entries (and bad names) vanish, counted."""
    tier = tiers()
    tier.publish_entries([("dir/good.so", file_entry(10, "node-a"))])
    key = f"{tier.prefix}d:dir"
    assert redis_server.cli("HSET", key, "bool.so", raw(good_file(s=True)).decode()).returncode == 0
    assert redis_server.cli("HSET", key, "deep.so", "[" * 4000 + "]" * 4000).returncode == 0
    assert redis_server.cli("HSET", key, "..", raw(good_file()).decode()).returncode == 0
    before = tier.counters["remote_rejected"]
    assert tier.list_dir("dir") == {b"good.so": file_entry(10, "node-a")}
    assert tier.counters["remote_rejected"] == before + 3


# -- the conditional write: every node converges on the newest (version, node) ------------------

@pytest.mark.parametrize("first,second,winner", [
    (file_entry(100, "node-a", HASH), file_entry(100, "node-b", OTHER_HASH), "node-b"),  # tie: node decides
    (file_entry(100, "node-b", OTHER_HASH), file_entry(100, "node-a", HASH), "node-b"),
    (file_entry(200, "node-a", HASH), file_entry(100, "node-z", OTHER_HASH), "node-a"),  # newer version wins
    (file_entry(100, "node-z", OTHER_HASH), file_entry(200, "node-a", HASH), "node-a"),
])
def test_two_writers_converge_on_the_newest_version_in_either_order(
        tiers: Callable[..., RedisStore], first: RemoteEntry, second: RemoteEntry, winner: str) -> None:
    """Whatever order two nodes publish the same path in, Redis ends with the newest (version, node)."""
    a, b = tiers(), tiers()
    assert a.publish_entries([("lib/k.so", first)]) == [(True, None)]
    written, other = b.publish_entries([("lib/k.so", second)])[0]
    expected = first if first.node == winner else second
    assert written == (expected is second)
    assert other == first  # the entry replaced, or the newer one that stayed
    for reader in (a, b):
        assert reader.list_dir("lib") == {b"k.so": expected}


def test_a_newer_tombstone_deletes_and_an_older_one_does_not(tiers: Callable[..., RedisStore]) -> None:
    """Deletion is a versioned write too: it wins only when it is newer than the entry it meets."""
    tier = tiers()
    tier.publish_entries([("d/gone.so", file_entry(100, "node-a")), ("d/kept.so", file_entry(300, "node-a"))])
    results = tier.publish_entries([("d/gone.so", RemoteEntry("x", 200, "node-b")),
                                    ("d/kept.so", RemoteEntry("x", 200, "node-b"))])
    assert results[0] == (True, file_entry(100, "node-a"))
    assert results[1] == (False, file_entry(300, "node-a"))
    listed = tier.list_dir("d")
    assert listed[b"gone.so"].is_tombstone and listed[b"gone.so"].version == 200
    assert listed[b"kept.so"] == file_entry(300, "node-a")
    # an entry older than the tombstone does not bring the name back
    assert tier.publish_entries([("d/gone.so", file_entry(150, "node-c"))])[0][0] is False
    assert tier.list_dir("d")[b"gone.so"].is_tombstone


# -- HMAC ----------------------------------------------------------------------------------------

def test_entries_signed_with_another_key_are_ignored(redis_server: RedisServer,
                                                     tiers: Callable[..., RedisStore]) -> None:
    """With a key, only entries carrying our HMAC count: another key's, or none, are rejected."""
    ours, theirs = tiers(key=b"our key"), tiers(key=b"their key")
    theirs.publish_entries([("d/theirs.so", file_entry(100, "node-t"))])
    ours.publish_entries([("d/ours.so", file_entry(100, "node-o"))])
    redis_server.cli("HSET", f"{ours.prefix}d:d", "unsigned.so", raw(good_file()).decode())
    assert ours.list_dir("d") == {b"ours.so": file_entry(100, "node-o")}
    assert ours.counters["remote_rejected"] == 2
    assert theirs.list_dir("d") == {b"theirs.so": file_entry(100, "node-t")}
    # an unsigned or foreign entry does not get to stay by claiming a newer version
    written, other = ours.publish_entries([("d/theirs.so", file_entry(50, "node-o"))])[0]
    assert written and other is None
    assert ours.list_dir("d")[b"theirs.so"] == file_entry(50, "node-o")


def test_the_signature_covers_the_path(redis_server: RedisServer, tiers: Callable[..., RedisStore]) -> None:
    """A validly signed entry copied to another name is rejected: the HMAC binds namespace and path."""
    tier = tiers(key=b"k")
    tier.publish_entries([("d/a.so", file_entry(100, "node-a"))])
    value = redis_server.cli("HGET", f"{tier.prefix}d:d", "a.so").stdout.strip()
    redis_server.cli("HSET", f"{tier.prefix}d:d", "b.so", value)
    assert set(tier.list_dir("d")) == {b"a.so"}
    other_ns = tiers(namespace="other", key=b"k")
    redis_server.cli("HSET", f"{other_ns.prefix}d:d", "a.so", value)
    assert other_ns.list_dir("d") == {}


def test_a_complete_mark_is_trusted_only_while_fresh(redis_server: RedisServer):
    """Redis in front of a bucket: a stale mark (a missed write, an old snapshot) sends readers to the bucket."""
    from mithrilfs.shared.stores.redis import store as redis_wire

    store = RedisStore(redis_server.url, "ns")
    store.publish_entries([("d/a", RemoteEntry("f", 5, "n", HASH, 1))])
    assert store.list_dir_complete("d") == ({b"a": RemoteEntry("f", 5, "n", HASH, 1)}, False)
    store.mark_complete(["d"])
    assert store.list_dir_complete("d")[1]
    old = str(time.time() - redis_wire.COMPLETE_SECONDS - 1)
    store.client.hset("mfs:ns:d:d", redis_wire.COMPLETE, old)  # (a NUL byte cannot go through redis-cli)
    assert store.list_dir_complete("d") == ({b"a": RemoteEntry("f", 5, "n", HASH, 1)}, False)
    store.unmark_complete(["d"])
    store.close()


def test_threads_asking_at_once_share_one_client(redis_server: RedisServer) -> None:
    """A mount's worker threads make their first requests together: each must get the same client.

    Two clients made at once left one dropped, and a dropped redis-py client
    closes its pool: the socket the other thread was reading from went with
    it ("Bad file descriptor", a new node's first listing empty: a CI failure).
    """
    import threading

    def first_requests(store: RedisStore, threads: int = 8) -> tuple[set[int], list[BaseException]]:
        barrier = threading.Barrier(threads)
        seen: list[int] = []
        errors: list[BaseException] = []

        def first_request() -> None:
            barrier.wait()
            seen.append(id(store.client))
            try:
                store.list_dir("")
            except BaseException as e:
                errors.append(e)

        workers = [threading.Thread(target=first_request) for _ in range(threads)]
        for t in workers:
            t.start()
        for t in workers:
            t.join()
        return set(seen), errors

    for _ in range(20):
        store = RedisStore(redis_server.url, "race")
        clients, errors = first_requests(store)
        store.close()
        assert len(clients) == 1 and not errors, (clients, errors)


# -- startup sets: one record per mount, hostile until checked ------------------------------------

def test_startup_set_records_are_newest_first_bounded_and_hostile_ones_refused(
        redis_server: RedisServer, tiers: Callable[..., RedisStore], monkeypatch) -> None:
    """A reader gets the RECORDS_READ newest records in two requests and writes nothing; a record that is
    no record, too large, or holds entries signed with another key or impossible paths is refused or
    stripped, counted, and never raises."""
    from mithrilfs.shared.stores import records as startup_sets
    from mithrilfs.shared.stores.records import merged, new_record_id

    key = b"k" * 16
    ours, theirs = tiers("t", key), tiers("t", b"x" * 16)
    ids = [new_record_id() for _ in range(6)]
    for i, rid in enumerate(ids):
        ours.write_startup_record("warm", rid, [("k", RemoteEntry("d", 5, "n", mode=0o755)),
                                                (f"k/f{i}", file_entry(10 + i, "n"))])
    index = "mfs:t:startup:{warm}"
    assert redis_server.cli("ZCARD", index).stdout.strip() == "6"
    before = ours.level.requests
    records = ours.startup_records("warm")
    assert ours.level.requests - before == 1  # one call: ZREVRANGE, then one pipeline
    assert [r.id for r in records] == ids[::-1][:startup_sets.RECORDS_READ]
    assert [p for p, _ in merged(records)] == ["k", "k/f5", "k/f4", "k/f3", "k/f2"]
    assert redis_server.cli("ZCARD", index).stdout.strip() == "6"  # the reader wrote nothing
    # the ids a caller holds already (the bucket behind Redis gave them) are neither read nor decoded
    getranges = lambda: int(redis_server.cli("INFO", "commandstats").stdout.split(  # noqa: E731
        "cmdstat_getrange:calls=")[1].split(",")[0])
    read_before = getranges()
    assert [r.id for r in ours.startup_records("warm", frozenset(ids[3:]))] == ids[2::-1][:1]
    assert getranges() - read_before == 1
    # hostile records, newer than all of ours
    planted = [new_record_id() for _ in range(4)]
    theirs.write_startup_record("warm", planted[0], [("k/forged", file_entry(99, "n"))])  # another key's mac
    good = ours.codec.encode("k/ok", file_entry(7, "n")).decode()
    for rid, value in ((planted[1], b"[" * 5000), (planted[2], json.dumps({"mithrilfs": 1, "order": [
            ["../up", good], ["a//b", good], ["k/ok", good], ["k/ok2", good], [1, 2], "x"]}).encode()),
                       (planted[3], b"x" * 5000)):
        redis_server.cli("SET", f"{index}:{rid}", value.decode())
        redis_server.cli("ZADD", index, str(startup_sets.record_time(rid)), rid)
    monkeypatch.setattr(startup_sets, "MAX_RECORD_BYTES", 4000)
    rejected = ours.counters["remote_rejected"]
    records = ours.startup_records("warm")
    # the newest four: the giant and the non-JSON refused whole; the forged entry dropped; of the
    # mixed one only "k/ok" (signed for that path) stays
    assert [[p for p, _ in r.items] for r in records] == [["k/ok"], []]
    assert ours.counters["remote_rejected"] - rejected == 2 + 1 + 5
    assert ours.level.available()
    # a mount's last write keeps the RECORDS_KEPT newest, and their values only
    monkeypatch.setattr(startup_sets, "RECORDS_KEPT", 3)
    last = new_record_id()
    ours.write_startup_record("warm", last, [("k/f9", file_entry(20, "n"))], last=True)
    kept = redis_server.cli("ZREVRANGE", index, "0", "-1").stdout.split()
    assert kept == [last, planted[3], planted[2]]
    assert redis_server.cli("EXISTS", f"{index}:{ids[0]}").stdout.strip() == "0"


def test_a_small_blob_with_other_bytes_is_never_handed_out_but_counted(tiers: Callable[..., RedisStore]) -> None:
    """Redis's small blobs are verified where they are read (size and blake3): the prefetch does not hash
    them again."""
    import os

    from mithrilfs.store.cas import hash_bytes

    tier = tiers()
    good = os.urandom(3000)
    h = hash_bytes(good).hex()
    tier.client.set(tier._blob_key(h, 0), os.urandom(3000))  # planted: the right size, other bytes
    assert tier.fetch_small_blobs([(h, 3000)]) == [None]
    assert tier.counters["remote_verify_failures"] == 1
    tier.client.set(tier._blob_key(h, 0), good)
    assert tier.fetch_small_blobs([(h, 3000)]) == [good]


def test_purge_records_are_kept_newest_first_bounded_with_the_floor(redis_server: RedisServer,
                                                                    tiers: Callable[..., RedisStore],
                                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """``forget --fleet``'s records kept for startup sets: the newest PURGES_READ read in one request, the
    next one's version the floor (a set's entry older than it is not trusted), none past PURGES_KEPT."""
    from mithrilfs.shared.stores import records as startup_sets

    monkeypatch.setattr(startup_sets, "PURGES_READ", 2)
    monkeypatch.setattr(startup_sets, "PURGES_KEPT", 3)
    writer, reader = tiers(), tiers()
    assert reader.kept_purges() == ([], 0)
    for v in (400, 100, 300, 200):
        writer.keep_purge(v, f"r{v}".encode())
    assert reader.kept_purges() == ([b"r400", b"r300"], 200)
    assert redis_server.cli("ZCARD", "mfs:t:purges").stdout.strip() == "3"  # r100 dropped
    # planted scores out of range: read (and refused by the codec) first; one as the floor trusts nothing
    redis_server.cli("ZADD", "mfs:t:purges", "inf", "p1", "inf", "p2", "inf", "p3")
    from mithrilfs.shared.stores.entries import MAX_VERSION

    assert reader.kept_purges()[1] == MAX_VERSION
