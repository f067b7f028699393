"""``fleet gc`` on a memory store: the Redis collector's checks, on the server's dicts.

Every delete checks what gc listed is still there, under the server's lock
(as Redis's scripts do): a name goes only if it holds the value gc listed,
a blob only if it was last written before the cutoff, so a writer that
uploads it again meanwhile keeps it.  Blobs always have a time (the upload
writes it).
"""

from __future__ import annotations

from mithrilfs.shared.stores import ages
from mithrilfs.shared.stores.collector import Collector, Container
from mithrilfs.shared.stores.memory.store import MemoryStore, Space


class MemoryCollector(Collector):
    store: MemoryStore

    def __init__(self, store: MemoryStore) -> None:
        super().__init__(store, store.codec)
        #: Directories whose recorded use is no time (``ages.use_time``): ``adopt`` writes over it.
        self._refused: set[str] = set()

    @property
    def space(self) -> Space:
        return self.store.space

    # -- names -----------------------------------------------------------------------
    def list_names(self) -> dict[str, dict[bytes, bytes]]:
        return self.store.call(lambda: {d: dict(raw) for d, raw in self.space.dirs.items() if raw})

    def names_of(self, dir_path: str) -> dict[bytes, bytes]:
        return self.store.call(lambda: dict(self.space.dirs.get(dir_path, {})))

    def is_empty(self, dir_path: str) -> bool:
        return not self.names_of(dir_path)

    def remove_names(self, dir_path: str, raw: dict[bytes, bytes]) -> int:
        def remove() -> int:
            held = self.space.dirs.get(dir_path, {})
            gone = [name for name, value in raw.items() if held.get(name) == value]
            for name in gone:
                del held[name]
            if not held:
                self.space.dirs.pop(dir_path, None)
            return len(gone)

        return self.store.call(remove)

    def put_back(self, dir_path: str, name: bytes, raw: bytes) -> None:
        self.store.call(lambda: self.space.dirs.setdefault(dir_path, {}).setdefault(name, raw))

    # -- use records -----------------------------------------------------------------------
    def use_times(self) -> dict[str, float]:
        """The recorded uses; one that is no time is refused, counted, and written over by ``adopt``."""
        def get() -> dict[str, float]:
            out, refused = {}, set()
            for d, v in self.space.used.items():
                t = ages.use_time(v)
                if t is None:
                    refused.add(d)
                else:
                    out[d] = t
            self._refused = refused
            return out

        out = self.store.call(get)
        self.store.counters["remote_rejected"] += len(self._refused)
        return out

    def adopt(self, dirs: list[str], when: float, *, replace: bool = False) -> None:
        def add() -> None:
            used = self.space.used
            for d in dirs:
                if replace:
                    used[d] = min(used.get(d, when), when)
                elif d not in used or d in self._refused:
                    used[d] = when

        if dirs:
            self.store.call(add)

    def forget_use(self, dirs: list[str]) -> None:
        def forget() -> None:
            for d in dirs:
                self.space.used.pop(d, None)

        if dirs:
            self.store.call(forget)

    # -- blobs -------------------------------------------------------------------------------
    def containers(self, *, adopt: bool = True) -> list[Container]:
        return self.store.call(lambda: [Container(h, (h,), len(data), written)
                                        for h, (data, written) in self.space.blobs.items()])

    def delete_container(self, c: Container, older_than: float) -> int | None:
        def delete() -> int | None:
            held = self.space.blobs.get(c.id)
            if held is None or held[1] >= older_than:
                return None  # gone already, or written again since it was listed
            del self.space.blobs[c.id]
            self.space.blob_names.pop(c.id, None)
            return len(held[0])

        return self.store.call(delete)

    def write_summary(self, data: bytes) -> None:
        def write() -> None:
            self.space.summary = data

        self.store.call(write)
