"""What ccache and sccache users look for (issue 12): counters that outlive a mount and can be zeroed,
clear, settings kept in the store, what takes the space, df, gc in words, --json, fsck naming files."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from conftest import CLI, MountFactory, blob_files, run_cli, still_writing, wait_for, write_committed

KiB = 1024


def stats(m) -> dict:
    return json.loads(run_cli("stats", "--json", str(m.mountpoint), check=True).stdout)


def test_counters_survive_a_remount_and_stats_zero_starts_them_over(mount_factory: MountFactory):
    m = mount_factory()
    write_committed(m.mountpoint / "a.so", b"a" * 1000)
    for _ in range(3):
        assert (m.mountpoint / "a.so").read_bytes() == b"a" * 1000
    first = stats(m)
    assert first["commits"] == 1 and first["all_mounts"]["commits"] == 1
    m.remount()
    second = stats(m)
    assert second["commits"] == 0  # this mount's
    assert second["all_mounts"]["commits"] == 1 and second["all_mounts"]["read_bytes"] == first["read_bytes"]
    assert second["all_mounts"]["since"] == first["all_mounts"]["since"]
    write_committed(m.mountpoint / "b.so", b"b" * 10)
    assert stats(m)["all_mounts"]["commits"] == 2
    res = run_cli("stats", "--zero", str(m.mountpoint), check=True)
    assert "zeroed" in res.stdout
    zeroed = stats(m)
    assert zeroed["commits"] == 0 and zeroed["all_mounts"]["commits"] == 0 and zeroed["all_mounts"]["hits"] == 0
    assert zeroed["all_mounts"]["since"] > first["all_mounts"]["since"]
    assert zeroed["files"] == 2  # zeroing counts forgets no file
    m.remount()
    assert stats(m)["all_mounts"]["commits"] == 0
    assert "all mounts" in run_cli("stats", str(m.mountpoint), check=True).stdout


def test_clear_evicts_everything_not_being_written(mount_factory: MountFactory):
    m = mount_factory()  # default min-age 5 s: gc would keep these young files, clear does not
    (m.mountpoint / "inductor").mkdir()
    for i in range(20):
        write_committed(m.mountpoint / "inductor" / f"k{i}.so", os.urandom(50 * KiB))
    writer = open(m.mountpoint / "being-written.so", "wb")
    try:
        writer.write(b"w" * 10_000)
        writer.flush()
        with still_writing(writer.fileno(), b"w"):
            res = run_cli("clear", "--json", str(m.mountpoint), check=True)
        answer = json.loads(res.stdout)
        assert answer["files"] == 20 and answer["bytes"] >= 20 * 50 * KiB
        assert not list((m.mountpoint / "inductor").iterdir())
        assert (m.mountpoint / "being-written.so").exists()  # in use: kept
        writer.write(b"w" * 10_000)
        writer.flush()
        os.fsync(writer.fileno())  # committed: no longer being written
    finally:
        writer.close()
    assert (m.mountpoint / "being-written.so").read_bytes() == b"w" * 20_000
    res = run_cli("clear", str(m.mountpoint), check=True)
    assert res.stdout.startswith("evicted 1 file,"), res.stdout
    assert stats(m)["files"] == 0
    m.umount()
    assert blob_files(m.store) == []
    assert run_cli("fsck", "--store", str(m.store)).returncode == 0


def test_settings_kept_in_the_store_are_used_by_later_mounts(mount_factory: MountFactory, tmp_path):
    store = tmp_path / "s"
    res = run_cli("config", str(store), "--max-size", "20M", "--min-age", "1s", check=True)
    assert "20.0 MiB" in res.stdout and "(stored)" in res.stdout
    m = mount_factory(store=store)
    assert stats(m)["max_bytes"] == 20 << 20
    m.remount()  # a remount without --max-size keeps the store's budget
    assert stats(m)["max_bytes"] == 20 << 20
    m.umount()
    m.extra = ("--max-size", "30M")  # the command line wins over the store
    m.mount()
    assert stats(m)["max_bytes"] == 30 << 20
    res = run_cli("config", str(store), "--max-size", "40M", check=True)  # kept for later, this mount keeps 30M
    assert "--max-size kept" in res.stdout
    assert stats(m)["max_bytes"] == 30 << 20
    m.extra = ()
    m.remount()
    assert stats(m)["max_bytes"] == 40 << 20
    # a mounted store applies a new budget at once: a smaller one evicts
    for i in range(30):
        write_committed(m.mountpoint / f"f{i}", os.urandom(100 * KiB))
    wait_for(lambda: stats(m)["physical_bytes"] >= 30 * 100 * KiB, 10, "the files to be counted")
    res = run_cli("config", str(store), "--max-size", "1M", check=True)
    assert "applied to the mount" in res.stdout
    assert stats(m)["max_bytes"] == 1 << 20
    wait_for(lambda: stats(m)["physical_bytes"] <= 1 << 20, 30, "eviction down to the new budget")
    doc = json.loads(run_cli("config", str(store), "--json", check=True).stdout)
    assert doc["settings"]["max_size"] == 1 << 20 and doc["settings"]["min_age"] == 1.0
    assert sorted(doc["stored"]) == ["max_size", "min_age"]
    # settings that do not fit together change nothing
    res = run_cli("config", str(store), "--low-watermark", "99%")
    assert res.returncode == 2 and "watermark" in res.stderr and "Traceback" not in res.stderr
    assert json.loads(run_cli("config", str(store), "--json", check=True).stdout)["settings"]["low_watermark"] == 0.85
    m.umount()
    # a damaged settings file is named, and --reset mends it
    (store / "config.json").write_text('{"max_size": "big"}')
    res = run_cli("mount", str(m.mountpoint), "--store", str(store))
    assert res.returncode == 2 and "config.json" in res.stderr and len(res.stderr.splitlines()) == 1
    run_cli("config", str(store), "--reset", check=True)
    m.mount()
    assert stats(m)["max_bytes"] == 10 << 30


def test_stats_shows_what_takes_the_space(mount_factory: MountFactory):
    m = mount_factory()
    sizes = {"inductor/ab/big.so": 300 * KiB, "inductor/ab/mid.py": 100 * KiB, "triton/k1/k.cubin": 200 * KiB,
             "triton/k1/copy.cubin": 200 * KiB, "top.txt": 5}
    same = os.urandom(200 * KiB)
    for path, size in sizes.items():
        (m.mountpoint / path).parent.mkdir(parents=True, exist_ok=True)
        write_committed(m.mountpoint / path, same if "cubin" in path else os.urandom(size))
    doc = json.loads(run_cli("stats", "--json", "--top", "2", str(m.mountpoint), check=True).stdout)
    by_top = {row["name"]: row for row in doc["usage"]["by_top"]}
    assert by_top["inductor"]["files"] == 2 and by_top["inductor"]["bytes"] == 400 * KiB
    assert by_top["triton"]["files"] == 2 and by_top["triton"]["bytes"] == 400 * KiB
    assert by_top["triton"]["stored_bytes"] == 200 * KiB  # two names, one blob
    assert by_top["top.txt"]["files"] == 1
    assert doc["usage"]["largest"][0] == {"path": "inductor/ab/big.so", "bytes": 300 * KiB}
    assert len(doc["usage"]["largest"]) == 2 and doc["usage"]["largest"][1]["bytes"] == 200 * KiB
    text = run_cli("stats", "--top", "1", str(m.mountpoint), check=True).stdout
    assert "inductor/ab/big.so" in text and "triton" in text and "largest 1 files" in text


def test_df_shows_the_budget_as_size_and_the_cache_as_used(mount_factory: MountFactory):
    m = mount_factory("df", "--max-size", "64M")
    for i in range(8):
        write_committed(m.mountpoint / f"f{i}", os.urandom(1 << 20))
    st = os.statvfs(m.mountpoint)
    assert st.f_blocks * st.f_frsize == 64 << 20
    used = (st.f_blocks - st.f_bfree) * st.f_frsize
    assert abs(used - stats(m)["physical_bytes"]) <= st.f_frsize
    assert st.f_bavail * st.f_frsize <= (64 - 8) << 20
    out = subprocess.run(["df", "-B1", str(m.mountpoint)], capture_output=True, text=True, check=True).stdout
    assert str(64 << 20) in out.splitlines()[1].split()


def test_gc_draws_progress_and_sums_up_in_words(mount_factory: MountFactory):
    m = mount_factory("gc", "--min-age", "0")
    for i in range(40):
        write_committed(m.mountpoint / f"f{i}", os.urandom(50 * KiB))
    # on a terminal (script gives it one) a progress bar is drawn on stderr
    res = subprocess.run(["script", "-qec", f"{' '.join(CLI)} gc --to 1M {m.mountpoint}", "/dev/null"],
                         capture_output=True, text=True, timeout=120)
    assert res.returncode == 0, res.stdout
    assert "evicting [" in res.stdout and "##" in res.stdout, res.stdout
    assert "evicted 20 files, 1000.0 KiB; the cache now holds" in res.stdout, res.stdout
    answer = json.loads(run_cli("gc", "--json", "--to", "0", str(m.mountpoint), check=True).stdout)
    assert answer["files"] == 20 and answer["bytes"] == 20 * 50 * KiB
    # content the kernel still held when its name went is freed when the kernel forgets it
    wait_for(lambda: stats(m)["physical_bytes"] == 0, 10, "the last blobs to be freed")


def test_json_from_status_fsck_import_and_export(mount_factory: MountFactory, tmp_path):
    m = mount_factory()
    write_committed(m.mountpoint / "a.so", b"a" * 100)
    doc = json.loads(run_cli("status", "--json", str(m.mountpoint), check=True).stdout)
    assert doc["state"] == "live" and doc["pid"] == m.pid and doc["files"] == 1 and doc["read_only"] is False
    doc = json.loads(run_cli("export", "--json", str(m.mountpoint), str(tmp_path / "x.tar"), check=True).stdout)
    assert doc["entries"] == 1 and doc["blobs"] == 1
    m.umount()
    res = run_cli("status", "--json", str(m.mountpoint))
    assert res.returncode == 1 and json.loads(res.stdout)["state"] == "unmounted"
    doc = json.loads(run_cli("fsck", "--json", "--store", str(m.store), check=True).stdout)
    assert doc["problems"] == {} and doc["blobs_checked"] == 1 and doc["exit_status"] == 0
    doc = json.loads(run_cli("import", "--json", str(tmp_path / "x.tar"), "--store", str(tmp_path / "s2"),
                             check=True).stdout)
    assert doc["added"] == 1 and doc["blobs"] == 1 and doc["exit_status"] == 0


def test_fsck_names_the_files_whose_blobs_were_corrupt(mount_factory: MountFactory):
    m = mount_factory()
    (m.mountpoint / "inductor" / "ab").mkdir(parents=True)
    write_committed(m.mountpoint / "inductor" / "ab" / "bad.so", b"B" * 5000)
    write_committed(m.mountpoint / "inductor" / "ab" / "good.so", b"G" * 5000)
    os.link(m.mountpoint / "inductor" / "ab" / "bad.so", m.mountpoint / "alias.so")
    m.umount()
    from mithrilfs.store.cas import hash_bytes

    blob = next(p for p in blob_files(m.store) if p.name == hash_bytes(b"B" * 5000).hex())
    os.chmod(blob, 0o600)
    blob.write_bytes(b"X" * 5000)
    res = run_cli("fsck", "--store", str(m.store))
    assert res.returncode == 4
    assert "  corrupt: inductor/ab/bad.so" in res.stdout and "  corrupt: alias.so" in res.stdout
    assert "good.so" not in res.stdout
    doc = json.loads(run_cli("fsck", "--json", "--store", str(m.store)).stdout)
    assert doc["corrupt_files"] == ["alias.so", "inductor/ab/bad.so"] and doc["problems"]["corrupt blobs"] == 1
    res = run_cli("fsck", "--repair", "--store", str(m.store))
    assert res.returncode == 1 and "corrupt: inductor/ab/bad.so (removed" in res.stdout


def test_names_with_control_characters_are_printed_escaped(mount_factory: MountFactory):
    """Issue 19: ``stats --top`` printed a planted name's escape sequences raw (terminal injection); stats,
    its table and fsck escape them as ``why`` does (one helper: ``mithrilfs.terminal.shown``)."""
    m = mount_factory()
    top, name = "t\x1b]0;pwned\x07", "\x1b[31mevil\x9b.so"
    (m.mountpoint / top).mkdir()
    write_committed(m.mountpoint / top / name, b"E" * 50_000)
    write_committed(m.mountpoint / "small.so", b"s" * 100)
    shown_top, shown_name = "t\\x1b]0;pwned\\x07", "\\x1b[31mevil\\x9b.so"
    for args in (["stats", "--top", "3"], ["stats"]):
        out = run_cli(*args, str(m.mountpoint), check=True).stdout
        assert all(c.isprintable() for c in out.replace("\n", "")), repr(out)
        assert shown_top[:15] in out
        if "--top" in args:
            assert f"{shown_top}/{shown_name}" in out, out
    m.umount()
    from mithrilfs.store.cas import hash_bytes

    blob = next(p for p in blob_files(m.store) if p.name == hash_bytes(b"E" * 50_000).hex())
    os.chmod(blob, 0o600)
    blob.write_bytes(b"X" * 50_000)
    res = run_cli("fsck", "--store", str(m.store))
    assert res.returncode == 4 and f"  corrupt: {shown_top}/{shown_name}" in res.stdout, res.stdout
    assert all(c.isprintable() for c in res.stdout.replace("\n", "")), repr(res.stdout)


#: Reads stats.json (argv[1]) in a loop until argv[2] exists; prints how many reads did not parse.
STATS_READER = """
import json, os, sys
torn = reads = 0
while not os.path.exists(sys.argv[2]):
    with open(sys.argv[1]) as f:
        text = f.read()
    reads += 1
    try:
        json.loads(text)
    except ValueError:
        torn += 1
