"""Why did it recompile? (issue 18): identical output under a new cache entry, counted, logged, explained.

Triton's own FileCacheManager writes the entries (a key directory each, every
file through a temporary directory and a rename); ``mithrilfs why`` reads
the events back and names the metadata field that changed the key.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

from conftest import Mount, MountFactory, RedisServer, run_cli, wait_for, wait_uploaded, write_committed
from test_shared_tier import _remote

CUBIN = bytes(range(256)) * 16  # 4 KiB: the same binary under both keys

PUT_KERNEL = r"""
import json, sys
from triton.runtime.cache import FileCacheManager
key, debug = sys.argv[1], sys.argv[2] == "1"
cubin = bytes(range(256)) * 16
mgr = FileCacheManager(key)
group = {"kernel.cubin": mgr.put(cubin, "kernel.cubin")}
meta = {"name": "add_kernel", "num_warps": 4, "debug": debug, "hash": key, "target": {"backend": "cuda", "arch": 90}}
group["kernel.json"] = mgr.put(json.dumps(meta), "kernel.json", binary=False)
mgr.put_group("kernel.json", group)
"""


def put_kernel(m: Mount, key: str, *, debug: bool) -> None:
    env = dict(os.environ, TRITON_CACHE_DIR=str(m.mountpoint / "triton"))
    subprocess.run([sys.executable, "-c", PUT_KERNEL, key, "1" if debug else "0"], env=env, check=True, timeout=120)


def why(m: Mount, *args: str) -> dict:
    res = run_cli("why", str(m.mountpoint), *args, "--json")
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def counters(m: Mount) -> dict:
    time.sleep(0.01)  # past the control file's freshness (FRESH_SECONDS): a new production
    return m.stats()["all_mounts"]


def test_two_triton_keys_with_the_same_binary_are_reported_with_the_field_that_differs(mount_factory: MountFactory):
    m = mount_factory()
    put_kernel(m, "a" * 64, debug=False)
    put_kernel(m, "b" * 64, debug=True)  # a flag hashed into the key that does not change the binary
    wait_for(lambda: counters(m)["identical_recompiles"] == 1, 10, "the recompile to be counted")
    assert counters(m)["identical_recompile_bytes"] == len(CUBIN)
    assert m.stats()["by_dir"]["triton"]["identical_recompiles"] == 1
    report = why(m)
    [entry] = report["entries"]
    assert entry["entry"] == "triton/" + "b" * 64 and entry["same_as"] == ["triton/" + "a" * 64]
    assert entry["bytes"] == len(CUBIN) and entry["paths"] == ["triton/" + "b" * 64 + "/kernel.cubin"]
    assert entry["lost_seconds"] is not None and entry["lost_seconds"] >= 0  # from the key's miss to the commit
    fields = {d["field"]: (d["this"], d["other"]) for d in entry["differs"]["triton/" + "a" * 64]}
    assert fields == {"debug": (True, False)}
    text = run_cli("why", str(m.mountpoint)).stdout
    assert "same bytes as triton/" + "a" * 64 in text and "debug = true here, false there" in text
    # one sentence a reader can parse: the fleet count is of recompiles, not "0 of bytes"
    assert text.startswith("1 identical recompile here (4.0 KiB); 0 recompiles of bytes another node had already"
                           " made\n"), text
    table = run_cli("stats", str(m.mountpoint)).stdout
    assert "1 identical recompile here (4.0 KiB); 0 recompiles of bytes another node had already made: mithrilfs"\
        " why MOUNT" in table, table
    # the events say the same without the mount (no metadata then)
    m.umount()
    res = run_cli("why", "--store", str(m.store), "--json")
    assert res.returncode == 0, res.stderr
    assert [e["entry"] for e in json.loads(res.stdout)["entries"]] == ["triton/" + "b" * 64]


def test_links_renames_tiny_and_lock_files_are_not_recompiles(mount_factory: MountFactory):
    m = mount_factory()
    data = os.urandom(4096)
    for d in ("x", "y", "z", "w"):
        (m.mountpoint / d).mkdir()
    write_committed(m.mountpoint / "x" / "k.so", data)
    os.link(m.mountpoint / "x" / "k.so", m.mountpoint / "y" / "k.so")  # one inode, two names
    os.rename(m.mountpoint / "x" / "k.so", m.mountpoint / "z" / "k.so")  # the same inode moved
    tiny = b"{}" * 100
    write_committed(m.mountpoint / "x" / "meta.json", tiny)
    write_committed(m.mountpoint / "y" / "meta.json", tiny)  # identical by nature: under 1 KiB
    write_committed(m.mountpoint / "x" / "k.lock", data)
    (m.mountpoint / "w" / "locks").mkdir()
    write_committed(m.mountpoint / "w" / "locks" / "k", data)
    write_committed(m.mountpoint / "z" / "copy.so", data)  # the same entry as z/k.so: not a new key
    assert counters(m)["identical_recompiles"] == 0
    # a real copy into another entry is one (the control: the counter works)
    write_committed(m.mountpoint / "w" / "k.so", data)
    assert counters(m)["identical_recompiles"] == 1
    [entry] = why(m)["entries"]
    assert entry["entry"] == "w" and entry["same_as"][0] in ("y", "z")
    # the counters survive a remount like the others
    m.remount()
    assert counters(m)["identical_recompiles"] == 1
    assert counters(m)["identical_recompile_bytes"] == len(data)
    # and a PATH narrows the report to entries under it
    assert why(m, "x")["entries"] == []
    assert len(why(m, str(m.mountpoint / "w"))["entries"]) == 1


def test_a_second_node_reports_the_first_nodes_entry(mount_factory: MountFactory, redis_server: RedisServer):
    a = mount_factory("a", *_remote(redis_server))
    put_kernel(a, "a" * 64, debug=False)
    wait_uploaded(a)
    b = mount_factory("b", *_remote(redis_server))
    put_kernel(b, "c" * 64, debug=True)
    wait_for(lambda: counters(b)["fleet_identical_recompiles"] == 1, 20, "the fleet recompile to be counted")
    assert counters(b)["identical_recompiles"] == 0 and counters(a)["fleet_identical_recompiles"] == 0
    [entry] = why(b)["entries"]
    assert entry["entry"] == "triton/" + "c" * 64 and entry["fleet"]
    assert entry["same_as"] == ["triton/" + "a" * 64]  # the first node's entry, kept by the tier
    # b sees a's entry through the tier, so the metadata can be compared too
    assert {d["field"] for d in entry["differs"]["triton/" + "a" * 64]} == {"debug"}


def test_a_file_written_under_a_temporary_name_is_reported_under_its_final_one(mount_factory: MountFactory):
    """Triton writes ``k.bin.tmp`` (Inductor ``.<pid>.tmp``) beside the final name and renames it: the
    event, and why's report, name ``k.bin``, whether the commit came at an fsync or at the rename."""
    m = mount_factory()
    data = os.urandom(4096)
    for d in ("a", "b", "c"):
        (m.mountpoint / d).mkdir()
    write_committed(m.mountpoint / "a" / "k.bin", data)
    write_committed(m.mountpoint / "b" / "k.bin.tmp", data)  # committed at its fsync, still temporary
    os.rename(m.mountpoint / "b" / "k.bin.tmp", m.mountpoint / "b" / "k.bin")
    (m.mountpoint / "c" / ".123.tmp").write_bytes(data)  # committed at the rename
    os.rename(m.mountpoint / "c" / ".123.tmp", m.mountpoint / "c" / "k.bin")
    wait_for(lambda: counters(m)["identical_recompiles"] == 2, 10, "both recompiles to be counted")
    paths = sorted(p for e in why(m)["entries"] for p in e["paths"])
    assert paths == ["b/k.bin", "c/k.bin"]
    assert ".tmp" not in run_cli("why", str(m.mountpoint)).stdout


