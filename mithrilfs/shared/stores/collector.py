"""The store-specific half of ``fleet gc``: what a backend lists, deletes and keeps for a run.

``fleet.gc`` plans and runs a collection over a ``Collector`` and never
knows which store it has; each backend package has its own (``redis.gc``,
``s3.gc``, ``layered.gc``), built by ``connect.collector_for``.  A
``Container`` is what a store deletes as one: a blob, or a bucket's pack.
Every method is blocking I/O and may raise ``RemoteError``.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass

from mithrilfs.shared.stores.base import RemoteStore
from mithrilfs.shared.stores.entries import EntryCodec


@dataclass(frozen=True)
class Container:
    """What a store deletes as one: a blob (its object or chunks), or a bucket's pack of blobs."""

    id: str
    #: What a name references to keep it: the blob's hash; a pack's id (the entries locating a blob in it).
    hashes: tuple[str, ...]
    size: int
    #: When it was last written (unix seconds).
    written: float
    #: "blob" or "pack" (counted apart in the report).
    kind: str = "blob"



class Collector(ABC):
    """The store-specific half of gc (requests are counted by the store's levels)."""

    def __init__(self, store: RemoteStore, codec: EntryCodec) -> None:
        self.store = store
        #: Entries as nodes read them (with gc's key, when it has one): what the report counts as names.
        self.codec = codec

    @abstractmethod
    def list_names(self) -> dict[str, dict[bytes, bytes]]:
        """Every directory's entries, raw (name -> value)."""

    @abstractmethod
    def use_times(self) -> dict[str, float]:
        """Directory -> its last use (unix seconds)."""

    @abstractmethod
    def adopt(self, dirs: list[str], when: float, *, replace: bool = False) -> None:
        """Record *when* as the last use of directories nobody recorded (they start aging now); *replace*:
        of directories whose records are dated past *when* (a writer's clock ahead), lowered to it."""

    @abstractmethod
    def forget_use(self, dirs: list[str]) -> None:
        """Drop the use records of deleted directories."""

    @abstractmethod
    def remove_names(self, dir_path: str, raw: dict[bytes, bytes]) -> int:
        """Delete these names where they still hold these values; how many went."""

    def keep_listing(self) -> None:
        """After a run: keep what the last ``list_names`` read for the next run's, where reading a directory
        costs a request of its own (a bucket's ``gc-state``); elsewhere nothing (a Redis listing reads
        hundreds of directories a request, memory none)."""
        return None

    @abstractmethod
    def names_of(self, dir_path: str) -> dict[bytes, bytes]:
        """One directory's entries, raw."""

    @abstractmethod
    def is_empty(self, dir_path: str) -> bool:
        """Whether the directory holds no entry at all."""

    def remove_entry_if(self, dir_path: str, name: bytes, raw: bytes) -> bool:
        """Delete one name if it still holds *raw*."""
        return self.remove_names(dir_path, {name: raw}) == 1

    @abstractmethod
    def put_back(self, dir_path: str, name: bytes, raw: bytes) -> None:
        """Write a name back where it is absent."""

    @abstractmethod
    def containers(self, *, adopt: bool = True) -> list[Container]:
        """Every blob container with its age (blobs with no known age are given "now", and with *adopt*
        that time is kept: they age from this run on)."""

    @abstractmethod
    def delete_container(self, c: Container, older_than: float) -> int | None:
        """Delete *c* if it was still last written before *older_than*: the bytes freed; None when kept."""

    def begin_sweep(self) -> None:
        """Before listing containers to delete: writers hold names back from now (a bucket)."""
        return None

    def end_sweep(self) -> None:
        """After the last container deletion."""
        return None

    @abstractmethod
    def write_summary(self, data: bytes) -> None:
        """Keep the run's summary in the tier (``summary``)."""

    def requests(self) -> int:
        return sum(lv.requests for lv in self.store.levels())

    def rejected(self) -> int:
        """Refused data seen so far (entries, manifests, use records): ``remote_rejected``."""
        return self.store.counters["remote_rejected"]
