"""The upload queue in the index: when queued names are due."""

from __future__ import annotations

import stat

from mithrilfs.store.namespace import ROOT_INODE, Namespace
from mithrilfs.store.tier_queue import TierQueue

SECOND = 1_000_000_000
DELAY = SECOND // 2


def _file(ns: Namespace, name: bytes, ctime_ns: int) -> int:
    with ns.txn():
        ino = ns.create_inode(stat.S_IFREG | 0o644, 0, 0)
        ns.link(ROOT_INODE, name, ino.id)
        ns.db.execute("UPDATE inodes SET ctime_ns = ? WHERE id = ?", (ctime_ns, ino.id))
    return ino.id


def test_queue_all_makes_a_file_due_a_delay_after_its_last_change(ns: Namespace) -> None:
    """A file changed long ago is due at once; one created a moment ago (not written yet, perhaps: sent now
    it would go empty) only a delay after its change; one whose ctime is ahead of this clock (another
    node's) a delay from now, not a day later."""
    now = 1_800_000_000 * SECOND
    old = _file(ns, b"old", now - 3600 * SECOND)
    fresh = _file(ns, b"fresh", now - DELAY // 5)
    ahead = _file(ns, b"ahead", now + 86400 * SECOND)
    queue = TierQueue(ns)
    with ns.txn():
        assert queue.add_all(now, DELAY) == 3
    assert [ino for ino, _ in queue.due(now - DELAY, 10)] == [old]
    assert [ino for ino, _ in queue.due(now - DELAY // 5, 10)] == [old, fresh]
    assert [ino for ino, _ in queue.due(now, 10)] == [old, fresh, ahead]
