"""The bucket store's own, against a real SeaweedFS: settings by the AWS conventions, manifests and their
compare-and-swap, packs, and what each request costs (what every store does is tests/contract's)."""

from __future__ import annotations

from pathlib import Path

import pytest
from conftest import SeaweedFS

from mithrilfs.shared.stores.entries import RemoteEntry, RemoteError
from mithrilfs.shared.stores.records import new_record_id
from mithrilfs.shared.stores.s3.settings import S3Location, settings_from
from mithrilfs.shared.stores.s3.store import S3Store

HASH = "ab" * 32


def test_locations_parse_or_say_what_is_wrong():
    assert S3Location.parse("s3://my-bucket/team/cache/") == S3Location("my-bucket", "team/cache")
    assert S3Location.parse("s3://my-bucket") == S3Location("my-bucket", "")
    for url, needle in (("s3://", "no bucket"), ("s3:///x", "no bucket"), ("s3://UPPER/x", "not a bucket name"),
                        ("s3://key:secret@bkt/x", "credentials"), ("s3://bkt/a/../b", "'..'"),
                        ("http://bkt/x", "use s3://")):
        with pytest.raises(ValueError, match=needle):
            S3Location.parse(url)


def test_settings_follow_the_aws_conventions(tmp_path: Path):
    home = tmp_path / "home"
    (home / ".aws").mkdir(parents=True)
    (home / ".aws" / "credentials").write_text(
        "[default]\naws_access_key_id = FILEKEY\naws_secret_access_key = filesecret\n"
        "[ci]\naws_access_key_id = CIKEY\naws_secret_access_key = cisecret\naws_session_token = citoken\n")
    (home / ".aws" / "config").write_text("[default]\nregion = eu-west-1\n[profile ci]\nregion = ap-south-1\n"
                                          "endpoint_url = http://seaweed:8333\n")
    env = {"HOME": str(home)}
    s = settings_from(env)
    assert (s.access_key_id, s.secret_access_key, s.region, s.endpoint) == ("FILEKEY", "filesecret", "eu-west-1", None)
    s = settings_from(env | {"AWS_PROFILE": "ci"})
    assert (s.access_key_id, s.session_token, s.region, s.endpoint) == ("CIKEY", "citoken", "ap-south-1",
                                                                        "http://seaweed:8333")
    # the environment beats the files, the flag beats the environment
    s = settings_from(env | {"AWS_ACCESS_KEY_ID": "ENVKEY", "AWS_SECRET_ACCESS_KEY": "envsecret",
                             "AWS_REGION": "us-west-2", "AWS_ENDPOINT_URL": "http://env:1"}, "http://flag:2")
    assert (s.access_key_id, s.region, s.endpoint) == ("ENVKEY", "us-west-2", "http://flag:2")
    assert settings_from(env | {"AWS_ENDPOINT_URL_S3": "http://s3only:3", "AWS_ENDPOINT_URL": "http://all:4"}
                         ).endpoint == "http://s3only:3"
    # nothing anywhere: anonymous, in us-east-1
    s = settings_from({"HOME": str(tmp_path / "nobody")})
    assert (s.access_key_id, s.region, s.ambient_credentials) == (None, "us-east-1", False)
    assert settings_from({"HOME": str(tmp_path / "nobody"), "AWS_WEB_IDENTITY_TOKEN_FILE": "/t"}).ambient_credentials
    # the secret never shows in a repr
    assert "filesecret" not in repr(settings_from(env))
    for bad, needle in (({"AWS_ACCESS_KEY_ID": "x"}, "set together"), ({"AWS_PROFILE": "nope"}, "no AWS credentials"),
                        ({"AWS_ENDPOINT_URL": "localhost:8333"}, "invalid endpoint")):
        with pytest.raises(ValueError, match=needle):
            settings_from(env | bad)


@pytest.fixture
def stores(shared_seaweedfs: SeaweedFS, request: pytest.FixtureRequest):
    bucket = "u-" + request.node.name.replace("_", "-")[:40].rstrip("-").lower()
    shared_seaweedfs.create_bucket(bucket)
    from mithrilfs.shared.stores.s3.settings import S3Settings

    settings = S3Settings(endpoint=shared_seaweedfs.endpoint, access_key_id=shared_seaweedfs.access_key,
                          secret_access_key=shared_seaweedfs.secret_key)
    made = [S3Store(S3Location(bucket, "p"), "ns", None, settings) for _ in range(3)]
    yield made
    for s in made:
        s.close()


