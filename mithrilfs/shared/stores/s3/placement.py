"""A bucket's placement facet: where its small blobs are, in packs (``stores.placement``, ``stores.s3.packs``).

The places come from the entries this node reads or writes and from its
own uploads (``Packs``); what this node does not know it learns by reading
the directories' manifests (``read_places``: the store's, in parallel).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from mithrilfs.shared.stores.entries import RemoteEntry, RemoteError
from mithrilfs.shared.stores.placement import Placement
from mithrilfs.shared.stores.s3.packs import RANGE_BYTES, Packs
from mithrilfs.shared.stores.s3.seen import SeenManifests

#: A startup record's write reads at most this many manifests to learn where its blobs are (``for_record``).
RELEARN_DIRS = 4096


class PackPlacement(Placement):
    """The places of one bucket's packed blobs (see the module doc).

    *read_places* reads directories' manifests for their places (inside a
    request of the store); *call* runs it as one (its failures a
    RemoteError); *now* is the bucket's time (``clock``); *seen* the
    manifests as last read or written (``will_publish`` reads the others).
    """

    def __init__(self, packs: Packs, seen: SeenManifests, *, now: Callable[[], float],
                 read_places: Callable[[list[str]], None], call: Callable[..., Any]) -> None:
        self.packs = packs
        self.seen = seen
        self._now = now
        self._read_places = read_places
        self.call = call

    def container_of(self, hex_digest: str) -> str | None:
        """The part of its pack a blob begins in (``packs.RANGE_BYTES``): a batch that follows the parts is
        one range GET of one part."""
        place = self.packs.location(hex_digest)
        return f"{place[0]}/{place[1] // RANGE_BYTES}" if place is not None else None

    def knows_where(self, hex_digest: str) -> bool:
        return self.packs.knows(hex_digest)

    def learn(self, entries: Iterable[RemoteEntry]) -> None:
        self.packs.learn(entries)

    def with_locations(self, items: list[tuple[str, RemoteEntry]]) -> list[tuple[str, RemoteEntry]]:
        return self.packs.locate(items)

    def locate_for_publish(self, items: list[tuple[str, RemoteEntry]]) -> list[tuple[str, RemoteEntry]]:
        """RemoteError (nothing published; the batch is sent again, its blobs checked and packed again) when a
        place added is in a pack old enough for ``fleet gc`` to delete (``Packs.stale``)."""
        located = self.packs.locate(items)
        stale = self.packs.stale(items, located, self._now())
        if stale:
            raise RemoteError(f"{len(stale)} names would locate their blobs in packs old enough for fleet gc "
                              f"to delete (e.g. {stale[0]!r}): checking them again")
        return located

    def will_publish(self, paths: list[str]) -> None:
        """Read the manifests the publish will merge into that this node has not seen: their entries say
        which blobs the bucket holds (no HEAD per blob), and the publish merges into what was read."""
        dirs = sorted(d for d in {p.rpartition("/")[0] for p in paths} if self.seen.get(d) is None)
        if dirs:
            self.call(self._read_places, dirs)

    def for_record(self, items: list[tuple[str, RemoteEntry]]) -> list[tuple[str, RemoteEntry]]:
        """Read the manifests of the record's directories whose blobs' places this mount does not know (at
        most ``RELEARN_DIRS``, in parallel), so the record carries them: a node that wrote its files, was
        remounted and read them back knows none (it read nothing from the bucket), and every new node reading
        its record would read each directory's manifest before its blobs (see docs/benchmarks.md,
        'H, a new node across a 20 ms bucket').  Paid once by the recording node."""
        dirs = sorted({path.rpartition("/")[0] for path, e in items
                       if e.type == "f" and e.hash and e.size and not self.packs.knows(e.hash)})[:RELEARN_DIRS]
        self._read_places(dirs)
        return self.packs.locate(items)  # a reader fetches from the packs at once

    def known_places(self) -> list[list[Any]]:
        return self.packs.export()

    def learn_places(self, places: list[Any]) -> int:
        return self.packs.take(places)
