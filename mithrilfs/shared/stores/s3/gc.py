"""``fleet gc`` on a bucket (alone, or behind Redis): manifests by compare-and-swap, blobs by age.

A run GETs only the manifests whose ETag (in the LIST of ``names/``) is
not in the last run's ``gc-state`` (``gc_state``), and writes that state
again at its end.

A name goes by the same compare-and-swap writers use (``If-Match`` the
manifest's ETag): only names still holding the value gc listed, so a name
published meanwhile stays.  Use records are small objects under ``usage/``,
one per node flush, merged here (and compacted into one when there are
many).  A blob object or a pack is deleted only when unreferenced (a pack:
no entry locates a blob in it) and last written before the grace, checked
again (HEAD) just before; and while the sweep runs a marker of its own,
``gc-sweeps/T-R``, tells writers to hold their names back (a writer that
re-uploaded an old blob, or wrote an old pack's bytes again, checks its
blobs again after the sweep: ``write_behind``, ``Packs.swept``).  S3 has no
conditional DELETE that SeaweedFS and obstore both offer, hence the marker;
one per run, so a run that ends removes its own and never another's.

Only keys that parse as this namespace's own (``s3.layout``) are read,
merged or deleted: a listing of ``usage/``, ``blobs/`` or ``packs/`` also
returns whatever lies below them (another fleet nested there, a planted
object).
"""

from __future__ import annotations

import json
import logging
import time
from typing import Any

from mithrilfs.shared.stores import ages
from mithrilfs.shared.stores.collector import Collector, Container
from mithrilfs.shared.stores.entries import RemoteError, is_hex_digest, is_pack_id
from mithrilfs.shared.stores.s3 import gc_state
from mithrilfs.shared.stores.s3.blobs import object_age
from mithrilfs.shared.stores.s3.conn import obstore_api
from mithrilfs.shared.stores.s3.layout import SWEEPS, USAGE, is_record_key, record_key
from mithrilfs.shared.stores.s3.packs import pack_key
from mithrilfs.shared.stores.s3.store import CAS_ATTEMPTS, S3Store, unquote_component

log = logging.getLogger(__name__)

#: A gc that finds more use-record objects than this merges them into one.
USAGE_COMPACTED = 64
#: A use-record object larger than this is never read whole (a node writes a few KiB an hour).
MAX_USAGE_BYTES = 32 << 20


