"""Size/duration parsing and the eviction policy's LRU order, without FUSE."""

from __future__ import annotations

import stat

import pytest

from mithrilfs.cache.eviction import count_units, lru_units
from mithrilfs.cache.policy import EvictionPolicy
from mithrilfs.cache.recency import Recency
from mithrilfs.store.namespace import ROOT_INODE
from mithrilfs.units import format_size, parse_duration, parse_size


@pytest.mark.parametrize(
    "text,expected",
    [("500M", 500 << 20), ("10G", 10 << 30), ("1.5T", int(1.5 * (1 << 40))), ("4096", 4096),
     ("64k", 64 << 10), ("2GiB", 2 << 30), ("3 MB", 3 * 10**6), ("10 GB", 10**10), ("10Gi", 10 << 30),
     ("9223372036854775807", (1 << 63) - 1)],
)
def test_parse_size(text, expected):
    """G and GiB are powers of 1024, GB of 1000 (it used to mean GiB silently)."""
    assert parse_size(text) == expected


@pytest.mark.parametrize("text", ["9223372036854775808", "99999999999999999999999999", "8000000P"])
def test_parse_size_refuses_what_does_not_fit_in_64_bits(text):
    with pytest.raises(ValueError, match="too large"):
        parse_size(text)
    with pytest.raises(ValueError, match="64 bits"):
        EvictionPolicy(max_bytes=int(text.rstrip("P")) * (1 << 50 if text.endswith("P") else 1))


@pytest.mark.parametrize("text", ["", "ten", "10X", "-5", "1.2.3G"])
def test_parse_size_rejects(text):
    with pytest.raises(ValueError, match="invalid size"):
        parse_size(text)


@pytest.mark.parametrize("text,expected", [("30s", 30), ("5m", 300), ("2h", 7200), ("7d", 604800),
                                           ("1w", 604800), ("250ms", 0.25), ("12", 12)])
def test_parse_duration(text, expected):
    assert parse_duration(text) == pytest.approx(expected)


def test_format_size():
    assert format_size(512) == "512 B"
    assert format_size(1536) == "1.5 KiB"
    assert format_size(10 << 30) == "10.0 GiB"


def test_policy_validates():
    with pytest.raises(ValueError):
        EvictionPolicy(high=0.8, low=0.9)
    with pytest.raises(ValueError):
        EvictionPolicy(max_bytes=0)
    p = EvictionPolicy(max_bytes=1000, high=0.9, low=0.5)
    assert (p.high_bytes, p.low_bytes) == (900, 500)


def _file(ns, parent, name, atime, digest=None):
    with ns.txn():
        ino = ns.create_inode(stat.S_IFREG | 0o644, 0, 0)
        ns.link(parent, name, ino.id)
        d = digest or bytes([ino.id]) * 32
        ns.blob_intent(d, 10)
        ns.set_content(ino, d, 10, 1)
        ns.set_atimes([(atime, ino.id)])
    return ino.id


def _dir(ns, parent, name):
    with ns.txn():
        d = ns.create_inode(stat.S_IFDIR | 0o755, 0, 0, nlink=2)
        ns.link(parent, name, d.id)
    return d.id


def test_lru_order_with_a_group_placed_at_its_newest_member(ns):
    a = _file(ns, ROOT_INODE, b"a", atime=10)
    g = _dir(ns, ROOT_INODE, b"kernel")
    g1 = _file(ns, g, b"k.cubin", atime=5)
    g2 = _file(ns, g, b"__grp__k.json", atime=30)
    b = _file(ns, ROOT_INODE, b"b", atime=20)
    units = list(lru_units(ns))
    assert [sorted(u.inodes) for u in units] == [[a], [b], sorted([g1, g2])]
    assert units[2].group_dir == g and units[2].recency_ns == 30
    assert count_units(ns) == 3


def test_recency_batches_until_flush(ns):
    f = _file(ns, ROOT_INODE, b"f", atime=1)
    r = Recency(ns)
    r.touch(f, 99)
    assert ns.get(f).atime_ns == 1 and r.get(f, 1) == 99
    assert r.flush() == 1
    assert ns.get(f).atime_ns == 99 and r.flush() == 0
