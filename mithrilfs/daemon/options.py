"""What a mount is asked for: the options ``mount`` gives its daemon, and a successor inherits.

They travel as JSON (``as_json``, ``from_json``) from the daemon to its
supervisor and on to a successor, which serves with exactly the same ones.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from mithrilfs.cache.policy import EvictionPolicy
from mithrilfs.daemon.owner import Owner
from mithrilfs.shared.stores.connect import RemoteSpec
from mithrilfs.shared.stores.s3.settings import S3Settings


@dataclass
class MountOptions:
    mountpoint: Path
    store: Path
    foreground: bool = False
    allow_other: bool = False
    debug: bool = False
    policy: EvictionPolicy = field(default_factory=EvictionPolicy)
    metrics_port: int | None = None
    remote: str | None = None
    #: A bucket behind the Redis of ``remote`` (``--remote redis://... --remote s3://...``).
    remote_behind: str | None = None
    #: The bucket's endpoint, region and credentials (``s3_settings.S3Settings.as_json``): secrets, like the
    #: password, travel only between the CLI, the daemon and its supervisor.
    remote_s3: dict[str, Any] | None = None
    remote_namespace: str = "default"
    remote_key: bytes | None = None
    #: Kept out of the URL (and so out of the process list and the logs).
    remote_password: str | None = None
    remote_cluster: bool = False
    #: Owner of entries materialized from the shared tier (default: the mount root's).
    remote_owner: tuple[int, int] | None = None
    #: The startup set this mount records its workload's first reads into.
    startup_set: str = "default"
    #: A startup set to prefetch once the mount serves (by default the recorded one; None: ``--no-prefetch``).
    prefetch: str | None = None
    #: Nobody waits for that prefetch (the default, not ``--prefetch``): it runs in the background.
    prefetch_background: bool = False
    #: Mount over a directory that holds files (hiding them).
    nonempty: bool = False
    #: Settings (``settings.SETTINGS`` names) given on the command line: they beat the store's.
    fixed_settings: frozenset[str] = frozenset()
    #: What the supervisor does when the daemon dies: start a successor ("takeover") or detach ("detach").
    on_crash: str = "takeover"
    #: The process the mount is for (``run``): when it is gone, the supervisor takes the mount down.
    owner: Owner | None = None
    #: FUSE passthrough for large committed files (``fs.passthrough.MODES``: "on" or "off").
    passthrough: str = "off"

    def remote_spec(self) -> RemoteSpec:
        """The shared store these options name (``remote`` must be set)."""
        assert self.remote is not None
        return RemoteSpec(self.remote, self.remote_namespace, self.remote_key, self.remote_password,
                          self.remote_cluster, self.remote_behind,
                          S3Settings.from_json(self.remote_s3) if self.remote_s3 is not None else None)

    def as_json(self) -> dict[str, Any]:
        """Everything a successor needs to serve like this daemon (secrets included: see ``daemon.channel``)."""
        d = {k: v for k, v in vars(self).items() if k not in ("policy", "fixed_settings", "remote_key", "owner")}
        d.update(mountpoint=str(self.mountpoint), store=str(self.store), policy=dataclasses.asdict(self.policy),
                 fixed_settings=sorted(self.fixed_settings),
                 remote_key=self.remote_key.hex() if self.remote_key is not None else None,
                 owner=self.owner.as_json() if self.owner is not None else None)
        return d

    @classmethod
    def from_json(cls, d: dict[str, Any]) -> MountOptions:
        d = dict(d)
        d.update(mountpoint=Path(d["mountpoint"]), store=Path(d["store"]), policy=EvictionPolicy(**d["policy"]),
                 fixed_settings=frozenset(d["fixed_settings"]),
                 remote_key=bytes.fromhex(d["remote_key"]) if d["remote_key"] is not None else None,
                 remote_owner=tuple(d["remote_owner"]) if d["remote_owner"] is not None else None,
                 owner=Owner.from_json(d.get("owner")))
        return cls(**{f.name: d[f.name] for f in dataclasses.fields(cls) if f.name in d})
