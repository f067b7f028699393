"""The tier's clock as a node keeps it (``stores/clock``), and what is refused for being dated past it."""

from __future__ import annotations

import json
import time
from collections import Counter

import pytest

from mithrilfs.shared.stores.ages import younger
from mithrilfs.shared.stores.clock import FUTURE_SLACK_US, STEP_US, TierClock
from mithrilfs.shared.stores.entries import EntryCodec, RemoteEntry
from mithrilfs.shared.sync.changes import ChangeCodec

DAY_US = 86_400 * 10**6


def _tier_ahead_by(seconds: float) -> TierClock:
    """A clock whose tier runs *seconds* ahead of this machine (a node a day behind sees its tier so)."""
    return TierClock(lambda: time.time() + seconds)


def test_versions_are_the_tiers_time_and_a_materialized_name_gives_its_version_back() -> None:
    clock = _tier_ahead_by(-86_400)  # this node's clock runs a day ahead of the tier
    assert clock.measure()
    assert abs(clock.offset_us + DAY_US) < 100_000
    assert abs(clock.now_us() - (time.time_ns() // 1000 - DAY_US)) < 100_000
    local_ctime = time.time_ns()
    assert abs(clock.version_of(local_ctime) - (local_ctime // 1000 - DAY_US)) < 100_000
    for version in (1, 1_700_000_000_123_456, clock.now_us()):
        assert clock.version_of(clock.local_ns(version)) == version


def test_the_offset_moves_only_for_a_step_larger_than_a_measurements_error() -> None:
    tier_ahead = [0.0]
    clock = TierClock(lambda: time.time() + tier_ahead[0])
    clock.measure()
    first = clock.offset_us
    tier_ahead[0] = STEP_US / 2e6  # within the error: versions computed from ctimes stay as they were
    assert not clock.measure() and clock.offset_us == first
    tier_ahead[0] = 3600.0  # the node's clock was stepped an hour back
    assert clock.measure() and abs(clock.offset_us - 3600 * 10**6) < 100_000


def test_a_restored_offset_is_used_until_measured_and_nothing_is_bounded_before_any() -> None:
    clock = _tier_ahead_by(0)
    assert clock.horizon_us() == 1 << 63 and clock.due()  # a node behind must not refuse honest entries yet
    clock.restore(-5 * 10**6)
    assert clock.known and clock.offset_us == -5 * 10**6 and clock.due()
    clock.measure()
    assert not clock.due() and abs(clock.horizon_us() - clock.now_us() - FUTURE_SLACK_US) < 100_000


def test_entries_and_changes_dated_past_the_tiers_time_are_refused_and_counted() -> None:
    clock = _tier_ahead_by(0)
    clock.measure()
    counters: Counter = Counter()
    codec = EntryCodec("default", None, counters, horizon=clock.horizon_us)
    now = clock.now_us()
    fine = codec.encode("d/k.py", RemoteEntry("f", now + FUTURE_SLACK_US // 2, "a", "ab" * 32, 1))
    ahead = codec.encode("d/k.py", RemoteEntry("f", now + DAY_US, "a", "ab" * 32, 1))
    assert codec.decode("d/k.py", fine) is not None
    assert codec.decode("d/k.py", ahead) is None and counters["remote_rejected"] == 1

    changes = ChangeCodec("default", None, horizon=clock.horizon_us)
    assert changes.decode(changes.encode("a", [("d", now, True)]))[1] == [("d", now, True)]
    with pytest.raises(ValueError, match="past the tier's time"):
        changes.decode(json.dumps({"mithrilfs_change": 1, "n": "a", "x": [["d", now + DAY_US, 1]]}).encode())


def test_a_time_dated_past_the_tiers_is_no_age_a_writer_trusts() -> None:
    assert younger(10.0, 60.0) and not younger(61.0, 60.0)
    assert younger(-FUTURE_SLACK_US / 2e6, 60.0)  # a clock's error ahead: young
    assert not younger(-86_400.0, 60.0)  # a day ahead: gc judges it by the tier's time, never trusted
