"""The control directory ``MOUNT/.mithrilfs/``: virtual read-only files.

Reachable by lookup but hidden from ``readdir`` so frameworks listing the
cache never see it.  Each file's content is produced when it is opened, so
``stats.json`` is a fresh snapshot for every reader, from any container that
sees the mount.  The CLI reads these files instead of talking to the daemon
over a socket.
"""

from __future__ import annotations

import json
import os
from typing import Awaitable, Callable

CONTROL_NAME = b".mithrilfs"
#: Inode numbers far above anything SQLite will hand out.
CONTROL_DIR_INODE = 1 << 62


class ControlFiles:
    def __init__(self) -> None:
        self._by_name: dict[bytes, int] = {}
        self._producers: dict[int, Callable[[], bytes]] = {}
        self._commands: dict[int, Callable[[bytes], Awaitable[bytes]]] = {}
        self.add(b"pid", lambda: f"{os.getpid()}\n".encode())

    def add(self, name: bytes, produce: Callable[[], bytes]) -> None:
        ino = CONTROL_DIR_INODE + 1 + len(self._by_name)
        self._by_name[name] = ino
        self._producers[ino] = produce

    def add_json(self, name: bytes, produce: Callable[[], object]) -> None:
        self.add(name, lambda: (json.dumps(produce(), sort_keys=True) + "\n").encode())

    def add_command(self, name: bytes, run: Callable[[bytes], Awaitable[bytes]]) -> None:
        """A writable file: what is written runs *run*; its answer is read back on the same handle."""
        self.add(name, lambda: b"")
        self._commands[self._by_name[name]] = run

    def is_command(self, ino: int) -> bool:
        return ino in self._commands

    async def run_command(self, ino: int, request: bytes) -> bytes:
        return await self._commands[ino](request)

    @staticmethod
    def is_control(ino: int) -> bool:
        return ino >= CONTROL_DIR_INODE

    def lookup(self, name: bytes) -> int | None:
        return self._by_name.get(name)

    def names(self) -> list[tuple[bytes, int]]:
        return list(self._by_name.items())

    def produce(self, ino: int) -> bytes:
        return self._producers[ino]()
