"""Small blobs travel through a bucket in packs (``shared/s3_packs``): cheap to publish, cheap to read.

A real SeaweedFS, real mounts; requests are counted by the project's delay
proxy (``mithrilfs.testing.delay_proxy``, no delay added) in front of the bucket,
by method and by area of the layout (names, packs, blobs, sets, epoch).
"""

from __future__ import annotations

import errno
import json
import os
import secrets
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import obstore
import pytest
from conftest import Mount, MountFactory, RedisServer, SeaweedFS, run_cli, wait_for, wait_uploaded
from test_shared_s3 import BASE, _s3, errno_of_read, get, keys, manifest, pack_key, put, stored_blob

from mithrilfs.shared.warm.order import LOOK_AHEAD_BATCH
from mithrilfs.testing.delay_proxy import DelayProxy

AREAS = ("blobs", "packs", "names", "sets", "epoch", "bad")


def area(method: str, target: str) -> str:
    """The proxy's label: the method and the area of the layout ("GET packs"), else the query's first key."""
    path, _, query = target.partition("?")
    found = next((s for s in path.split("/") if s in AREAS), None)
    return f"{method} {found or '?' + query.split('=')[0].split('&')[0]}"


@pytest.fixture
def proxy(shared_seaweedfs: SeaweedFS) -> Iterator[Any]:
    """The delay proxy (no delay) in front of the module's SeaweedFS, counting requests by area."""
    with DelayProxy("127.0.0.1", shared_seaweedfs.ports["s3"], protocol="http", label=area) as p:
        yield p


@pytest.fixture
def bucket(shared_seaweedfs: SeaweedFS, request: pytest.FixtureRequest) -> str:
    name = "p-" + request.node.name.replace("_", "-")[:40].rstrip("-").lower()
    shared_seaweedfs.create_bucket(name)
    return name


def write_kernel(cache: Path, key: str, files: dict[str, bytes]) -> None:
    """As Triton's ``FileCacheManager.put``: each file written in a temporary directory of its own inside
    the kernel's directory, renamed into place, the temporary directory removed."""
    d = cache / key
    d.mkdir(parents=True, exist_ok=True)
    for name, data in files.items():
        tmp_dir = d / f"tmp.pid_{os.getpid()}_{secrets.token_hex(4)}"
        tmp_dir.mkdir()
        (tmp_dir / name).write_bytes(data)
        os.replace(tmp_dir / name, d / name)
        tmp_dir.rmdir()


def workload(kernels: int, seed: int = 0) -> dict[str, dict[str, bytes]]:
    """Triton-like kernel directories: six small files each, 1-30 KB."""
    import random

    rnd = random.Random(seed)
    return {format(rnd.getrandbits(128), "032x"): {
        f"kernel.{s}": rnd.randbytes(rnd.randrange(1000, 30_000)) for s in ("cubin", "ptx", "ttir", "ttgir", "llir")}
        | {"kernel.json": json.dumps({"i": i}).encode()} for i in range(kernels)}


def count(proxy: Any, label: str) -> int:
    return proxy.labels().get(label, 0)


def read_lazily_once_the_set_is_there(m: Mount, kernels: dict[str, dict[str, bytes]]) -> None:
    """Read every kernel's files (each as written); after the first kernel, wait for the startup set its
    read loads in the background, so the rest are read through it and not through their manifests (beside
    two busy loops, reads raced on through eight more kernels' manifests before it was there)."""
    for i, (key, kfiles) in enumerate(kernels.items()):
        for name, data in kfiles.items():
            assert (m.mountpoint / "triton" / key / name).read_bytes() == data, (key, name)
        if i == 0:
            wait_for(lambda: "startup_set_paths" in m.stats(), 20, "the startup set")


