"""Where the store held blobs, kept by one mount for the next: a bucket's packs found without a listing.

A store that packs blobs (a bucket) learns where each blob is from the
names it reads (``RemoteStore.known_places``).  An unmount keeps what it
learned in the index (``keep``); the next mount reads it back at its start
and gives it to the store (``learn``) once the uploader's first look at the
epoch finds the store the one they were learned from (``write_behind``); a
store that lost its data, or another one, never gets them.
"""

from __future__ import annotations

import json
import logging

from mithrilfs.shared.stores.base import RemoteStore
from mithrilfs.store.namespace import Namespace

log = logging.getLogger("mithrilfs.shared.remote_tier")  # the name operators know from the logs

#: The places of blobs a mount knew, kept for the next, by store.
PLACES_META_PREFIX = "remote_places:"


def places_meta(remote: RemoteStore) -> str:
    """The index's meta key of the places of blobs kept for *remote*."""
    return f"{PLACES_META_PREFIX}{remote.url}:{remote.namespace}"


class KeptPlaces:
    """The places the last mount kept for *remote* (JSON), until the uploader takes or drops them."""

    def __init__(self, ns: Namespace, remote: RemoteStore) -> None:
        self.ns = ns
        self.remote = remote
        #: As the last mount kept them; None once taken (or none kept).
        self.kept = ns.get_meta(places_meta(remote))

    def take(self) -> str | None:
        """The kept places, handed over once: ``learn`` them, or drop them (the store is not theirs)."""
        kept, self.kept = self.kept, None
        return kept

    def learn(self, raw: str) -> int:
        """The places *raw* (``take``'s) given to the store; how many it took.  In a thread: up to 65,536 of
        them are parsed and checked one by one."""
        try:
            places = json.loads(raw)
        except ValueError:
            places = None
        if not isinstance(places, list):
            log.warning("the places of blobs kept by the last mount do not read as a list: not used")
            return 0
        return self.remote.placement.learn_places(places)

    def keep(self) -> None:
        """The places this mount knew, for the next one; the last mount's stay as they are when this one
        never looked at the epoch (a tier down all along): it learned nothing."""
        if self.kept is not None:
            return
        places = self.remote.placement.known_places()
        with self.ns.txn():
            self.ns.set_meta(places_meta(self.remote), json.dumps(places, separators=(",", ":")))
