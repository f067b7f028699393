"""Which top-level directory a file is under: the key of its per-directory counters.

``stats`` reports ``inductor`` and ``triton`` apart.  A file's top-level
directory is remembered from its LOOKUP or CREATE (no query per open) and
worked out from its names otherwise; a directory rename forgets them all.
"""

from __future__ import annotations

from mithrilfs.observe.stats import ROOT_KEY
from mithrilfs.store.namespace import ROOT_INODE, DirPaths, Namespace


class TopDirs:
    def __init__(self, ns: Namespace, paths: DirPaths) -> None:
        self.ns = ns
        self.paths = paths
        self._of_file: dict[int, str] = {}
        #: Directories' tops, worked out once (a lookup asks for its directory's every time).
        self._of_dir: dict[int, str] = {}

    def of_dir(self, d: int) -> str:
        """Which top-level directory *d* is, or is under ("/" for the root itself)."""
        top = self._of_dir.get(d)
        if top is not None:
            return top
        path = self.paths.of_dir(d)
        if not path:
            return ROOT_KEY  # a directory gone (or the root): not kept
        top = path.split("/", 1)[0].encode(errors="surrogateescape").decode(errors="replace")
        if len(self._of_dir) >= 65536:
            self._of_dir.clear()
        self._of_dir[d] = top
        return top

    def of_child(self, parent: int, child_is_dir: bool, name: bytes) -> str:
        if parent == ROOT_INODE:
            return name.decode(errors="replace") if child_is_dir else ROOT_KEY
        return self.of_dir(parent)

    def of_file(self, ino: int, *, remember: bool = True) -> str:
        """A file's top-level directory, remembered from its lookup when there was one.

        Not *remember*: worked out without keeping it (a file on its way out: eviction, quarantine,
        which the kernel may never FORGET).
        """
        top = self._of_file.get(ino)
        if top is None:
            names = self.ns.names_of(ino)
            top = self.of_child(names[0][0], False, names[0][1]) if names else ROOT_KEY
            if remember:
                self._of_file[ino] = top
        return top

    def remember(self, ino: int, top: str) -> None:
        self._of_file[ino] = top

    def forget(self, ino: int) -> None:
        self._of_file.pop(ino, None)

    def moved(self, ino: int, *, is_dir: bool) -> None:
        """A rename: the file's top may have changed; a directory's move changes a whole subtree's."""
        if is_dir:
            self.paths.clear()
            self._of_file.clear()
            self._of_dir.clear()
        else:
            self._of_file.pop(ino, None)
