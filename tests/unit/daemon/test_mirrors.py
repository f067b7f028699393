"""Mirrors of content staged in memory (``daemon.mirrors``): the daemon's end of the channel against a real
supervisor reading the other end of a socket pair."""

from __future__ import annotations

import os
import socket
import threading
from pathlib import Path

from mithrilfs.daemon import mirrors
from mithrilfs.daemon.channel import SupervisorLink
from mithrilfs.daemon.supervisor import Supervisor


class CountingSupervisor(Supervisor):
    """A supervisor that also notes the verb of every message it reads."""

    def __init__(self) -> None:
        super().__init__("/nonexistent", 0, "0:0", "umount2", -1, -1, os.getpid())
        self.verbs: list[str] = []

    def _receive(self, channel: socket.socket) -> tuple[str, list[int], int]:
        text, fds, flags = super()._receive(channel)
        self.verbs.append(text.partition(" ")[0])
        return text, fds, flags


def _pair(tmp_path: Path) -> tuple[SupervisorLink, CountingSupervisor, threading.Thread]:
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    supervisor = CountingSupervisor()
    listening = threading.Thread(target=supervisor.listen, args=(theirs,), daemon=True)
    listening.start()
    link = SupervisorLink(ours.detach(), {"store": str(tmp_path), "foreground": True, "read_only": True})
    return link, supervisor, listening


def test_files_staged_in_memory_reuse_mirrors_with_no_message_each_and_a_dead_daemon_leaves_exactly_theirs(
        tmp_path: Path) -> None:
    """Hundreds of files staged and committed one after another cost one batch of mirrors and no message
    each; when the daemon's line closes, the supervisor holds the content of exactly the files still staged,
    and what was said of an inode (a staging file, lost) wins over a mirror still naming it."""
    link, supervisor, listening = _pair(tmp_path)
    for ino in range(100, 400):
        fd = link.mirror(ino)
        os.pwrite(fd, b"committed %d" % ino, 0)
        link.unmirror(fd)  # its commit is in the index
    staged = {}
    for ino in (1001, 1002):
        staged[ino] = link.mirror(ino)
        os.pwrite(staged[ino], b"staged %d" % ino, 0)
    spilled = link.mirror(1003)
    os.pwrite(spilled, b"moved to a staging file", 0)
    staging = tmp_path / "staging-1003"
    staging.write_bytes(b"moved to a staging file, then written on")
    with open(staging, "rb") as f:
        link.staging(1003, f.fileno(), str(staging))  # the daemon dies before giving the mirror back
    dropped = link.mirror(1004)
    link.lost(1004)
    link.close()  # the daemon is gone
    listening.join(timeout=30)
    assert not listening.is_alive()
    assert supervisor.verbs.count("mirrors") == 1 and supervisor.verbs.count("mirror-slots") == 1
    assert len(supervisor.verbs) == 6, supervisor.verbs  # options, the table, one batch, s, x, the end
    assert sorted(supervisor.written) == [1001, 1002, 1003, 1004]
    for ino in (1001, 1002):
        fd, path = supervisor.written[ino]
        assert path is None and os.pread(fd, 100, 0) == b"staged %d" % ino
    fd, path = supervisor.written[1003]
    assert path == str(staging) and os.pread(fd, 100, 0) == b"moved to a staging file, then written on"
    assert supervisor.written[1004] == (-1, None)
    for fd in (*staged.values(), spilled, dropped):
        os.close(fd)


def test_free_mirrors_beyond_the_limit_are_closed_on_both_ends(tmp_path: Path, monkeypatch) -> None:
    """After a burst of files staged at once, the mirrors given back beyond ``MAX_FREE`` are closed, and the
    supervisor closes its own descriptors of them."""
    monkeypatch.setattr(mirrors, "MAX_FREE", 3)
    monkeypatch.setattr(mirrors, "BATCH", 5)
    link, supervisor, listening = _pair(tmp_path)
    fds = [link.mirror(ino) for ino in range(1, 11)]
    for fd in fds:
        link.unmirror(fd)
    assert link.mirrors is not None and len(link.mirrors._free) == 3
    link.close()
    listening.join(timeout=30)
    assert supervisor.verbs.count("mirrors") == 2 and supervisor.verbs.count("unmirror") == 7
    assert supervisor.written == {} and supervisor.mirrors == {}
