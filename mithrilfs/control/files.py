"""The control directory ``MOUNT/.mithrilfs/``: virtual read-only files.

Reachable by lookup but hidden from ``readdir`` so frameworks listing the
cache never see it.  The kernel opens files without asking the daemon, so
no content can be fixed at open.  Instead attributes are never cached: the
kernel asks (GETATTR) before each read, and that is when the content is
produced afresh, its length the size and its time the mtime, so the kernel
drops the pages it cached of the last content; the READs that follow serve
that one production.  One read asks several times (the probe for the end
of the file asks again), so a production is reused for ``FRESH_SECONDS``,
and a JSON document keeps its size from one production to the next
(``ControlFiles.padded``): another reader's newer production in between
must not change the size under the reader.
``stats.json`` is then a fresh snapshot for every reader, from any
container that sees the mount.  A producer may be a coroutine (a scan of
the index in a worker thread: ``usage.json``): the LOOKUP or GETATTR that
asks for the content waits for it.  Everything a reader needs is readable
without write access; only commands (which change something) are files the
mount's owner writes.  A command file runs what is written to it;
its answer is what it reads back until the next command.  The CLI reads
these files instead of talking to the daemon over a socket.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Awaitable, Callable
from typing import Any

from mithrilfs.crash_points import crash_point
from mithrilfs.store.namespace import CONTROL_NAME

__all__ = ["CONTROL_DIR_INODE", "CONTROL_NAME", "ControlFiles"]
#: How long one production of a control file answers every look at it.
FRESH_SECONDS = 0.002
#: A JSON document's size is a whole number of these, and never shrinks (``ControlFiles.padded``).
JSON_GRANULE = 64 << 10
#: Inode numbers far above anything SQLite will hand out.
CONTROL_DIR_INODE = 1 << 62


class ControlFiles:
    def __init__(self) -> None:
        self._by_name: dict[bytes, int] = {}
        self._producers: dict[int, Callable[[], Awaitable[bytes]]] = {}
        self._commands: dict[int, Callable[[bytes], Awaitable[bytes]]] = {}
        #: What each file showed last (content, mtime_ns): READ serves it.
        self._current: dict[int, tuple[bytes, int]] = {}
        #: The size each JSON document has been padded to so far.
        self._json_sizes: dict[bytes, int] = {}
        self.add(b"pid", lambda: f"{os.getpid()}\n".encode())

    def add(self, name: bytes, produce: Callable[[], bytes]) -> None:
        async def produced() -> bytes:
            return produce()

        self.add_async(name, produced)

    def add_async(self, name: bytes, produce: Callable[[], Awaitable[bytes]]) -> None:
        """A file whose content a coroutine produces (see the module doc)."""
        ino = CONTROL_DIR_INODE + 1 + len(self._by_name)
        self._by_name[name] = ino
        self._producers[ino] = produce

    def padded(self, name: bytes, doc: Any) -> bytes:
        """*doc* as JSON padded with spaces to the size *name* has had, or the next whole granule.

        The kernel opens these files itself (no OPEN, so no handle that
        could keep one production), and a reader asks for the size again at
        the end of its read: when another reader's look had made a longer
        document meanwhile, the first got the second's tail after its own
        end ("Extra data" from json.loads; 1-3 torn reads in 600-980 per
        reader, four readers, while a mount wrote into 80 new directories).
        A size that does not change leaves nothing to read at that end, and
        a document of one granule (stats.json is 8-30 KiB) fits one READ, so
        it comes from one production.  Only a document outgrowing all its
        earlier sizes can still tear one read.
        """
        text = json.dumps(doc, sort_keys=True).encode()
        size = max(self._json_sizes.get(name, 0), -(-(len(text) + 1) // JSON_GRANULE) * JSON_GRANULE)
        self._json_sizes[name] = size
        return text + b" " * (size - len(text) - 1) + b"\n"

    def add_json_async(self, name: bytes, produce: Callable[[], Awaitable[object]]) -> None:
        """A JSON document (padded: ``padded``) that a coroutine produces."""
        async def padded() -> bytes:
            return self.padded(name, await produce())

        self.add_async(name, padded)

    def add_json(self, name: bytes, produce: Callable[[], object]) -> None:
        """A JSON document (padded: ``padded``)."""
        self.add(name, lambda: self.padded(name, produce()))

    def add_command(self, name: bytes, run: Callable[[bytes], Awaitable[bytes]]) -> None:
        """A file its owner writes: what is written runs *run*; its answer is what the file reads back."""
        self.add(name, lambda: b"")
        self._commands[self._by_name[name]] = run

    def is_command(self, ino: int) -> bool:
        return ino in self._commands

    async def run_command(self, ino: int, request: bytes) -> None:
        """Run a command; its answer replaces the last.  Two clients racing on one command file may each
        read the later answer, unless they hold the file's lock from write to read (the CLI's
        ``control_command`` does)."""
        self._current[ino] = (await self._commands[ino](request), time.time_ns())

    @staticmethod
    def is_control(ino: int) -> bool:
        return ino >= CONTROL_DIR_INODE

    def lookup(self, name: bytes) -> int | None:
        return self._by_name.get(name)

    def names(self) -> list[tuple[bytes, int]]:
        return list(self._by_name.items())

    async def refresh(self, ino: int) -> tuple[int, int]:
        """A LOOKUP or GETATTR: (size, mtime_ns) of the content, produced afresh unless it still is fresh."""
        shown = self._current.get(ino)
        if ino not in self._commands and (shown is None or time.time_ns() - shown[1] > FRESH_SECONDS * 1e9):
            shown = self._current[ino] = (await self._producers[ino](), time.time_ns())
        return self.shown(ino)

    def shown(self, ino: int) -> tuple[int, int]:
        """(size, mtime_ns) of what the file shows now, without producing it (a directory listing)."""
        shown = self._current.get(ino)
        return (len(shown[0]), shown[1]) if shown is not None else (0, 0)

    async def read(self, ino: int, off: int, size: int) -> bytes:
        if ino in self._current and ino in self._commands:
            crash_point("command_answer_read")  # the tests': a daemon killed after answering, before the read
        if ino not in self._current:
            await self.refresh(ino)
        return self._current.get(ino, (b"", 0))[0][off : off + size]