@pytest.mark.timeout(240)
def test_a_new_node_loads_a_packed_workload_with_a_bounded_number_of_requests(
        mount_factory: MountFactory, shared_seaweedfs: SeaweedFS, bucket: str, proxy: Any):
    """Node A publishes 40 kernels in Triton's layout (a temporary directory per file) at <= 2 requests a
    file (measured before packs: 4.85 a file, a HEAD and a PUT per blob and a manifest GET per create); the
    bucket holds packs, not one object per blob; a new node reads every kernel lazily, byte for byte, at
    one manifest GET per kernel and one range GET per pack its files are in (design.md, "Packs")."""
    env = shared_seaweedfs.env(AWS_ENDPOINT_URL=f"http://127.0.0.1:{proxy.port}")
    kernels = workload(40)
    files = sum(len(f) for f in kernels.values())
    a = mount_factory("a", *_s3(bucket), env=env)
    wait_for(lambda: a.stats()["remote_levels"][0]["requests"] > 0, 10, "the first epoch check")
    proxy.reset()
    for key, kfiles in kernels.items():
        write_kernel(a.mountpoint / "triton", key, kfiles)
    wait_uploaded(a, 60)
    published = proxy.counts()["requests"]
    assert published <= 2 * files, (published, proxy.labels())
    # what the writes cost beyond the publish itself: no HEAD, no loose blob, no manifest GET per create
    assert count(proxy, "HEAD blobs") == 0 and count(proxy, "PUT blobs") == 0, proxy.labels()
    assert count(proxy, "GET names") <= 3 * len(kernels), proxy.labels()
    stored = keys(shared_seaweedfs, bucket)
    assert not [k for k in stored if "/blobs/" in k]
    print("publish", published, proxy.labels())
    assert 1 <= len([k for k in stored if "/packs/" in k]) <= files // 2
    # a kernel's files are in as many packs as the upload batches they went in (one when written together)
    ranges = sum(len({e["pk"] for e in manifest(shared_seaweedfs, bucket, f"triton/{key}").values()})
                 for key in kernels)
    assert ranges < files // 2
    # a new node, lazily: every byte equals A's; per kernel one manifest GET and a range GET per pack
    b = mount_factory("b", *_s3(bucket), env=env)
    proxy.reset()
    for key, kfiles in kernels.items():
        for name, data in kfiles.items():
            assert (b.mountpoint / "triton" / key / name).read_bytes() == data, (key, name)
    labels = proxy.labels()
    assert count(proxy, "GET names") <= len(kernels) + 2, labels  # + the root and triton/, once
    assert count(proxy, "GET packs") <= ranges, labels
    assert count(proxy, "GET blobs") == 0, labels
    s = b.stats()
    assert s["remote_verify_failures"] == 0 and s["remote_fetched_bytes"] == sum(
        len(d) for f in kernels.values() for d in f.values())


def test_a_name_materialized_before_a_remount_is_read_after_it(mount_factory: MountFactory,
                                                               shared_seaweedfs: SeaweedFS, bucket: str):
    """B lists a kernel's directory (its names come, not their content), unmounts, mounts again and reads:
    where each blob is was in the names it read in the first mount, so it reads the directory again."""
    env = shared_seaweedfs.env()
    kernels = workload(2, seed=1)
    a = mount_factory("a", *_s3(bucket), env=env)
    for key, kfiles in kernels.items():
        write_kernel(a.mountpoint, key, kfiles)
    wait_uploaded(a)
    b = mount_factory("b", *_s3(bucket), env=env)
    for key, kfiles in kernels.items():
        assert sorted(os.listdir(b.mountpoint / key)) == sorted(kfiles)
    assert b.stats()["physical_bytes"] == 0
    b.remount()
    for key, kfiles in kernels.items():
        for name, data in kfiles.items():
            assert (b.mountpoint / key / name).read_bytes() == data, (key, name)


