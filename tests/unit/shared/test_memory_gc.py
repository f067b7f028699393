"""``fleet gc`` over the in-memory store: what its plan takes under a budget and by age, and what a run deletes
and keeps (names, directories, blobs within the grace, use records), in milliseconds."""

from __future__ import annotations

from pathlib import Path

import pytest

from mithrilfs.shared.fleet import gc
from mithrilfs.shared.fleet.gc import Unit, plan
from mithrilfs.shared.stores.entries import RemoteEntry, RemoteError
from mithrilfs.shared.stores.memory.gc import MemoryCollector
from mithrilfs.shared.stores.memory.store import MemoryServer, MemoryStore
from mithrilfs.store.cas import hash_bytes

HOUR = 3600.0
DAY = 24 * HOUR


def unit(path: str, last_use: float, **blobs: int) -> Unit:
    return Unit(path, {}, {h: size for h, size in blobs.items()}, last_use)


def test_the_plan_takes_the_unused_past_the_age_then_the_least_recently_used_until_the_rest_fits() -> None:
    now = 10 * DAY
    units = {u.path: u for u in (unit("old", now - 3 * DAY, a=100), unit("cold", now - 5 * HOUR, b=300),
                                 unit("warm", now - 2 * HOUR, c=300), unit("hot", now - 60, d=300))}
    p = plan(units, now, max_size=700, max_age=2 * DAY)
    assert [u.path for u in p.victims] == ["old", "cold"] and p.by_age == 1
    assert (p.referenced_bytes, p.kept_bytes) == (1000, 600)
    assert [u.path for u in plan(units, now, None, None).victims] == []
    assert [u.path for u in plan(units, now, max_size=0, max_age=None).victims] == ["old", "cold", "warm", "hot"]


def test_a_blob_two_directories_share_counts_once_and_frees_its_bytes_with_the_last() -> None:
    """The budget counts what the names left would keep: a blob shared with a directory that stays is not
    freed by deleting the other."""
    now = 10 * DAY
    units = {u.path: u for u in (unit("a", now - 3 * HOUR, shared=500, own=100), unit("b", now - 2 * HOUR, shared=500),
                                 unit("c", now - HOUR, other=500))}
    assert plan(units, now, max_size=1100, max_age=None).victims == []  # 1,100 distinct bytes: it fits
    p = plan(units, now, max_size=1050, max_age=None)
    assert [u.path for u in p.victims] == ["a"] and p.kept_bytes == 1000  # 100 freed, the 500 kept by b
    p = plan(units, now, max_size=999, max_age=None)
    assert [u.path for u in p.victims] == ["a", "b"] and p.kept_bytes == 500


class Fleet:
    """A memory tier, a writer node whose clock may be set back, and gc's collector on its own store."""

    def __init__(self, tmp_path: Path) -> None:
        self.server = MemoryServer()
        self.writer = MemoryStore(self.server)
        self.collector = MemoryCollector(MemoryStore(self.server))
        self.tmp = tmp_path

    def write(self, dir_path: str, files: dict[str, bytes], *, hours_ago: float = 0.0, used: float | None = None
              ) -> dict[str, str]:
        """Upload and publish *files* under *dir_path* (and its entry in its parent) as a writer did
        *hours_ago*; its use recorded at *used* (unix seconds).  The blobs' hashes by name."""
        self.writer.clock.restore(int(-hours_ago * HOUR * 1e6))
        hashes = {}
        for name, data in files.items():
            h = hash_bytes(data).hex()
            (self.tmp / h).write_bytes(data)
            assert self.writer.upload_blobs([(h, str(self.tmp / h))]) == set()
            hashes[name] = h
        version = self.writer.clock.now_us()
        self.writer.publish_entries([(f"{dir_path}/{n}", RemoteEntry("f", version, "w", hashes[n], len(d)))
                                     for n, d in files.items()]
                                    + [(dir_path, RemoteEntry("d", version, "w", mode=0o755))])
        if used is not None:
            self.writer.record_use({dir_path: used})
        self.writer.clock.restore(0)
        return hashes

    def run(self, **kw: float | None) -> gc.Report:
        args: dict = {"max_size": None, "max_age": None, "grace": HOUR, "dry_run": False} | kw
        return gc.run(self.collector, **args)


@pytest.fixture
def fleet(tmp_path: Path) -> Fleet:
    return Fleet(tmp_path)


