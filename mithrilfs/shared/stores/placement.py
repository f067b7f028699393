"""Where a store holds blobs with others: the placement facet of a ``RemoteStore`` (``store.placement``).

A store that finds a blob by its hash alone (Redis) needs nothing here: its
placement is ``NullPlacement``, which knows every blob's place and keeps
none.  A bucket holds small blobs in packs (``stores.s3.packs``) and
learns where from the entries it reads: each file's entry names its blob's
pack and offset.  Its placement (``stores.s3.placement.PackPlacement``)
remembers those places, cuts a prefetch's batches at a pack's parts, adds
the places to names about to be published and to startup records, and
keeps them from one mount to the next.  Redis in front of a bucket uses the
bucket's (``stores.layered.store``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterable
from typing import Any

from mithrilfs.shared.stores.entries import RemoteEntry


class Placement(ABC):
    """Where a store holds its blobs, as far as this mount learned it; every method is local unless it says
    it asks the store (``will_publish``, ``for_record``)."""

    @abstractmethod
    def container_of(self, hex_digest: str) -> str | None:
        """The object (or the part of one) holding a blob with others, where known: the prefetch cuts its
        batches there, so a part is one range GET, not one per batch it straddles."""

    @abstractmethod
    def knows_where(self, hex_digest: str) -> bool:
        """Whether a fetch of this blob can find it without its entry being read first (a node that
        materialized a name in an earlier mount and never read its content reads its directory again)."""

    @abstractmethod
    def learn(self, entries: Iterable[RemoteEntry]) -> None:
        """Entries read (through this store or another level in front of it): where their blobs are."""

    @abstractmethod
    def with_locations(self, items: list[tuple[str, RemoteEntry]]) -> list[tuple[str, RemoteEntry]]:
        """*items* with where the store holds each file's blob, where known (what other levels copy)."""

    @abstractmethod
    def locate_for_publish(self, items: list[tuple[str, RemoteEntry]]) -> list[tuple[str, RemoteEntry]]:
        """``with_locations`` for names about to be published; RemoteError for a place too old to trust
        (nothing is published; the batch is checked again)."""

    @abstractmethod
    def will_publish(self, paths: list[str]) -> None:
        """The paths the next ``publish_entries`` writes, before its blobs go: the store may read their
        directories now and learn which blobs it holds (``missing_blobs``).  A request; may raise RemoteError."""

    @abstractmethod
    def for_record(self, items: list[tuple[str, RemoteEntry]]) -> list[tuple[str, RemoteEntry]]:
        """*items* of a startup record about to be written, with their places: the store may read the
        directories whose places this mount does not know.  Runs inside the store's request (``Shelf.run``)."""

    @abstractmethod
    def known_places(self) -> list[list[Any]]:
        """What this mount learned, for the next mount of the same local store (``RemoteTier.unmounting``)."""

    @abstractmethod
    def learn_places(self, places: list[Any]) -> int:
        """What ``known_places`` gave an earlier mount, once the store is known to be the same generation
        (the same epoch); how many were taken."""


class NullPlacement(Placement):
    """A store that finds every blob by its hash: every place known, none kept."""

    def container_of(self, hex_digest: str) -> str | None:
        return None

    def knows_where(self, hex_digest: str) -> bool:
        return True

    def learn(self, entries: Iterable[RemoteEntry]) -> None:
        return None

    def with_locations(self, items: list[tuple[str, RemoteEntry]]) -> list[tuple[str, RemoteEntry]]:
        return items

    def locate_for_publish(self, items: list[tuple[str, RemoteEntry]]) -> list[tuple[str, RemoteEntry]]:
        return items

    def will_publish(self, paths: list[str]) -> None:
        return None

    def for_record(self, items: list[tuple[str, RemoteEntry]]) -> list[tuple[str, RemoteEntry]]:
        return items

    def known_places(self) -> list[list[Any]]:
        return []

    def learn_places(self, places: list[Any]) -> int:
        return 0


#: The placement of every store that finds blobs by hash (it holds no state).
NULL_PLACEMENT = NullPlacement()