def test_a_temporary_name_removed_while_its_batch_is_on_the_wire_leaves_nothing_in_the_bucket(
        mount_factory: MountFactory, shared_seaweedfs: SeaweedFS, bucket: str, proxy: Any):
    """Triton writes a file in a temporary directory, renames it into place and removes the directory; on a
    loaded machine the uploader may send the file under its temporary name first.  Renamed and removed while
    that batch is on the wire (its pack's PUT held by the proxy), the names are not published yet, but must
    still get their tombstones: a CI run found the temporary directory listed on a new node."""
    a = mount_factory("a", *_s3(bucket), env=shared_seaweedfs.env(AWS_ENDPOINT_URL=f"http://127.0.0.1:{proxy.port}"))
    wait_for(lambda: a.stats()["remote_levels"][0]["requests"] > 0, 10, "the first epoch check")
    kernel = a.mountpoint / "kern"
    kernel.mkdir()
    tmp_dir = kernel / "tmp.pid_1_0123abcd"
    tmp_dir.mkdir()
    proxy.hold(lambda label: label == "PUT packs")
    try:
        (tmp_dir / "kernel.cubin").write_bytes(b"cubin bytes")
        wait_for(lambda: count(proxy, "PUT packs") == 1, 30, "the batch with the temporary name on the wire")
        os.replace(tmp_dir / "kernel.cubin", kernel / "kernel.cubin")
        tmp_dir.rmdir()
    finally:
        proxy.release()
    wait_uploaded(a)
    b = mount_factory("b", *_s3(bucket), env=shared_seaweedfs.env())
    assert os.listdir(b.mountpoint / "kern") == ["kernel.cubin"]
    assert (b.mountpoint / "kern" / "kernel.cubin").read_bytes() == b"cubin bytes"
    assert not [p for p, e in manifest(shared_seaweedfs, bucket, "kern").items() if "tmp" in p and e["t"] != "x"]


@pytest.mark.timeout(120)
def test_a_node_killed_between_a_pack_and_its_names_loses_nothing(mount_factory: MountFactory,
                                                                  shared_seaweedfs: SeaweedFS, bucket: str):
    """Killed after its first pack went and before the names that locate it: the successor sends the queue
    again; every location in the bucket gives the right bytes, and a new node reads everything."""
    env = shared_seaweedfs.env()
    kernels = workload(6, seed=2)
    a = mount_factory("a", *_s3(bucket), env=env | {"MITHRILFS_TEST_CRASH_AT": "pack_uploaded"})
    for key, kfiles in kernels.items():
        write_kernel(a.mountpoint, key, kfiles)
    wait_for(lambda: a.stats()["restarts"] == 1, 60, "the daemon killed at its first pack to be replaced")
    a.pid = a.stats()["pid"]
    wait_uploaded(a, 60)
    for key, kfiles in kernels.items():
        for name, data in kfiles.items():
            assert stored_blob(shared_seaweedfs, bucket, f"{key}/{name}") == data, (key, name)
    b = mount_factory("b", *_s3(bucket), env=env)
    for key, kfiles in kernels.items():
        for name, data in kfiles.items():
            assert (b.mountpoint / key / name).read_bytes() == data, (key, name)


def test_two_nodes_publishing_the_same_blobs_at_once_both_end_readable(mount_factory: MountFactory,
                                                                        shared_seaweedfs: SeaweedFS, bucket: str):
    """Neither knows the other packed the same bytes: both pack them (a duplicate, never a loss), the
    names converge on one version each, and a third node reads every file."""
    env = shared_seaweedfs.env()
    kernels = workload(8, seed=3)
    a = mount_factory("a", *_s3(bucket), env=env)
    b = mount_factory("b", *_s3(bucket), env=env)
    writers = [threading.Thread(target=lambda m=m: [write_kernel(m.mountpoint, k, f) for k, f in kernels.items()])
               for m in (a, b)]
    for t in writers:
        t.start()
    for t in writers:
        t.join()
    # either node may have nothing to send (the other's newer entry for the same bytes is there first:
    # none of its own counts as written), so wait for both queues, not for each node's own uploads
    wait_for(lambda: a.stats()["upload_queue"] == 0 and b.stats()["upload_queue"] == 0, 60, "both uploads")
    wait_for(lambda: all(stored_blob(shared_seaweedfs, bucket, f"{key}/{name}") == data
                         for key, kfiles in kernels.items() for name, data in kfiles.items()), 30,
             "every name in the bucket, its bytes where its entry says")
    assert a.stats()["remote_uploaded_entries"] + b.stats()["remote_uploaded_entries"] > 0
    c = mount_factory("c", *_s3(bucket), env=env)
    for key, kfiles in kernels.items():
        for name, data in kfiles.items():
            assert (c.mountpoint / key / name).read_bytes() == data, (key, name)