def test_small_blobs_are_packed_found_from_their_names_and_read_back_verified(stores: list[S3Store],
                                                                             tmp_path: Path):
    """Small blobs go into one pack (one PUT), larger ones their own objects; another node learns where from
    the names, fetches a directory's small blobs with one range GET, and verifies every blob."""
    import io
    import os

    import obstore

    from mithrilfs.store.cas import hash_bytes

    a, b, c = stores
    blobs = {f"f{i}": os.urandom(1000 * (i + 1)) for i in range(6)} | {"big": os.urandom(2 << 20)}
    hashes = {n: hash_bytes(d).hex() for n, d in blobs.items()}
    for n, d in blobs.items():
        (tmp_path / n).write_bytes(d)
    sizes = {hashes[n]: len(d) for n, d in blobs.items()}
    assert sorted(a.missing_blobs(sizes)) == sorted(sizes)
    before = a.level.requests
    assert a.upload_blobs([(hashes[n], str(tmp_path / n)) for n in blobs] + [("cd" * 32, str(tmp_path / "gone"))]
                          ) == {"cd" * 32}
    assert a.level.requests - before == 2  # one pack, one object of its own
    objects = [m["path"][len(a.base):] for batch in obstore.list(a.quick, prefix=a.base) for m in batch]
    assert sum(k.startswith("packs/") for k in objects) == 1 and sum(k.startswith("blobs/") for k in objects) == 1
    assert a.missing_blobs(sizes) == []  # it knows what it packed: no HEAD for those
    a.publish_entries([(f"k/{n}", RemoteEntry("f", 1, "a", hashes[n], len(d))) for n, d in blobs.items()])
    # another node knows nothing until it reads the names, which say where each blob is
    assert not b.placement.knows_where(hashes["f0"])
    names = b.list_dir("k")
    assert all(names[n.encode()].pack is not None for n in blobs if n != "big") and names[b"big"].pack is None
    assert b.placement.knows_where(hashes["f0"]) and b.missing_blobs(sizes) == []
    assert b.missing_blobs({hashes["big"]: (2 << 20) + 1}) == [hashes["big"]]  # the wrong size: written over
    before = b.level.requests
    small = [(hashes[n], len(d)) for n, d in blobs.items() if n != "big"]
    assert b.fetch_small_blobs(small) == [d for n, d in blobs.items() if n != "big"]
    assert b.level.requests - before == 1  # one range GET for the directory's six files
    out = io.BytesIO()
    assert b.fetch_blob(hashes["f3"], 4000, out) == bytes.fromhex(hashes["f3"]) and out.getvalue() == blobs["f3"]
    out = io.BytesIO()
    assert b.fetch_blob(hashes["big"], 2 << 20, out) == bytes.fromhex(hashes["big"]) and out.getvalue() == blobs["big"]
    assert b.fetch_blob(hashes["big"], (2 << 20) - 1, io.BytesIO()) == b""  # not its size: never read
    assert b.fetch_blob("ef" * 32, 10, io.BytesIO()) is None
    assert b.fetch_small_blobs([(hashes["f0"], 1000), ("ef" * 32, 3)]) == [blobs["f0"], None]
    assert c.fetch_small_blobs([(hashes["f0"], 1000)]) == [None]  # not told where: its own object, absent
    assert b.counters["remote_verify_failures"] == 0


def test_a_manifest_too_large_to_read_is_still_replaced_only_if_unchanged(stores: list[S3Store], monkeypatch):
    """Its ETag guards the put: a second writer that read the same junk cannot overwrite the first's entry."""
    import obstore

    from mithrilfs.shared.stores.s3 import store as s3_store

    monkeypatch.setattr(s3_store, "MAX_MANIFEST_BYTES", 1000)
    a, b = stores[0], stores[1]
    obstore.put(a.names, a.base + a._manifest_key("big"), b"x" * 2000)
    raw_b, etag_b = b.read_manifest("big")
    assert raw_b == {} and etag_b  # too large: read as empty, but with its ETag
    a.publish_entries([("big/first", RemoteEntry("f", 10, "a", HASH, 1))])
    raw_b[b"second"] = b.codec.encode("big/second", RemoteEntry("f", 11, "b", HASH, 1))
    assert not b.write_manifest("big", raw_b, etag_b)  # the junk it read is gone: its put must fail
    b.publish_entries([("big/second", RemoteEntry("f", 11, "b", HASH, 1))])  # read, merge, put again
    assert set(a.list_dir("big")) == {b"first", b"second"}


