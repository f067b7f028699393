"""Records in every store: startup sets (one record per mount, the newest read, pruned by a last write) and
the purges kept for them (the newest read, with the floor below which nothing is known)."""

from __future__ import annotations

from collections.abc import Callable

from mithrilfs.shared.stores import records
from mithrilfs.shared.stores.entries import RemoteEntry
from mithrilfs.shared.stores.records import merged, new_record_id
from mithrilfs.shared.sync.changes import ChangeCodec

from .conftest import Tier

HASH = "ab" * 32


def entry(i: int) -> RemoteEntry:
    return RemoteEntry("f", 10 + i, "n", HASH, i)


def test_startup_set_records_are_written_over_read_newest_first_and_pruned_by_a_last_write(
        tier: Tier, limits: Callable[..., None]) -> None:
    """Each mount's record is written over at each write; a reader takes the ``RECORDS_READ`` newest (the
    newest record's order first) and changes nothing; a mount's last write keeps the ``RECORDS_KEPT`` newest."""
    nodes = [tier.node() for _ in range(3)]
    ids = []
    for i in range(6):  # six mounts, oldest first, each writing its record twice
        ids.append(new_record_id())
        nodes[i % 3].write_startup_record("warm", ids[-1], [(f"k{i}", RemoteEntry("d", 5, "n", mode=0o755))])
        nodes[i % 3].write_startup_record("warm", ids[-1], [(f"k{i}", RemoteEntry("d", 5, "n", mode=0o755)),
                                                            (f"k{i}/a", entry(i)), (f"k{i}/b", entry(i))])
    reader = tier.node()
    got = reader.startup_records("warm")
    assert [r.id for r in got] == ids[::-1][:records.RECORDS_READ]
    assert [p for p, _ in merged(got)] == [f"k{i}{n}" for i in (5, 4, 3, 2) for n in ("", "/a", "/b")]
    assert merged(got)[1] == ("k5/a", entry(5))
    assert [r.id for r in tier.node().startup_records("warm")] == [r.id for r in got]  # the reader wrote nothing
    assert tier.node().startup_records("cold") == []
    limits(RECORDS_KEPT=3, RECORDS_READ=10)
    last = new_record_id()
    nodes[1].write_startup_record("warm", last, [("new/x", entry(0))], last=True)  # a mount's unmount
    assert [r.id for r in tier.node().startup_records("warm")] == [last, ids[5], ids[4]]


def test_records_signed_with_another_key_lose_their_entries(tier: Tier) -> None:
    """A record is checked entry by entry against the reader's key: another key's entries are dropped and
    counted, the record itself stays (its id says a mount ran)."""
    ours, theirs = tier.node(key=b"k" * 16), tier.node(key=b"x" * 16)
    mine, forged = new_record_id(), new_record_id()
    ours.write_startup_record("warm", mine, [("k/ok", entry(1))])
    theirs.write_startup_record("warm", forged, [("k/forged", entry(2))])
    got = tier.node(key=b"k" * 16).startup_records("warm")
    assert [(r.id, [p for p, _ in r.items]) for r in got] == [(forged, []), (mine, ["k/ok"])]


def test_purge_records_are_kept_newest_first_bounded_with_the_floor(tier: Tier, limits: Callable[..., None]) -> None:
    """``forget --fleet``'s records kept for startup sets: the newest ``PURGES_READ`` read, the next one's
    version the floor (a set's entry older than it is not trusted), none past ``PURGES_KEPT``."""
    limits(PURGES_READ=2, PURGES_KEPT=3)
    writers, reader = [tier.node(), tier.node()], tier.node()
    assert reader.kept_purges() == ([], 0)
    codec = ChangeCodec(tier.namespace, None)
    raw = {v: codec.encode("node-a", [(f"gone/{v}", v, True)]) for v in (400, 100, 300, 200)}
    for i, v in enumerate(raw):
        writers[i % 2].keep_purge(v, raw[v])
    assert reader.kept_purges() == ([raw[400], raw[300]], 200)
    limits(PURGES_READ=5)
    assert reader.kept_purges() == ([raw[400], raw[300], raw[200]], 0)  # the oldest dropped: three kept
