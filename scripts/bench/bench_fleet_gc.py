"""``fleet gc`` of a real SeaweedFS bucket and of a real Redis holding many cache entries: time, requests,
bytes freed.

Fills a fresh tier through the store API the nodes use (blobs uploaded,
entries published, use records sent): ``--names`` cache entries
``triton/HH/kI``, two small files each (all different), half of them last
used 30 days ago, by upload batch of 1,000 entries (what one node compiled
together ages together; in a bucket a batch's blobs are one pack, and gc
deletes a pack only when none of its blobs is named: entries aged one in
two, every pack would stay half live and gc free no byte, compaction not
being built); then one ``fleet gc --max-age 7d`` (in this process, as
the CLI runs it) and a second run, in a fresh store as the next scheduled
one would be, that finds nothing to do; then one entry in a hundred is
published anew (used today) and a third run finds it.  Prints one JSON document.
"requests" are round trips (a Redis pipeline or script counts one).

    python scripts/bench/bench_fleet_gc.py --names 10000 [--store redis|s3|both] [--file-bytes 2048]

The grace is 0 here (every blob was just written; the nodes' grace protects
uploads in flight, and none are).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from _benchlib import redis_server, seaweedfs_s3

from mithrilfs.shared.fleet import gc
from mithrilfs.shared.stores.base import RemoteStore
from mithrilfs.shared.stores.connect import RemoteSpec, collector_for, open_remote
from mithrilfs.shared.stores.entries import RemoteEntry, RemoteError
from mithrilfs.shared.stores.s3 import gc_state
from mithrilfs.shared.stores.s3.conn import obstore_api
from mithrilfs.shared.stores.s3.settings import from_environment
from mithrilfs.shared.stores.s3.store import S3Store
from mithrilfs.store.cas import hash_bytes

BATCH = 1000


def fill(store: RemoteStore, names: int, file_bytes: int, tmp: Path, first: int = 0) -> dict[str, float]:
    """*names* entries of two files each (numbered from *first*; those of the first fill aged by batch, later ones
    used now); returns the seconds it took."""
    started = time.monotonic()
    now = time.time()
    for start in range(first, first + names, BATCH):
        files, items, used = [], [], {}
        for i in range(start, min(first + names, start + BATCH)):
            d = f"triton/{i % 256:02x}/k{i}"
            for f in ("kernel.cubin", "kernel.json"):
                data = os.urandom(file_bytes)
                h = hash_bytes(data).hex()
                path = tmp / h
                path.write_bytes(data)
                files.append((h, str(path)))
                items.append((f"{d}/{f}", RemoteEntry("f", int(now * 1e6), "bench", h, file_bytes, 0o644, 0)))
            used[d] = now - 30 * 86400 if (i // BATCH) % 2 == 0 and not first else now
        store.upload_blobs(files)
        dirs = {p.rpartition("/")[0] for p, _ in items}
        for d in sorted(dirs | {d.rpartition("/")[0] for d in dirs} | {"triton"}):
            items.append((d, RemoteEntry("d", int(now * 1e6), "bench", mode=0o755)))
        store.publish_entries(sorted(items, key=lambda it: (it[1].type == "d", -it[0].count("/"))))
        store.record_use(used)
        for _, p in files:
            os.unlink(p)
    return {"fill_seconds": round(time.monotonic() - started, 1)}


def ready(store: RemoteStore, tmp: Path) -> None:
    """Until the store takes a write (SeaweedFS's gateway answers before its volume server is up)."""
    probe = tmp / "probe"
    probe.write_bytes(b"probe")
    deadline = time.monotonic() + 60
    while True:
        try:
            for lv in store.levels():
                lv.retry_now()
            store.upload_blobs([(hash_bytes(b"probe").hex(), str(probe))])
            return
        except RemoteError:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.5)


def one(kind: str, spec: RemoteSpec, names: int, file_bytes: int) -> dict:
    store = open_remote(spec)
    with tempfile.TemporaryDirectory() as tmp:
        ready(store, Path(tmp))
    with tempfile.TemporaryDirectory() as tmp:
        out: dict = {"store": kind, "names": names, "files": 2 * names, "file_bytes": file_bytes}
        out.update(fill(store, names, file_bytes, Path(tmp)))
    first = gc.run(collector_for(store), max_size=None, max_age=7 * 86400, grace=0.0, dry_run=False)
    store.close()
    store = open_remote(spec)  # a run of its own, as the next CronJob's (nothing cached from the first)
    second = gc.run(collector_for(store), max_size=None, max_age=7 * 86400, grace=0.0, dry_run=False)
    with tempfile.TemporaryDirectory() as tmp:  # one entry in a hundred published since (used: today)
        fill(store, names // 100, file_bytes, Path(tmp), first=names + BATCH)
    store.close()
    store = open_remote(spec)
    third = gc.run(collector_for(store), max_size=None, max_age=7 * 86400, grace=0.0, dry_run=False)
    if isinstance(store, S3Store):  # what a bucket's run keeps for the next (``gc_state``)
        out["state_bytes"] = obstore_api().head(store.names, store.base + gc_state.STATE_KEY)["size"]
    store.close()
    for label, r in (("gc", first), ("gc_again", second), ("gc_after_1pct_published", third)):
        out[label] = {"seconds": r.seconds, "requests": r.requests, "deleted_dirs": r.deleted_dirs,
                      "deleted_names": r.deleted_names, "deleted_blobs": r.deleted_blobs,
                      "deleted_packs": r.deleted_packs, "freed_bytes": r.freed_bytes, "names_left": r.names,
                      "blobs_left": r.blobs, "packs_left": r.packs}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--names", type=int, default=2000, help="cache entries (two files each; default 2000)")
    ap.add_argument("--file-bytes", type=int, default=2048)
    ap.add_argument("--store", choices=("redis", "s3", "both"), default="both")
    args = ap.parse_args()
    results = []
    if args.store in ("redis", "both"):
        with redis_server() as url:
            results.append(one("redis", RemoteSpec(url), args.names, args.file_bytes))
    if args.store in ("s3", "both"):
        with seaweedfs_s3() as env:
            os.environ.update(env)
            results.append(one("s3", RemoteSpec("s3://bench/cache", s3=from_environment(None)), args.names,
                               args.file_bytes))
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