def test_unreadable_names_and_paths_are_dropped_not_fatal(stores: list[S3Store]):
    """JSON allows lone surrogates no name can hold: counted and dropped, the directory and set still work."""
    import json

    import obstore

    a = stores[0]
    good = a.codec.encode("d/ok", RemoteEntry("f", 5, "n", HASH, 1)).decode()
    obstore.put(a.names, a.base + a._manifest_key("d"), json.dumps({"mithrilfs": 1, "entries": {
        "\ud800": good, "ok": good, "num": 5}}).encode())
    assert set(a.list_dir("d")) == {b"ok"}
    a.publish_entries([("d/new", RemoteEntry("f", 6, "n", HASH, 1))])
    assert set(a.list_dir("d")) == {b"ok", b"new"}
    planted = json.dumps({"mithrilfs": 1, "order": [["k/\ud800", good], ["k/fine", good], 7]}).encode()
    obstore.put(a.names, a.base + "startup/~s/" + new_record_id(), planted)
    obstore.put(a.names, a.base + "startup/~s/" + new_record_id(), b"{not a record")
    records = a.startup_records("s")  # the record that is none is refused whole; in the other, what is a path
    assert [[p for p, _ in r.items] for r in records] == [["k/fine"]]
    obstore.put(a.names, a.base + "epoch", b"x" * 5000)  # a planted epoch: replaced by a token
    token, made = a.epoch()
    assert made and token.isalnum() and a.epoch() == (token, False)
    assert a.counters["remote_rejected"] >= 4 and a.level.available()


def test_settings_strip_secret_files_and_refuse_what_no_header_can_carry(tmp_path: Path):
    env = {"HOME": str(tmp_path), "AWS_ACCESS_KEY_ID": "KEY\n", "AWS_SECRET_ACCESS_KEY": " secret\n",
           "AWS_SESSION_TOKEN": "tok\n"}
    s = settings_from(env)
    assert (s.access_key_id, s.secret_access_key, s.session_token) == ("KEY", "secret", "tok")
    with pytest.raises(ValueError, match="AWS_SESSION_TOKEN holds a control character"):
        settings_from(env | {"AWS_SESSION_TOKEN": "a\nb"})
    with pytest.raises(ValueError, match="credentials do not go in its URL"):
        settings_from(env, "http://user:pass@host:8333")


def test_startup_set_records_are_one_object_per_mount_read_with_one_list_and_pruned_by_deletes(
        stores: list[S3Store], monkeypatch):
    """One object per mount, written over at each write; a reader's cost is one LIST and a GET per record
    (the RECORDS_READ newest) and it writes and deletes nothing; a mount's last write deletes the objects
    past RECORDS_KEPT."""
    import obstore

    from mithrilfs.shared.stores import records as sets

    def entry(i: int) -> RemoteEntry:
        return RemoteEntry("f", 10 + i, "n", HASH, i)

    ids = []
    for i in range(6):  # six mounts, oldest first, each writing its record twice
        ids.append(new_record_id())
        stores[i % 3].write_startup_record("warm", ids[-1], [(f"k{i}/a", entry(i))])
        stores[i % 3].write_startup_record("warm", ids[-1], [(f"k{i}/a", entry(i)), (f"k{i}/b", entry(i))])

    def listed() -> list[str]:
        return [m["path"] for batch in obstore.list(stores[0].names, prefix=stores[0].base + "startup/") for m in batch]

    assert len(listed()) == 6  # written over: one object per mount
    before = stores[0].level.requests
    records = stores[0].startup_records("warm")
    assert stores[0].level.requests - before == 1 + sets.RECORDS_READ  # one LIST, the GETs
    assert [r.id for r in records] == ids[::-1][:sets.RECORDS_READ]  # newest first
    assert len(listed()) == 6  # the reader wrote and deleted nothing
    monkeypatch.setattr(sets, "RECORDS_KEPT", 3)
    last = new_record_id()
    stores[1].write_startup_record("warm", last, [("new/x", entry(0))], last=True)  # a mount's unmount
    assert sorted(k.rsplit("/", 1)[1] for k in listed()) == sorted([last, ids[5], ids[4]])