print(torn, reads)
"""


def test_stats_json_read_by_many_while_it_grows_is_never_torn(mount_factory: MountFactory, tmp_path):
    """Readers of a control file each see one whole document.  The kernel opens these files itself and
    asks for the size again at the end of every read: when another reader's look made a longer document
    in between, the first reader got the tail of the second after its own end (the quiet suite's
    JSONDecodeError "Extra data ... (char 8192)" in a fleet gc test)."""
    m = mount_factory()
    stop = tmp_path / "stop"
    readers = [subprocess.Popen([sys.executable, "-c", STATS_READER, str(m.mountpoint / ".mithrilfs" / "stats.json"),
                                 str(stop)], stdout=subprocess.PIPE, text=True) for _ in range(4)]
    try:
        for i in range(80):  # each new top-level directory adds its counters: the document grows by pages
            (m.mountpoint / f"top{i:02d}").mkdir()
            write_committed(m.mountpoint / f"top{i:02d}" / "f", b"x")
            if i % 20 == 19:
                run_cli("stats", "--zero", str(m.mountpoint), check=True)  # and shrinks
    finally:
        stop.touch()
        outs = [r.communicate(timeout=60)[0].split() for r in readers]
    assert all(int(reads) > 0 for _, reads in outs)
    assert [int(torn) for torn, _ in outs] == [0, 0, 0, 0], outs


COMMANDER = """
import sys
from pathlib import Path
from mithrilfs.cli.client import DaemonChanged, control_command
path, rounds, first = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3])
wrong = torn = 0
for i in range(rounds):
    top = first + i % 4
    try:
        wrong += len(control_command(path, f"top={top}")["largest"]) != top
    except DaemonChanged:  # no JSON read back: another client's answer replaced this one's as it was read
        torn += 1
print(wrong, torn)
"""


def test_commands_asked_at_once_each_read_their_own_answer(mount_factory: MountFactory):
    """A command file answers what was written to it: clients asking at once (``prefetch`` from three
    startup scripts) each read the answer to their own request.  One answer per file served them all: a
    ``prefetch --all`` read a ``prefetch``'s "joined" and followed the wrong prefetch (CI, one run in a few
    hundred).  Here four processes ask ``usage`` for the N largest files, each its own N."""
    m = mount_factory()
    for i in range(12):
        write_committed(m.mountpoint / f"f{i:02d}", b"x" * (100 + i))
    usage = m.mountpoint / ".mithrilfs" / "usage"
    askers = [subprocess.Popen([sys.executable, "-c", COMMANDER, str(usage), "40", str(1 + 4 * k)],
                               stdout=subprocess.PIPE, text=True) for k in range(3)]
    wrong = [a.communicate(timeout=120)[0].split() for a in askers]
    assert all(a.returncode == 0 for a in askers)
    assert wrong == [["0", "0"]] * 3, wrong
