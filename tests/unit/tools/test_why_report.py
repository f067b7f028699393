"""``mithrilfs why``'s report on its own: events read back, grouped, and hostile input kept harmless.

A plain directory stands in for the mount (``why`` only reads files through
it) and a store directory holds a hand-written event log.
"""

from __future__ import annotations

import json
from pathlib import Path

from mithrilfs.tools import why


def _events(store: Path, *events: dict) -> None:
    store.mkdir(parents=True, exist_ok=True)
    (store / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events))


def _entry(mount: Path, entry: str, meta: dict) -> None:
    (mount / entry).mkdir(parents=True)
    (mount / entry / "k.json").write_text(json.dumps(meta))


def test_groups_newest_first_and_names_the_differing_field(tmp_path: Path) -> None:
    mount, store = tmp_path / "mnt", tmp_path / "store"
    _entry(mount, "triton/a", {"name": "k", "debug": False, "hash": "a"})
    _entry(mount, "triton/b", {"name": "k", "debug": True, "hash": "b"})
    _events(store,
            {"ts": 1, "event": "identical_recompile", "path": "x/1", "entry": "x", "other_entry": "y", "bytes": 5},
            {"ts": 2, "event": "identical_recompile", "path": "triton/b/k.cubin", "entry": "triton/b",
             "other_entry": "triton/a", "bytes": 4096, "lost_seconds": 3.5},
            {"ts": 3, "event": "summary"})
    groups = why.report(store, mount, None)
    assert [g["entry"] for g in groups] == ["triton/b", "x"]
    assert groups[0]["differs"]["triton/a"] == [{"file": "k.json", "field": "debug", "this": True, "other": False}]
    assert groups[0]["lost_seconds"] == 3.5
    assert [g["entry"] for g in why.report(store, mount, "triton")] == ["triton/b"]
    assert "debug = true here, false there" in why.format_report(groups, None)


def test_hostile_events_and_links_outside_the_mount_are_harmless(tmp_path: Path) -> None:
    mount, store, secret = tmp_path / "mnt", tmp_path / "store", tmp_path / "secret"
    _entry(mount, "triton/b", {"name": "k", "token": "mine"})
    secret.mkdir()
    (secret / "k.json").write_text(json.dumps({"name": "k", "token": "SECRET"}))
    (mount / "evil").symlink_to(secret)  # planted through the shared tier: a link out of the mount
    _events(store,
            {"ts": 2, "event": "fleet_identical_recompile", "path": "triton/b/k.cubin", "entry": "triton/b",
             "other_entry": "evil", "bytes": 4096},
            {"ts": 3, "event": "identical_recompile", "path": "q/\x1b[2Jx", "entry": "q", "other_entry": "../..",
             "bytes": 2048},
            {"ts": 4, "event": "identical_recompile", "path": "z", "entry": "z", "bytes": None},  # malformed
            {"ts": 5, "event": "identical_recompile", "path": 7})  # malformed
    (store / "events.jsonl").open("a").write("{not json\n" + "[" * 5000 + "]" * 5000 + "\n")
    groups = why.report(store, mount, None)
    assert [g["entry"] for g in groups] == ["q", "triton/b"]
    assert groups[1]["differs"] == {}  # the link leads out of the mount: nothing read there
    assert groups[0]["differs"] == {}
    text = why.format_report(groups, None)
    assert "SECRET" not in text and "\x1b" not in text