def test_a_run_deletes_the_least_recently_used_directory_its_name_and_its_unreferenced_old_blob(fleet: Fleet):
    now = fleet.server.time()
    old = fleet.write("k/old", {"a.so": b"a" * 1000}, hours_ago=5, used=now - 3 * HOUR)
    fleet.write("k/mid", {"b.so": b"b" * 1000, "shared.so": b"s" * 500}, hours_ago=5, used=now - 2 * HOUR)
    fleet.write("k/new", {"c.so": b"c" * 1000, "shared.so": b"s" * 500}, hours_ago=5, used=now - HOUR)
    report = fleet.run(max_size=2600)
    assert report.deleted == ["k/old"] and (report.deleted_dirs, report.deleted_names) == (1, 1)
    assert (report.deleted_blobs, report.freed_bytes) == (1, 1000)
    assert (report.names, report.dirs, report.blobs, report.bytes) == (4, 2, 3, 2500)
    reader = MemoryStore(fleet.server)
    assert reader.list_dir("k/old") == {} and set(reader.list_dir("k")) == {b"mid", b"new"}  # unlinked too
    assert reader.missing_blobs({old["a.so"]: 1000}) == [old["a.so"]]
    assert reader.fetch_small_blobs([(hash_bytes(b"s" * 500).hex(), 500)]) == [b"s" * 500]
    assert "k/old" not in fleet.server.space("default").used  # its use record went with it
    summary = reader.tier_summary()
    assert summary is not None and (summary["deleted_dirs"], summary["freed_bytes"], summary["bytes"]) == (1, 1000, 2500)


def test_a_run_by_age_keeps_what_was_used_since_and_ages_unrecorded_directories_from_now(fleet: Fleet):
    now = fleet.server.time()
    fleet.write("k/stale", {"a.so": b"a" * 10}, hours_ago=80, used=now - 3 * DAY)
    fleet.write("k/used", {"b.so": b"b" * 10}, hours_ago=80, used=now - HOUR)
    fleet.write("k/never", {"c.so": b"c" * 10}, hours_ago=80)  # no node recorded a use
    report = fleet.run(max_age=2 * DAY)
    assert report.deleted == ["k/stale"] and report.deleted_blobs == 1
    used = fleet.server.space("default").used
    assert abs(used["k/never"] - now) < 60  # adopted: it ages from this run on
    assert fleet.run(max_age=2 * DAY).deleted == []


def test_blobs_nothing_names_go_only_once_older_than_the_grace(fleet: Fleet, tmp_path: Path):
    """An upload whose names are not published yet is safe for the grace; past it, nothing names it."""
    for data, hours in ((b"young" * 10, 0.5), (b"old" * 10, 2.0)):
        fleet.writer.clock.restore(int(-hours * HOUR * 1e6))
        h = hash_bytes(data).hex()
        (tmp_path / h).write_bytes(data)
        fleet.writer.upload_blobs([(h, str(tmp_path / h))])
    fleet.writer.clock.restore(0)
    dry = fleet.run(dry_run=True)
    assert (dry.deleted_blobs, dry.freed_bytes) == (1, 30)
    assert len(fleet.server.space("default").blobs) == 2  # a dry run deletes nothing
    report = fleet.run()
    assert (report.deleted_blobs, report.freed_bytes, report.kept_bytes) == (1, 30, 50)
    assert list(fleet.server.space("default").blobs) == [hash_bytes(b"young" * 10).hex()]


def test_a_use_record_dated_past_the_tiers_time_pins_nothing(fleet: Fleet):
    """A writer whose clock ran a day ahead recorded a use in the future: gc takes it as now and lowers it,
    so the directory ages from now, never kept past its time."""
    now = fleet.server.time()
    fleet.write("k/ahead", {"a.so": b"a"}, hours_ago=50, used=now + DAY)
    fleet.run(max_age=2 * DAY)
    assert abs(fleet.server.space("default").used["k/ahead"] - now) < 60


def test_a_name_written_again_since_the_listing_is_not_deleted(fleet: Fleet):
    """gc deletes a name only if it still holds what gc listed (a writer published meanwhile: it stays)."""
    fleet.write("k/d", {"a.so": b"a"}, used=fleet.server.time())
    listed = fleet.collector.names_of("k/d")
    fleet.write("k/d", {"a.so": b"b"}, used=fleet.server.time())
    assert fleet.collector.remove_names("k/d", listed) == 0
    assert MemoryStore(fleet.server).list_dir("k/d")[b"a.so"].hash == hash_bytes(b"b").hex()


def test_a_tier_that_fails_stops_the_run_with_the_cause(fleet: Fleet):
    fleet.write("k/d", {"a.so": b"a"}, used=fleet.server.time() - 3 * DAY)
    fleet.collector.store.fail_next(1, "connection reset by peer")
    with pytest.raises(RemoteError, match="connection reset by peer"):
        fleet.run(max_age=DAY)
    assert not fleet.collector.store.available()
    fleet.collector.store.ping()  # a user asks again: the back-off is forgotten
    assert fleet.run(max_age=DAY).deleted == ["k/d"]
