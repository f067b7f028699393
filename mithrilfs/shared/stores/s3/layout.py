"""The keys of one namespace in a bucket: the names it reserves, and which keys are its own records.

Under ``s3://BUCKET/PREFIX/NAMESPACE/`` a fleet keeps the directories
``names/``, ``packs/``, ``blobs/``, ``startup/``, ``changes/``,
``purges/``, ``usage/``, ``bad/`` and ``gc-sweeps/`` and the objects
``epoch``, ``feed``, ``gc``, ``gc-state`` and ``gc-sweep`` (``stores.s3.store``'s module doc).  A listing
of a directory returns every key below it, whoever wrote it: gc and every
pruning take (read, merge, delete) only the keys that parse as their own
record format, the rest they leave alone.  And a ``--remote`` whose
namespace would lie inside another fleet's reserved directories is
refused (``nested_in``): that fleet's gc and pruning own what is there.

Redis needs no such rule: a namespace's keys all begin ``mfs:NAMESPACE:``
and a namespace holds no ``:`` (letters, digits, ``-``, ``_``, ``.``), so
no namespace's keys lie among another's.
"""

from __future__ import annotations

import re
import secrets
import time

from mithrilfs.shared.stores.s3.settings import S3Location

#: The top-level names of a namespace: its directories and its single objects.
RESERVED = frozenset({"names", "packs", "blobs", "startup", "changes", "purges", "usage", "bad", "gc-sweeps",
                      "epoch", "feed", "gc", "gc-state", "gc-sweep"})
#: Use records (``usage``): one object per node flush, merged (and compacted) by ``fleet gc``.
USAGE = "usage/"
#: A running ``fleet gc``'s sweep marker, one per run (``s3_gc``): writers hold their names back while one is young.
SWEEPS = "gc-sweeps/"
#: A record key's name below its directory: the writer's time_ns (or an inverted version), then a random tail.
_RECORD_NAME = re.compile(r"\d{20}-[0-9A-Za-z]{1,64}")


def record_key(directory: str, stamp: int | None = None) -> str:
    """A new record key in *directory* (``usage/``, ``gc-sweeps/``): dated *stamp* (default: now, in ns)."""
    return f"{directory}{time.time_ns() if stamp is None else stamp:020d}-{secrets.token_hex(6)}"


def is_record_key(directory: str, key: str) -> bool:
    """Whether *key* (relative to the namespace) is one of *directory*'s records: not a key below it that
    another fleet nested there, or anyone, left."""
    return key.startswith(directory) and _RECORD_NAME.fullmatch(key[len(directory):]) is not None


def nested_in(location: S3Location, namespace: str) -> str | None:
    """Why the namespace's place in the bucket lies inside another fleet's reserved directories (one line),
    or None: ``PREFIX/NAMESPACE`` with a reserved name after its first component."""
    parts = [*location.prefix.split("/"), namespace] if location.prefix else [namespace]
    for i in range(1, len(parts)):
        if parts[i] in RESERVED:
            owner = S3Location(location.bucket, "/".join(parts[:i - 1])).shown(None)
            return (f"{location.shown(None)} (namespace {namespace!r}) lies inside {parts[i]!r} of the fleet at "
                    f"{owner} (namespace {parts[i - 1]!r}), whose gc and pruning own what is there: choose a prefix "
                    "outside it")
    return None
