"""The Redis store's own: the complete marks of Redis in front of a bucket, one client shared by threads, and
what its records cost and refuse in Redis's keys (what every store does is tests/contract's).

Against a real redis-server (the ``redis_server`` fixture of tests/conftest.py, stopped by PID).
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterator

import pytest
from conftest import RedisServer

from mithrilfs.shared.stores.entries import RemoteEntry
from mithrilfs.shared.stores.redis.store import RedisStore

HASH = "ab" * 32


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


def test_a_complete_mark_is_trusted_only_while_fresh(redis_server: RedisServer):
    """Redis in front of a bucket: a stale mark (a missed write, an old snapshot) sends readers to the bucket."""
    from mithrilfs.shared.stores.redis import store as redis_store

    store = RedisStore(redis_server.url, "ns")
    store.publish_entries([("d/a", RemoteEntry("f", 5, "n", HASH, 1))])
    assert store.list_dir_complete("d") == ({b"a": RemoteEntry("f", 5, "n", HASH, 1)}, False)
    store.mark_complete(["d"])
    assert store.list_dir_complete("d")[1]
    old = str(time.time() - redis_store.COMPLETE_SECONDS - 1)
    store.client.hset("mfs:ns:d:d", redis_store.COMPLETE, old)  # (a NUL byte cannot go through redis-cli)
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

def test_startup_set_records_cost_one_request_skip_what_the_caller_holds_and_refuse_planted_ones(
        redis_server: RedisServer, tiers: Callable[..., RedisStore], monkeypatch) -> None:
    """A reader's ids and values come in one call (a ZREVRANGE, then one pipeline of GETRANGEs) and it writes
    nothing; the ids a caller holds are not read; a planted record that is no record, too large, or holds
    entries signed with another key or impossible paths is refused or stripped, counted, and never raises;
    a last write drops the pruned records' values with their ids."""
    from mithrilfs.shared.stores import records as redis_records
    from mithrilfs.shared.stores import records as sets
    from mithrilfs.shared.stores.records import new_record_id

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
    assert [r.id for r in records] == ids[::-1][:sets.RECORDS_READ]
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
        redis_server.cli("ZADD", index, str(sets.record_time(rid)), rid)
    monkeypatch.setattr(redis_records, "MAX_RECORD_BYTES", 4000)
    rejected = ours.counters["remote_rejected"]
    records = ours.startup_records("warm")
    # the newest four: the giant and the non-JSON refused whole; the forged entry dropped; of the
    # mixed one only "k/ok" (signed for that path) stays
    assert [[p for p, _ in r.items] for r in records] == [["k/ok"], []]
    assert ours.counters["remote_rejected"] - rejected == 2 + 1 + 5
    assert ours.level.available()
    # a mount's last write keeps the RECORDS_KEPT newest, and their values only
    monkeypatch.setattr(redis_records, "RECORDS_KEPT", 3)
    last = new_record_id()
    ours.write_startup_record("warm", last, [("k/f9", file_entry(20, "n"))], last=True)
    kept = redis_server.cli("ZREVRANGE", index, "0", "-1").stdout.split()
    assert kept == [last, planted[3], planted[2]]
    assert redis_server.cli("EXISTS", f"{index}:{ids[0]}").stdout.strip() == "0"


def test_purge_records_are_one_sorted_set_read_in_one_request_and_a_planted_score_trusts_nothing(
        redis_server: RedisServer, tiers: Callable[..., RedisStore], monkeypatch: pytest.MonkeyPatch) -> None:
    """``forget --fleet``'s records (the contract suite checks what every store keeps and reads): in Redis one
    sorted set, read with one request, never past PURGES_KEPT members; a score that is no version (planted)
    taken as the floor makes nothing below it trusted."""
    from mithrilfs.shared.stores import records as redis_records

    monkeypatch.setattr(redis_records, "PURGES_READ", 2)
    monkeypatch.setattr(redis_records, "PURGES_KEPT", 3)
    writer, reader = tiers(), tiers()
    assert reader.kept_purges() == ([], 0)
    for v in (400, 100, 300, 200):
        writer.keep_purge(v, f"r{v}".encode())
    before = reader.level.requests
    assert reader.kept_purges() == ([b"r400", b"r300"], 200)
    assert reader.level.requests - before == 1
    assert redis_server.cli("ZCARD", "mfs:t:purges").stdout.strip() == "3"  # r100 dropped
    # planted scores out of range: read (and refused by the codec) first; one as the floor trusts nothing
    redis_server.cli("ZADD", "mfs:t:purges", "inf", "p1", "inf", "p2", "inf", "p3")
    from mithrilfs.shared.stores.entries import MAX_VERSION

    assert reader.kept_purges()[1] == MAX_VERSION