def test_a_directory_with_too_many_names_is_refused_and_never_grown_past_the_limit(stores: list[S3Store],
                                                                                  monkeypatch):
    """A manifest holding more than MAX_DIR_NAMES names is hostile: read as empty (counted), never merged
    (180,000 planted names held a whole mount for 17.8 s); a writer adds no name past the limit, so a
    legitimate directory is never turned into one readers refuse (and the next writer would replace)."""
    import json

    import obstore

    from mithrilfs.shared.stores.s3 import store as s3_store

    monkeypatch.setattr(s3_store, "MAX_DIR_NAMES", 50)
    a, b = stores[0], stores[1]
    entries = {f"n{i}": a.codec.encode(f"huge/n{i}", RemoteEntry("f", 5, "n", HASH, 1)).decode() for i in range(51)}
    obstore.put(a.names, a.base + a._manifest_key("huge"), json.dumps({"mithrilfs": 1, "entries": entries}).encode())
    before = b.counters["remote_rejected"]
    assert b.list_dir("huge") == {}
    assert b.counters["remote_rejected"] == before + 1
    # at the limit: names already there are updated, a new one is refused (counted), nothing is lost
    a.publish_entries([(f"full/n{i}", RemoteEntry("f", 5, "a", HASH, 1)) for i in range(50)])
    results = a.publish_entries([("full/n0", RemoteEntry("f", 6, "a", HASH, 1)),
                                 ("full/extra", RemoteEntry("f", 6, "a", HASH, 1))])
    assert results == [(True, RemoteEntry("f", 5, "a", HASH, 1)), (False, None)]
    listed = b.list_dir("full")
    assert len(listed) == 50 and b"extra" not in listed and listed[b"n0"].version == 6


def test_a_publish_merges_into_the_manifest_as_last_seen_without_reading_it(stores: list[S3Store]):
    """A writer's next batch to a directory is one PUT If-Match (no GET); one that changes nothing sends
    nothing; another writer in between costs a 412 and a read, and nothing is lost."""
    a, b = stores[0], stores[1]

    def cost(store: S3Store, items: list) -> int:
        before = store.level.requests
        store.publish_entries(items)
        return store.level.requests - before

    assert cost(a, [("d/x", RemoteEntry("f", 1, "a", HASH, 1))]) == 1  # never seen: tried as absent
    assert cost(a, [("d/y", RemoteEntry("f", 2, "a", HASH, 1))]) == 1  # If-Match what it wrote
    assert cost(a, [("d/y", RemoteEntry("f", 2, "a", HASH, 1))]) == 0  # nothing new: nothing sent
    assert cost(b, [("d/z", RemoteEntry("f", 3, "b", HASH, 1))]) == 3  # exists: 412, read, put
    assert cost(a, [("d/w", RemoteEntry("f", 4, "a", HASH, 1))]) == 3  # b came in between: 412, read, put
    assert set(stores[2].list_dir("d")) == {b"x", b"y", b"z", b"w"}


def test_a_publish_refuses_a_place_it_adds_in_a_pack_old_enough_for_gc_to_delete() -> None:
    """``Packs.stale``: a place ``locate`` added is refused when its pack was written longer than the trust
    period plus the upload lag ago (or at an unknown time: an entry from before pack times); a fresh one, and
    a place the entry already carried (a live name's, kept by the merge), pass; a pack dated past the bucket's
    time (a writer's clock ahead) is refused too: gc judges the pack by the bucket's time."""
    import time
    from dataclasses import replace

    from mithrilfs.shared.stores import ages
    from mithrilfs.shared.stores.s3.packs import Packs

    now = int(time.time())
    bare = RemoteEntry("f", 1, "a", "ab" * 32, 10)
    before = [("d/old", bare), ("d/unknown", bare), ("d/fresh", bare), ("d/kept", replace(bare, pack="cd" * 16)),
              ("d/own", bare), ("d/ahead", bare)]
    old = now - int(ages.min_grace()) - 5
    located = [("d/old", replace(bare, pack="ef" * 16, packed=old)),
               ("d/unknown", replace(bare, pack="ef" * 16)),
               ("d/fresh", replace(bare, pack="ef" * 16, packed=now)),
               ("d/kept", replace(bare, pack="cd" * 16, packed=old)),
               ("d/own", bare),
               ("d/ahead", replace(bare, pack="ef" * 16, packed=now + 86_400))]
    assert Packs.stale(before, located, now) == ["d/old", "d/unknown", "d/ahead"]