def test_a_location_that_lies_is_never_served(mount_factory: MountFactory, shared_seaweedfs: SeaweedFS,
                                              bucket: str):
    """An entry planted with another blob's place (unsigned mode: anyone with write access), or a place past
    the pack's end: the bytes there do not hash to the entry's name, so the read is EIO, never them."""
    from test_shared_s3 import file_entry, set_entry

    weed, env = shared_seaweedfs, shared_seaweedfs.env()
    a = mount_factory("a", *_s3(bucket), env=env)
    write_kernel(a.mountpoint, "k", {"real.so": os.urandom(5000), "other.so": os.urandom(5000)})
    wait_uploaded(a)
    real = manifest(weed, bucket, "k")["real.so"]
    wanted = os.urandom(5000)
    set_entry(weed, bucket, "k", "redirected.so", file_entry(wanted, pk=real["pk"], po=real["po"]))
    set_entry(weed, bucket, "k", "past-the-end.so", file_entry(wanted, pk=real["pk"], po=(32 << 20)))
    set_entry(weed, bucket, "k", "no-such-pack.so", file_entry(wanted, pk="0" * 32, po=0))
    b = mount_factory("b", *_s3(bucket), env=env)
    for name in ("redirected.so", "past-the-end.so", "no-such-pack.so"):
        assert errno_of_read(b.mountpoint / "k" / name) == errno.EIO, name
    assert (b.mountpoint / "k" / "real.so").read_bytes() == stored_blob(weed, bucket, "k/real.so")
    assert b.stats()["remote_levels"][0]["reachable"]  # bad data, not a failure of the bucket


def test_redis_in_front_passes_the_locations_through(mount_factory: MountFactory, shared_seaweedfs: SeaweedFS,
                                                     bucket: str, redis_server: RedisServer):
    """Names written to Redis, by the writer or copied from the bucket's manifest, keep where the bucket
    holds each blob: a node that lists from Redis alone and finds a blob only in the bucket reads it."""
    env = shared_seaweedfs.env()
    both = ("--remote", redis_server.url, *_s3(bucket))
    a = mount_factory("a", *both, env=env)
    kfiles = {f"f{i}.so": os.urandom(3000) for i in range(5)}
    write_kernel(a.mountpoint, "k", kfiles)
    wait_uploaded(a)

    def redis_entries() -> dict[str, dict]:
        out = redis_server.cli("HGETALL", "mfs:default:d:k").stdout.split("\n")
        pairs = dict(zip(out[0::2], out[1::2]))
        return {n: json.loads(v) for n, v in pairs.items() if n in kfiles}

    assert all("pk" in e for e in redis_entries().values()), redis_entries()
    # Redis restarted empty: the names come back into it from the bucket, with their places
    redis_server.stop()
    redis_server.start()
    c = mount_factory("c", *both, env=env)
    assert sorted(os.listdir(c.mountpoint / "k")) == sorted(kfiles)
    wait_for(lambda: set(redis_entries()) == set(kfiles), 10, "Redis to hold the names again")
    assert all("pk" in e for e in redis_entries().values()), redis_entries()
    # D lists from Redis alone (complete), Redis holds no blob: each comes from its pack
    d = mount_factory("d", *both, env=env)
    for name, data in kfiles.items():
        assert (d.mountpoint / "k" / name).read_bytes() == data, name
    assert d.stats()["remote_levels"][1]["bytes_in"] >= sum(len(v) for v in kfiles.values())


