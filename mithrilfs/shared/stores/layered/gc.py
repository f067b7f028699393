"""``fleet gc`` of Redis in front of a bucket: the bucket is collected, Redis follows.

The bucket holds every name and blob, so gc lists, ages and deletes there
(its ``Collector``, the back).  A directory whose names went is dropped
from Redis too and loses its mark of completeness, so the next listing
reads it from the bucket again; Redis's blobs expire on their own
(``layered.store.HOT_TTL``).
"""

from __future__ import annotations

from mithrilfs.shared.stores.collector import Collector, Container
from mithrilfs.shared.stores.layered.store import LayeredStore


class LayeredCollector(Collector):
    """*back* (the bucket's collector) does the run; names it removes go from *front* (Redis's) too."""

    store: LayeredStore

    def __init__(self, store: LayeredStore, front: Collector, back: Collector) -> None:
        super().__init__(store, back.codec)
        self.front = front
        self.back = back

    def _front_changed(self, dir_path: str) -> None:
        """Redis may now lack names the bucket has in *dir_path*: read it from the bucket next time."""
        self.store.front.unmark_complete([dir_path])

    # -- names: removed from both -------------------------------------------------
    def remove_names(self, dir_path: str, raw: dict[bytes, bytes]) -> int:
        n = self.back.remove_names(dir_path, raw)
        self.front.remove_names(dir_path, raw)
        self._front_changed(dir_path)
        return n

    def put_back(self, dir_path: str, name: bytes, raw: bytes) -> None:
        self.back.put_back(dir_path, name, raw)
        self._front_changed(dir_path)

    # -- everything else: the bucket's ----------------------------------------------
    def list_names(self) -> dict[str, dict[bytes, bytes]]:
        return self.back.list_names()

    def names_of(self, dir_path: str) -> dict[bytes, bytes]:
        return self.back.names_of(dir_path)

    def keep_listing(self) -> None:
        self.back.keep_listing()

    def is_empty(self, dir_path: str) -> bool:
        return self.back.is_empty(dir_path)

    def use_times(self) -> dict[str, float]:
        return self.back.use_times()

    def adopt(self, dirs: list[str], when: float, *, replace: bool = False) -> None:
        self.back.adopt(dirs, when, replace=replace)

    def forget_use(self, dirs: list[str]) -> None:
        self.back.forget_use(dirs)

    def containers(self, *, adopt: bool = True) -> list[Container]:
        return self.back.containers(adopt=adopt)

    def delete_container(self, c: Container, older_than: float) -> int | None:
        return self.back.delete_container(c, older_than)

    def begin_sweep(self) -> None:
        self.back.begin_sweep()

    def end_sweep(self) -> None:
        self.back.end_sweep()

    def write_summary(self, data: bytes) -> None:
        self.back.write_summary(data)