def test_a_small_blob_with_other_bytes_is_reported_for_a_writer_to_mend(stores: list[S3Store]):
    """A blob's own object with other bytes of the right size is never handed out (the contract suite) and
    is reported: a writer asking what the bucket lacks is told to write it again."""
    import os

    import obstore

    from mithrilfs.store.cas import hash_bytes

    a = stores[0]
    good = os.urandom(5000)
    h = hash_bytes(good).hex()
    obstore.put(a.quick, a.base + a.blobs.blob_key(h), os.urandom(5000))  # planted: the right size, other bytes
    assert a.fetch_small_blobs([(h, 5000)]) == [None]
    assert a.counters["remote_verify_failures"] == 1
    assert a.missing_blobs({h: 5000}) == [h]  # reported: a node holding the good bytes writes them over


def test_purge_records_cost_one_list_and_a_get_each_and_a_record_pruned_before_its_get_is_the_floor(
        stores: list[S3Store], monkeypatch):
    """``forget --fleet``'s records (the contract suite checks what every store keeps and reads): in a bucket
    one LIST and a GET per record read, a planted key under ``purges/`` left alone; a record listed and
    pruned before its GET is no hostile record, but its version becomes the floor."""
    import obstore

    from mithrilfs.shared.stores import records as startup_sets

    monkeypatch.setattr(startup_sets, "PURGES_READ", 2)
    monkeypatch.setattr(startup_sets, "PURGES_KEPT", 3)
    assert stores[0].kept_purges() == ([], 0)
    for i, v in enumerate((400, 100, 300, 200)):
        stores[i % 2].keep_purge(v, f"r{v}".encode())
    obstore.put(stores[0].names, stores[0].base + "purges/not-a-purge", b"planted")
    before = stores[2].level.requests
    assert stores[2].kept_purges() == ([b"r400", b"r300"], 200)
    assert stores[2].level.requests - before == 1 + 2
    listed = [m["path"] for batch in obstore.list(stores[0].names, prefix=stores[0].base + "purges/") for m in batch]
    assert len(listed) == 4  # r100 dropped by the last writer; the planted key left alone
    # a record listed and pruned before its GET: not a hostile record (nothing counted), but its paths are
    # unknown, so its version is the floor
    pruned = next(p for p in listed if bytes(obstore.get(stores[0].names, p).bytes()) == b"r300")
    real_get = stores[2].get_object

    def pruned_first(bucket, key, limit):
        if stores[2].base + key == pruned:
            obstore.delete(bucket, pruned)
        return real_get(bucket, key, limit)

    monkeypatch.setattr(stores[2], "get_object", pruned_first)
    assert stores[2].kept_purges() == ([b"r400"], 300)


def test_kept_places_come_back_and_anything_else_is_left_out():
    """What an unmount keeps (``known_places``) the next mount takes back; what is not a place (a hand-edited
    or damaged index) is left out, one by one, and a place this mount learned already stays."""
    store = S3Store(S3Location("bkt", "x"), "default", None, settings_from({}))
    store.packs.learn([RemoteEntry("f", 1, "n", HASH, 10, 0o644, 0, pack="0" * 32, offset=5, packed=7)])
    kept = store.placement.known_places()
    assert kept == [[HASH, "0" * 32, 5, 7]]
    later = S3Store(S3Location("bkt", "x"), "default", None, settings_from({}))
    other, mine = "cd" * 32, "ef" * 32
    later.packs.learn([RemoteEntry("f", 1, "n", mine, 10, 0o644, 0, pack="2" * 32, offset=1, packed=9)])
    junk = [["zz" * 32, "0" * 32, 1, 1], [other, "0" * 31, 1, 1], [other, "1" * 32, -1, 1],
            [other, "1" * 32, True, 1], [other, "1" * 32, 1], "text", None, [mine, "3" * 32, 4, 4]]
    assert later.placement.learn_places(kept + junk) == 1
    assert later.packs.location(HASH) == ("0" * 32, 5, 7)
    assert later.packs.location(other) is None and later.packs.location(mine) == ("2" * 32, 1, 9)