def test_a_corrupted_pack_is_never_served_and_is_repaired(mount_factory: MountFactory,
                                                          shared_seaweedfs: SeaweedFS, bucket: str):
    """A pack's bytes flipped in the bucket: every file whose range is hit reads EIO (none served), each is
    reported; the push of the node holding them writes each as its own object; a new node reads all (its
    pack's range still bad, its own object good) without reporting again."""
    weed, env = shared_seaweedfs, shared_seaweedfs.env()
    a = mount_factory("a", *_s3(bucket), env=env)
    kfiles = {f"f{i}.so": os.urandom(4000) for i in range(4)}
    write_kernel(a.mountpoint, "k", kfiles)
    wait_uploaded(a)
    entries = manifest(weed, bucket, "k")
    # one pack, unless a loaded machine split the kernel's files over two upload batches: every one of them
    for pack_id in {e["pk"] for e in entries.values()}:
        pack = get(weed, bucket, pack_key(pack_id))
        assert pack is not None
        put(weed, bucket, pack_key(pack_id), bytes(b ^ 0xFF for b in pack))  # every byte wrong, the size kept
    b = mount_factory("b", *_s3(bucket), env=env)
    for name in kfiles:
        assert errno_of_read(b.mountpoint / "k" / name) == errno.EIO, name
    assert b.stats()["physical_bytes"] == 0
    wait_for(lambda: len(keys(weed, bucket, BASE + "bad/")) == len(kfiles), 10, "every bad blob reported")
    res = run_cli("push", str(a.mountpoint))
    assert res.returncode == 0, res.stderr
    wait_for(lambda: keys(weed, bucket, BASE + "bad/") == [], 30, "the push to repair every reported blob")
    c = mount_factory("c", *_s3(bucket), env=env)
    for name, data in kfiles.items():
        assert (c.mountpoint / "k" / name).read_bytes() == data, name
    assert keys(weed, bucket, BASE + "bad/") == [] and c.stats()["remote_bad_blobs_reported"] == 0


