"""The names ``Namespace`` keeps in memory, so that a LOOKUP is answered without SQLite where it can.

(parent, name) -> inode of the names found by lookups or loaded with
their directory (``Namespace.preload_dir``), up to ``NAME_CACHE_SIZE``
(about 120 bytes each; past that they start over).  A directory loaded
whole, or made empty, is kept whole: its new names are kept as they come,
so a name it does not keep is not there.  ``Namespace`` tells every change
of a name (``changed``, ``gone``) and empties them all (``clear``) on a
rolled-back transaction and after a change made by SQL alone (``recover``).
"""

from __future__ import annotations

#: Names kept at most; past this many they start over.
NAME_CACHE_SIZE = 1 << 18


class KeptNames:
    def __init__(self, enabled: bool) -> None:
        """*enabled*: False for a reader of an index another connection changes (nothing kept stays right)."""
        self.enabled = enabled
        self.names: dict[tuple[int, bytes], int] = {}
        #: Directories ``Namespace.preload_dir`` read (whole, or found too large) since the last ``clear``.
        self.preloaded: set[int] = set()
        #: Directories all of whose names are kept.
        self.whole: set[int] = set()

    def keep(self, key: tuple[int, bytes], ino: int) -> None:
        if self.enabled:
            if len(self.names) >= NAME_CACHE_SIZE:
                self.clear()
            self.names[key] = ino

    def changed(self, key: tuple[int, bytes], ino: int) -> None:
        """*key* names *ino* now: kept if its directory is kept whole, else no longer kept."""
        if key[0] in self.whole:
            self.keep(key, ino)
        else:
            self.names.pop(key, None)

    def gone(self, key: tuple[int, bytes]) -> None:
        self.names.pop(key, None)

    def made_empty(self, directory: int) -> None:
        """A new directory: it has no names yet, so it is kept whole."""
        if self.enabled:
            self.whole.add(directory)

    def loaded(self, directory: int) -> None:
        """All the names of *directory* were just kept (unless they started over meanwhile)."""
        if directory in self.preloaded:
            self.whole.add(directory)

    def clear(self) -> None:
        self.names.clear()
        self.preloaded.clear()
        self.whole.clear()