def test_a_pack_is_read_by_its_upload_parts(stores: list[S3Store], tmp_path: Path):
    """A pack is put in parts of ``PART_BYTES``; the prefetch cuts its batches where a blob begins in another
    part (``container_of``) and a range GET holds the blobs that begin within a part of its start, so a
    pack of 12 blobs of 900 KiB (10.5 MiB) is two GETs, one per part, every blob verified."""
    import os

    from mithrilfs.shared.stores.s3.conn import PART_BYTES
    from mithrilfs.store.cas import hash_bytes

    a, b, _ = stores
    blobs = [os.urandom(900 << 10) for _ in range(12)]
    hashes = [hash_bytes(d).hex() for d in blobs]
    for h, d in zip(hashes, blobs):
        (tmp_path / h).write_bytes(d)
    assert a.upload_blobs([(h, str(tmp_path / h)) for h in hashes]) == set()
    a.publish_entries([(f"k/f{i}", RemoteEntry("f", 1, "a", h, len(d))) for i, (h, d) in enumerate(zip(hashes, blobs))])
    b.list_dir("k")  # where each blob is
    places = [b.packs.location(h) for h in hashes]
    assert len({p[0] for p in places}) == 1  # one pack
    parts = [b.placement.container_of(h) for h in hashes]
    assert parts == [f"{places[0][0]}/{p[1] // PART_BYTES}" for p in places] and len(set(parts)) == 2
    before = b.level.requests
    assert b.fetch_small_blobs([(h, len(d)) for h, d in zip(hashes, blobs)]) == blobs
    assert b.level.requests - before == 2  # a GET a part, the blob that begins at a part's end with it


def test_a_bucket_asking_to_slow_down_is_waited_for_within_the_bound_then_backed_off(
        shared_seaweedfs: SeaweedFS, caplog: pytest.LogCaptureFixture):
    """503 SlowDown past 10 requests a second under a prefix (S3's way): every request gets through, sent
    again after pauses (the client's own two quick retries are not enough: its second is refused too), the
    level has no error and says so in one log line.  503 to every request: a call gives up after
    ``slowed_wait`` of it (``SLOWED_WAIT``, lowered here to 3 s), a failure of the level, which backs off."""
    import logging
    import time

    from mithrilfs.shared.stores.s3.settings import S3Settings
    from mithrilfs.testing.delay_proxy import DelayProxy

    shared_seaweedfs.create_bucket("u-slowdown")
    entry = RemoteEntry("d", 1_700_000_000_000_000, "node-a", mode=0o755)
    for how in ({"slowdown_rate": 10}, {"slowdown_every": 1}):
        with DelayProxy("127.0.0.1", shared_seaweedfs.ports["s3"], protocol="http", **how) as proxy, \
                caplog.at_level(logging.WARNING):
            caplog.clear()
            settings = S3Settings(endpoint=f"http://127.0.0.1:{proxy.port}", access_key_id=shared_seaweedfs.access_key,
                                  secret_access_key=shared_seaweedfs.secret_key)
            store = S3Store(S3Location("u-slowdown", "p"), "ns", None, settings)
            try:
                if "slowdown_rate" in how:
                    for i in range(15):
                        assert store.publish_entries([(f"d{i}", entry)])[0][0]
                        assert store.list_dir("")[f"d{i}".encode()] == entry
                    assert store.level.errors == 0 and store.level.slowdowns > 0, proxy.counts()
                    assert len([r for r in caplog.records if "fewer requests" in r.message]) == 1
                    continue
                store.slowed_wait = 3.0
                t = time.monotonic()
                with pytest.raises(RemoteError, match="slow down for 3 s"):
                    store.list_dir("")
                assert 3.0 <= time.monotonic() - t < 3.0 + 3
                assert not store.level.available() and store.level.errors == 1
                assert proxy.counts()["slowdowns"] == proxy.counts()["requests"]
            finally:
                store.close()
