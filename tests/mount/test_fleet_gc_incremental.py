"""``fleet gc`` in proportion to what changed: a bucket's run reads only the manifests whose ETag is not in the
last run's state (``gc-state``), and keeps every live name all the same.

Names published, directories used and a directory rewritten between two
runs are all kept; a run with nothing changed reads no manifest (counted by
the store's request counters, as ``--json`` reports them); a state forged
or broken costs requests, never a name or a blob.  Against a real SeaweedFS
(alone, and behind a real redis-server).
"""

from __future__ import annotations

import os
import time

import obstore
import pytest
from conftest import MountFactory, wait_for, wait_uploaded, write_committed
from test_fleet_gc import DAY, Tier, _entries, _node, _settled, tier

from mithrilfs.shared.stores.s3 import gc_state

STATE = Tier.BASE + gc_state.STATE_KEY
#: The tiers of ``test_fleet_gc`` (pytest finds a fixture by its name in the module).
FIXTURES = (tier,)


def _state(tier: Tier) -> dict[str, tuple[str, bytes]]:
    return gc_state.decode(bytes(obstore.get(tier._s3(), STATE).bytes()))


@pytest.mark.parametrize("tier", ["s3"], indirect=True)
def test_incremental_gc_keeps_names_published_used_and_rewritten_between_runs(mount_factory: MountFactory,
                                                                               tier: Tier):
    a = _node(mount_factory, tier, "a")
    files = _entries(a, 6)
    _settled(a, 6)
    first = tier.gc_json()  # nothing to collect: it keeps the manifests it read
    assert first["deleted"] == [] and "triton/k0" in _state(tier)
    tier.plant_use({f"triton/k{i}": time.time() - 10 * DAY for i in range(6)})  # all unused for 10 days
    b = _node(mount_factory, tier, "b")
    assert (b.mountpoint / "triton" / "k1" / "kernel.cubin").read_bytes() == files["triton/k1/kernel.cubin"]
    wait_for(lambda: b.stats()["remote_use_records"] >= 1, what="b's use record of k1")
    files["triton/k2/kernel.json"] = os.urandom(30_000)  # k2 rewritten: its manifest's ETag changes
    write_committed(a.mountpoint / "triton" / "k2" / "kernel.json", files["triton/k2/kernel.json"])
    files["triton/k3/extra"] = os.urandom(30_000)  # a name published into k3
    write_committed(a.mountpoint / "triton" / "k3" / "extra", files["triton/k3/extra"])
    (a.mountpoint / "triton" / "k6").mkdir()  # and a directory new since the last run
    files["triton/k6/kernel.cubin"] = os.urandom(30_000)
    write_committed(a.mountpoint / "triton" / "k6" / "kernel.cubin", files["triton/k6/kernel.cubin"])
    wait_uploaded(a, 60)
    older = time.time() + 3.5
    wait_for(lambda: time.time() > older, what="the replaced blob to be older than the grace")

    second = tier.gc_json("--max-age", "7d")
    assert sorted(second["deleted"]) == ["triton/k0", "triton/k4", "triton/k5"], second
    tier.assert_nothing_dangles()
    c = _node(mount_factory, tier, "c")
    kept = {p: d for p, d in files.items() if p.split("/")[1] in ("k1", "k2", "k3", "k6")}
    assert sorted(os.listdir(c.mountpoint / "triton")) == ["k1", "k2", "k3", "k6"]
    for p, d in kept.items():
        assert (c.mountpoint / p).read_bytes() == d, p
    state = _state(tier)  # the manifests as this run left them, each proven by its ETag
    assert set(state) >= {"triton/k1", "triton/k2", "triton/k3", "triton/k6"}
    assert all(gc_state.proven(etag, data) for etag, data in state.values())


@pytest.mark.parametrize("tier", ["s3", "layered"], indirect=True)
def test_a_second_gc_with_nothing_changed_reads_no_manifest_and_a_forged_state_costs_only_requests(
        mount_factory: MountFactory, tier: Tier):
    a = _node(mount_factory, tier, "a")
    dirs = 30
    files = {}
    for i in range(dirs):
        (a.mountpoint / "triton" / f"k{i}").mkdir(parents=True)
        files[f"triton/k{i}/f"] = os.urandom(1000)
        write_committed(a.mountpoint / "triton" / f"k{i}" / "f", files[f"triton/k{i}/f"])
    _settled(a, dirs)
    older = time.time() + 3.5
    first = tier.gc_json("--max-age", "7d")
    second = tier.gc_json("--max-age", "7d")
    assert first["deleted"] == second["deleted"] == [] and second["names"] == dirs
    # the first read every manifest (30 directories, their parent and the root), the second none
    assert second["requests"] <= first["requests"] - dirs, (first, second)

    # a state whose every manifest is empty, under the real ETags: no manifest proves itself, each is read
    forged = {d: (etag, b'{"entries": {}, "mithrilfs": 1}') for d, (etag, _) in _state(tier).items()}
    obstore.put(tier._s3(), STATE, gc_state.encode(forged))
    wait_for(lambda: time.time() > older, what="the blobs to be older than the grace")
    third = tier.gc_json("--max-age", "7d")
    assert third["deleted"] == [] and third["deleted_blobs"] + third["deleted_packs"] == 0, third
    assert third["requests"] >= second["requests"] + dirs, (second, third)
    obstore.put(tier._s3(), STATE, b"not a state")  # and one that is no state: refused, every manifest read
    fourth = tier.gc_json("--max-age", "7d")
    assert fourth["deleted_blobs"] + fourth["deleted_packs"] == 0 and fourth["rejected"] >= 1, fourth
    assert tier.gc_json("--max-age", "7d")["requests"] <= second["requests"]  # the state written again
    tier.assert_nothing_dangles()
    c = _node(mount_factory, tier, "c")
    for p, d in files.items():
        assert (c.mountpoint / p).read_bytes() == d, p