class S3Collector(Collector):
    """The bucket's half of gc (see the module doc); behind Redis, ``layered.gc`` wraps it."""

    def __init__(self, s3: S3Store) -> None:
        super().__init__(s3, s3.codec)
        self.s3 = s3
        self._usage_keys: list[str] = []
        self._usage: dict[str, float] = {}
        self._swept_at = 0.0
        #: This run's sweep marker (``begin_sweep``), the only one it deletes.
        self._sweep_key = ""
        #: Manifests read by this collector: directory -> (ETag, entries).
        self._manifests: dict[str, tuple[str, dict[bytes, bytes]]] = {}
        #: Their bytes as stored, where their ETag proves them (``gc_state.proven``): the next state.
        self._bodies: dict[str, tuple[str, bytes]] = {}
        #: The last run's state (None until the first listing reads it).
        self._state: dict[str, tuple[str, bytes]] | None = None
        #: The last listing: directory -> ETag.
        self._listed: dict[str, str] = {}

    def _list(self, prefix: str) -> list[dict[str, Any]]:
        out = []
        for batch in obstore_api().list(self.s3.names, prefix=self.s3.base + prefix, chunk_size=1000):
            self.s3.level.moved()
            out += batch
        return out

    # -- names ---------------------------------------------------------------
    def list_names(self) -> dict[str, dict[bytes, bytes]]:
        """One LIST of the manifests, then a GET of each whose ETag is neither in what this collector read
        nor in the last run's state (``gc_state``): a run with nothing changed reads no manifest."""
        def get() -> dict[str, dict[bytes, bytes]]:
            if self._state is None:
                self._state = self._load_state()
            listed: dict[str, str] = {}
            for meta in self._list("names/"):
                rest = meta["path"][len(self.s3.base + "names/"):]
                if not rest.endswith("#"):
                    continue
                parts = [p for p in rest[:-1].split("/") if p]
                try:
                    names = [unquote_component(p) for p in parts if p.startswith("~")]
                except UnicodeError:
                    continue
                if len(names) == len(parts):
                    listed["/".join(names)] = meta.get("e_tag") or ""
            todo = []
            for d, etag in listed.items():
                if etag and self._manifests.get(d, ("", {}))[0] == etag:
                    continue
                kept = self._state.get(d)
                if etag and kept is not None and kept[0] == etag and gc_state.proven(etag, kept[1]):
                    self._manifests[d] = (etag, self.s3.decode_manifest(d, kept[1]))
                    self._bodies[d] = kept
                else:
                    todo.append(d)
            for d, (raw, etag, data) in zip(todo, self.s3.parallel(self.s3.read_manifest_data, todo)):
                self._manifests[d] = (etag or "", raw)
                if etag and data is not None and gc_state.proven(etag, data):
                    self._bodies[d] = (etag, data)
                else:
                    self._bodies.pop(d, None)
            self._listed = listed
            return {d: self._manifests[d][1] for d in listed if self._manifests[d][1]}

        return self.s3.call(get)

    def _load_state(self) -> dict[str, tuple[str, bytes]]:
        """The last run's state; none (every manifest read) when absent, and when it is no state (counted)."""
        got = self.s3.get_object(self.s3.names, gc_state.STATE_KEY, gc_state.MAX_STATE_BYTES)
        if got is None:
            return {}
        try:
            if got[0] is None:
                raise ValueError(f"larger than {gc_state.MAX_STATE_BYTES} bytes")
            return gc_state.decode(got[0])
        except ValueError as e:
            self.s3.count("remote_rejected")
            log.warning("the last gc's state ignored (every manifest is read): %s", e)
            return {}

    def keep_listing(self) -> None:
        """Write the state of the last listing's manifests, when it differs from the one read."""
        keep = {d: self._bodies[d] for d, etag in self._listed.items() if d in self._bodies
                and self._bodies[d][0] == etag}
        if self._state is None or keep == self._state:
            return
        data = gc_state.encode(keep)
        self.s3.call(lambda: self.s3.put_object(self.s3.names, gc_state.STATE_KEY, data, "overwrite", len(data)))
        self._state = keep

    def names_of(self, dir_path: str) -> dict[bytes, bytes]:
        return self.s3.call(lambda: self.s3.read_manifest(dir_path)[0])

    def is_empty(self, dir_path: str) -> bool:
        return not self.names_of(dir_path)

    def _cas(self, dir_path: str, change: Any) -> int:
        """Read, change (returns how many names it changed), put ``If-Match``; again on a 412."""
        def go() -> int:
            for _ in range(CAS_ATTEMPTS):
                raw, etag = self.s3.read_manifest(dir_path)
                n = change(raw)
                if not n or self.s3.write_manifest(dir_path, raw, etag):
                    return n
                time.sleep(0.05)
            raise RemoteError(f"directory {dir_path!r}: writers kept changing it")

        return self.s3.call(go)

    def remove_names(self, dir_path: str, raw: dict[bytes, bytes]) -> int:
        def change(cur: dict[bytes, bytes]) -> int:
            gone = [n for n, v in raw.items() if cur.get(n) == v]
            for n in gone:
                del cur[n]
            return len(gone)

        return self._cas(dir_path, change)

    def put_back(self, dir_path: str, name: bytes, raw: bytes) -> None:
        def change(cur: dict[bytes, bytes]) -> int:
            if name in cur:
                return 0
            cur[name] = raw
            return 1

        self._cas(dir_path, change)

    # -- use records ------------------------------------------------------------
    def use_times(self) -> dict[str, float]:
        """Each directory's last use: the newest of its records, none later than the bucket's time of the
        object that holds it (``Last-Modified``): a writer's clock ahead never keeps a directory young."""
        def get() -> dict[str, float]:
            listed = [(m["path"][len(self.s3.base):], m) for m in self._list(USAGE)]
            records = [(k, m) for k, m in listed if is_record_key(USAGE, k) and int(m["size"]) <= MAX_USAGE_BYTES]
            self.s3.count("remote_rejected", sum(1 for k, _ in listed if is_record_key(USAGE, k)) - len(records))
            keys = [k for k, _ in records]
            metas = [m for _, m in records]
            merged: dict[str, float] = {}
            for meta, chunk in zip(metas, self.s3.parallel(self._read_usage, keys)):
                written = meta.get("last_modified")
                latest = written.timestamp() if written is not None else float("inf")
                for d, t in chunk.items():
                    merged[d] = max(min(t, latest), merged.get(d, 0.0))
            self._usage_keys, self._usage = keys, merged
            return merged

        return self.s3.call(get)

    def _read_usage(self, key: str) -> dict[str, float]:
        """One record object's directory -> time; what is not (not JSON, a time that is no time) is refused
        and counted in ``remote_rejected``."""
        got = self.s3.get_object(self.s3.names, key, MAX_USAGE_BYTES)
        if got is None:
            return {}
        try:
            d = json.loads(got[0]) if got[0] is not None else None
        except (ValueError, RecursionError):
            d = None
        if not isinstance(d, dict):
            self.s3.count("remote_rejected")
            return {}
        out = {k: t for k, v in d.items() if isinstance(k, str) and (t := ages.use_time(v)) is not None}
        self.s3.count("remote_rejected", len(d) - len(out))
        return out

    def adopt(self, dirs: list[str], when: float, *, replace: bool = False) -> None:
        self.s3.record_use(dict.fromkeys(dirs, when))  # a later one is bounded by its object's time (use_times)

    def forget_use(self, dirs: list[str]) -> None:
        """Drop deleted directories' records; many record objects are merged into one (newer ones stay)."""
        if not dirs and len(self._usage_keys) <= USAGE_COMPACTED:
            return
        keep = {d: t for d, t in self._usage.items() if d not in set(dirs)}

        def compact() -> None:
            data = json.dumps(keep, sort_keys=True).encode(errors="surrogateescape")
            self.s3.put_object(self.s3.names, record_key(USAGE), data, "create", len(data))
            self.s3.parallel(lambda key: obstore_api().delete(self.s3.names, self.s3.base + key), self._usage_keys)
            self.s3.level.moved(requests=len(self._usage_keys))

        self.s3.call(compact)

    # -- blobs -------------------------------------------------------------------
    def containers(self, *, adopt: bool = True) -> list[Container]:
        """Blob objects (kept by their hash) and packs (kept by their id: an entry locating a blob in it)."""
        def get() -> list[Container]:
            out = []
            for meta in self._list("blobs/"):
                h = meta["path"].rpartition("/")[2]
                if is_hex_digest(h) and meta["path"] == self.s3.base + self.s3.blobs.blob_key(h):
                    out.append(Container(h, (h,), int(meta["size"]), meta["last_modified"].timestamp()))
            for meta in self._list("packs/"):
                p = meta["path"].rpartition("/")[2]
                if is_pack_id(p) and meta["path"] == self.s3.base + pack_key(p):
                    out.append(Container(p, (p,), int(meta["size"]), meta["last_modified"].timestamp(), "pack"))
            return out

        return self.s3.call(get)

    def delete_container(self, c: Container, older_than: float) -> int | None:
        key = self.s3.base + (pack_key(c.id) if c.kind == "pack" else self.s3.blobs.blob_key(c.id))
        if time.monotonic() - self._swept_at > ages.GC_RUN_SECONDS / 2:
            self.begin_sweep()  # renewed: writers ignore a marker older than GC_RUN_SECONDS (a dead gc's)

        def delete() -> int | None:
            meta = self.s3.unless_absent(lambda: obstore_api().head(self.s3.quick, key))
            if meta is None or meta["last_modified"].timestamp() >= older_than:
                return None  # gone already, or written again since it was listed
            obstore_api().delete(self.s3.quick, key)
            self.s3.level.moved()
            return int(meta["size"])

        return self.s3.call(delete)

    def begin_sweep(self) -> None:
        """Write this run's marker (again: renewed while the sweep lasts)."""
        self._sweep_key = self._sweep_key or record_key(SWEEPS)
        self.s3.call(lambda: self.s3.put_object(self.s3.names, self._sweep_key, b"gc", "overwrite", 2))
        self._swept_at = time.monotonic()

    def end_sweep(self) -> None:
        """Delete this run's marker, and those of dead runs (older than writers heed): a run still sweeping
        keeps its own."""
        key, self._sweep_key = self._sweep_key, ""

        def delete() -> None:
            now = self.s3.clock.now()
            dead = [m["path"] for m in self._list(SWEEPS) if is_record_key(SWEEPS, m["path"][len(self.s3.base):])
                    and not ages.younger(object_age(m, now), ages.GC_RUN_SECONDS)]
            for path in [self.s3.base + key, *dead]:
                obstore_api().delete(self.s3.names, path)
            self.s3.level.moved(requests=1 + len(dead))

        if key:
            self.s3.call(delete)

    def write_summary(self, data: bytes) -> None:
        self.s3.call(lambda: self.s3.put_object(self.s3.names, "gc", data, "overwrite", len(data)))