def test_a_lazy_node_reads_a_remounted_writers_startup_set_without_a_manifest_per_kernel(
        mount_factory: MountFactory, shared_seaweedfs: SeaweedFS, bucket: str, proxy: Any):
    """A writer remounted and loaded its kernels (reading nothing from the bucket, so knowing no pack
    places); its startup record still carries them (read from the manifests once, when it writes the
    record), so a lazy new node fetches every kernel after the first from the packs, a batch of kernels
    ahead of its reads, and reads no manifest (measured before, at 20 ms on 1,500 kernels: a manifest GET
    per kernel, 1,502, and 40 s where node A took 6)."""
    env = shared_seaweedfs.env(AWS_ENDPOINT_URL=f"http://127.0.0.1:{proxy.port}")
    kernels = workload(20)
    a = mount_factory("a", *_s3(bucket), env=env)
    for key, kfiles in kernels.items():
        write_kernel(a.mountpoint / "triton", key, kfiles)
    wait_uploaded(a, 60)
    a.remount()
    for key, kfiles in kernels.items():
        for name, data in kfiles.items():
            assert (a.mountpoint / "triton" / key / name).read_bytes() == data
    a.umount()
    b = mount_factory("b", *_s3(bucket, "--no-prefetch"), env=env)
    proxy.reset()
    read_lazily_once_the_set_is_there(b, kernels)
    assert count(proxy, "GET names") <= 3, proxy.labels()  # the root, triton/ and the first kernel's
    # the first kernel's file and its read-ahead (the set not loaded yet), the second's read-ahead (the read
    # that finds the set loaded), then a range GET per pack for each look-ahead batch of the rest of the
    # kernels (design.md, "Look-ahead")
    packs = len([k for k in keys(shared_seaweedfs, bucket) if "/packs/" in k])
    batches = -(-(len(kernels) - 2) // LOOK_AHEAD_BATCH)
    assert count(proxy, "GET packs") <= 3 + batches * packs, (packs, proxy.labels())
    assert b.stats()["remote_look_ahead"] >= 3 * len(kernels)  # most files came ahead of their reads
    # their files were created by the store's writing process (``blob_writer``), not by a thread of the
    # daemon waiting for the event loop's lock after each system call; it ends with the mount
    writers = children_running(b.pid or 0, "blob_writer_child")
    assert len(writers) == 1, writers
    b.umount()
    assert not [pid for pid in writers if Path(f"/proc/{pid}").exists()]


def test_a_remounted_writer_keeps_where_its_blobs_are(mount_factory: MountFactory, shared_seaweedfs: SeaweedFS,
                                                     bucket: str, proxy: Any):
    """A writer remounted and loading its kernels learned no pack place from the bucket (it read nothing
    there); its startup record must carry them, and it read each directory's manifest for them at its
    unmount (1,500 GETs in the benchmark's first node A arm).  The places its first mount knew are kept
    in its index, so its second mount reads no manifest; a record from another bucket generation (the
    bucket emptied) never takes them."""
    env = shared_seaweedfs.env(AWS_ENDPOINT_URL=f"http://127.0.0.1:{proxy.port}")
    kernels = workload(20, seed=5)
    a = mount_factory("a", *_s3(bucket), env=env)
    for key, kfiles in kernels.items():
        write_kernel(a.mountpoint / "triton", key, kfiles)
    wait_uploaded(a, 60)
    a.umount()
    proxy.reset()
    a.mount()
    wait_for(lambda: "places of blobs kept by the last mount" in (a.store / "mithrilfs.log").read_text(), 20,
             "the kept places to be taken")
    for key, kfiles in kernels.items():
        for name, data in kfiles.items():
            assert (a.mountpoint / "triton" / key / name).read_bytes() == data
    a.umount()
    assert count(proxy, "GET names") == 0, proxy.labels()
    # a mount that never reached the bucket learned nothing: what the last one kept stays kept
    proxy.hold()
    try:
        a.mount()
        a.umount()
    finally:
        proxy.release()
    proxy.reset()
    a.mount()
    wait_for(lambda: (a.store / "mithrilfs.log").read_text().count("places of blobs kept by the last mount") == 2,
             20, "the kept places to be taken again")
    for key, kfiles in kernels.items():
        for name, data in kfiles.items():
            assert (a.mountpoint / "triton" / key / name).read_bytes() == data
    a.umount()
    assert count(proxy, "GET names") == 0, proxy.labels()
    b = mount_factory("b", *_s3(bucket, "--no-prefetch"), env=env)
    proxy.reset()
    read_lazily_once_the_set_is_there(b, kernels)
    assert count(proxy, "GET names") <= 3, proxy.labels()  # the root, triton/ and the first kernel's
    b.umount()
    # the bucket emptied while the writer was away: what it kept points into packs that are gone, and is
    # not taken (the writer counts a blob in a young pack as uploaded)
    client = shared_seaweedfs.client(bucket)
    for key in keys(shared_seaweedfs, bucket, "cache/"):
        obstore.delete(client, key)
    a.mount()
    wait_for(lambda: a.stats()["remote_data_lost"] >= 1, 30, "the writer to notice the emptied bucket")
    wait_uploaded(a, 60)
    assert (a.store / "mithrilfs.log").read_text().count("places of blobs kept by the last mount") == 2
    c = mount_factory("c", *_s3(bucket, "--no-prefetch"), env=env)
    for key, kfiles in kernels.items():
        for name, data in kfiles.items():
            assert (c.mountpoint / "triton" / key / name).read_bytes() == data, (key, name)


def children_running(pid: int, script: str) -> list[int]:
    """The child processes of *pid* whose command line names *script*."""
    out = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            try:
                if script in Path(f"/proc/{child}/cmdline").read_bytes().decode(errors="replace"):
                    out.append(int(child))
            except FileNotFoundError:
                continue
    return out


def test_a_writer_still_writing_fills_its_packs(mount_factory: MountFactory, shared_seaweedfs: SeaweedFS,
                                               bucket: str):
    """A compile writes kernel after kernel: its names wait (at most ``PACK_WINDOW``, 2 s, or 8 MiB) while
    it writes, so its packs are one per two seconds of writing, not one per upload batch (every 0.3 s: a
    new node reads one range GET per pack); and once it stops, what it wrote is sent at once."""
    import time

    kernels = workload(60, seed=3)
    a = mount_factory("a", *_s3(bucket), env=shared_seaweedfs.env())
    start = time.monotonic()
    for key, kfiles in kernels.items():
        write_kernel(a.mountpoint / "triton", key, kfiles)
    writing = time.monotonic() - start
    wait_uploaded(a, 60)
    packs = [k for k in keys(shared_seaweedfs, bucket) if "/packs/" in k]
    assert 1 <= len(packs) <= writing / 2.0 + 2, (len(packs), writing)
    b = mount_factory("b", *_s3(bucket), env=shared_seaweedfs.env())
    for key, kfiles in kernels.items():
        for name, data in kfiles.items():
            assert (b.mountpoint / "triton" / key / name).read_bytes() == data


@pytest.mark.timeout(240)
def test_a_prefetch_named_a_batch_at_a_time_reads_each_pack_once(mount_factory: MountFactory,
                                                                 shared_seaweedfs: SeaweedFS, bucket: str, proxy: Any):
    """A set of more names than one naming batch (``startup_order.MATERIALIZE_BATCH``): the prefetch fetches
    from the first batch on (``prefetch.Todo``), and a batch of blobs left open at the end of a batch of
    names waits for the next, so a pack is still one range GET, never one per batch of names; every byte
    is node A's."""
    from mithrilfs.shared.warm.order import MATERIALIZE_BATCH

    env = shared_seaweedfs.env(AWS_ENDPOINT_URL=f"http://127.0.0.1:{proxy.port}")
    kernels = workload(100, seed=5)
    files = {f"triton/{key}/{name}": data for key, kfiles in kernels.items() for name, data in kfiles.items()}
    assert len(files) + len(kernels) > MATERIALIZE_BATCH
    a = mount_factory("a", *_s3(bucket), env=env)
    for key, kfiles in kernels.items():
        write_kernel(a.mountpoint / "triton", key, kfiles)
    wait_uploaded(a, 60)
    a.remount()
    for p in files:  # the load a startup set records
        (a.mountpoint / p).read_bytes()
    a.umount()
    packs = {e["pk"] for key in kernels for e in manifest(shared_seaweedfs, bucket, f"triton/{key}").values()}
    proxy.reset()
    b = mount_factory("b", *_s3(bucket, "--prefetch"), env=env)
    s = b.stats()
    assert s["prefetch"]["state"] == "done" and s["prefetch"]["files"] == len(files), s["prefetch"]
    assert count(proxy, "GET packs") <= len(packs), (len(packs), proxy.labels())
    assert count(proxy, "GET blobs") == 0 and count(proxy, "GET names") <= 2, proxy.labels()
    fetched = s["remote_fetched_bytes"]
    assert fetched == sum(len(d) for d in files.values())
    for p, data in files.items():
        assert (b.mountpoint / p).read_bytes() == data, p
    assert b.stats()["remote_fetched_bytes"] == fetched  # every file was here before its read