def test_huge_and_unbounded_numbers_in_events_are_skipped(mount_factory: MountFactory):
    """Issue 19: a 400-digit number in an event was an OverflowError traceback."""
    m = mount_factory()
    m.umount()
    good = {"ts": 1, "event": "identical_recompile", "path": "e/k.so", "entry": "e", "bytes": 4096}
    huge = "9" * 400
    bad = [dict(good, entry=f"bad{i}", path=f"bad{i}/k", **{field: 1}) for i, field in
           enumerate(("ts", "bytes", "lost_seconds", "lost_seconds"))]
    lines = [json.dumps(good)] + [json.dumps(e).replace(f'"{f}": 1', f'"{f}": {v}')
                                  for e, f, v in zip(bad, ("ts", "bytes", "lost_seconds", "lost_seconds"),
                                                     (huge, huge, huge, "NaN"), strict=True)]
    lines.append(json.dumps(dict(good, entry="bad9", path="bad9/k", bytes=-5)))
    with open(m.store / "events.jsonl", "a") as f:
        f.write("\n".join(lines) + "\n")
    res = run_cli("why", "--store", str(m.store), timeout=30)
    assert res.returncode == 0 and res.stderr == "", res.stderr
    assert "  e: 1 file, 4.0 KiB" in res.stdout and "bad" not in res.stdout, res.stdout
    res = run_cli("why", "--store", str(m.store), "--json", timeout=30)
    assert res.returncode == 0 and res.stderr == "", res.stderr
    assert [e["entry"] for e in json.loads(res.stdout)["entries"]] == ["e"]


def test_a_fifo_planted_as_an_entrys_metadata_neither_hangs_nor_is_opened(mount_factory: MountFactory):
    """Issue 19: a FIFO named like a kernel's ``.json`` hung ``why`` forever (anyone who may write to the
    cache can plant one); a metadata file larger than a kernel's is skipped too."""
    m = mount_factory()
    data = os.urandom(4096)
    for d in ("a", "b"):
        (m.mountpoint / d).mkdir()
        write_committed(m.mountpoint / d / "k.cubin", data)
    write_committed(m.mountpoint / "a" / "k.json", json.dumps({"name": "k", "debug": False}).encode())
    write_committed(m.mountpoint / "b" / "k.json", json.dumps({"name": "k", "debug": True}).encode())
    os.mkfifo(m.mountpoint / "b" / "planted.json")
    os.mkfifo(m.mountpoint / "a" / "planted.json")
    wait_for(lambda: counters(m)["identical_recompiles"] == 1, 10, "the recompile to be counted")
    res = run_cli("why", str(m.mountpoint), "--json", timeout=30)
    assert res.returncode == 0, res.stderr
    [entry] = json.loads(res.stdout)["entries"]
    assert entry["differs"] == {"a": [{"file": "k.json", "field": "debug", "this": True, "other": False}]}


def test_why_needs_a_mount_or_a_store(tmp_path):
    res = run_cli("why")
    assert res.returncode == 2 and "MOUNTPOINT or --store" in res.stderr and len(res.stderr.strip().splitlines()) == 1
    res = run_cli("why", "--store", str(tmp_path / "nothing"))
    assert res.returncode != 0 and len(res.stderr.strip().splitlines()) == 1 and "Traceback" not in res.stderr
