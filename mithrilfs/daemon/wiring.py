"""The one place the object graph of a mount is built: every collaborator is made here and passed in.

Nothing is patched after construction and no collaborator gets a bound
method of the filesystem back (s3ql's ``mount()`` builds its objects the
same way).  One list closes the graph: the write path tells
``commit_listeners`` after every commit (the budget keeps to itself, the
shared tier publishes); it is filled here once both exist.  Which shared tier the mount
has (none, or a ``wire.RemoteStore``: Redis, a bucket, both) is decided here and nowhere else.
"""

from __future__ import annotations

from dataclasses import dataclass

import trio

from mithrilfs.cache.budget import Budget
from mithrilfs.cache.create_journal import CreateJournal
from mithrilfs.cache.integrity import Integrity
from mithrilfs.cache.lifetime import KernelCaches, Lifetimes
from mithrilfs.cache.lookups import LookupCounts
from mithrilfs.cache.names import Names
from mithrilfs.cache.policy import EvictionPolicy
from mithrilfs.cache.readahead import ReadAhead
from mithrilfs.cache.recency import Recency
from mithrilfs.cache.recompiles import Recompiles
from mithrilfs.cache.writepath import CommitListener, WritePath
from mithrilfs.control.commands import Commands
from mithrilfs.control.files import ControlFiles
from mithrilfs.control.node import ControlNode
from mithrilfs.daemon.channel import NoSupervisor, Restarts, Supervisor
from mithrilfs.daemon.duties import Duties
from mithrilfs.fs import Operations, Parts
from mithrilfs.fs.passthrough import HeldTables, Passthrough
from mithrilfs.kernel import AfterReply, BackingFiles, RequestTimes
from mithrilfs.observe.events import EventLog
from mithrilfs.observe.stats import KeptCounters
from mithrilfs.observe.tops import TopDirs
from mithrilfs.shared.remote_tier import RemoteTier
from mithrilfs.shared.stores.base import RemoteStore
from mithrilfs.shared.stores.connect import open_feed
from mithrilfs.shared.tier import NullTier, Tier
from mithrilfs.store.namespace import DirPaths
from mithrilfs.store.open import Store

#: Worker threads for hashing, copying and index scans, shared by everything that offloads.
OFFLOAD_THREADS = 2


@dataclass
class TierOptions:
    """The shared tier a mount asked for (``mount --remote ...``); ``remote`` None: none."""

    remote: RemoteStore | None = None
    owner: tuple[int, int] | None = None
    startup_set: str = "default"
    prefetch: str | None = None
    prefetch_background: bool = False


@dataclass
class Mounted:
    """What serving a mount needs: the filesystem, its duties, and the tier (the session asks if it is slow)."""

    ops: Operations
    duties: Duties
    tier: Tier
    events: EventLog
    #: The control directory's files: the daemon adds the one that needs the session (``restart``).
    control: ControlFiles
    #: Where the session counts its requests (``stats`` shows them).
    request_times: RequestTimes
    #: What the handlers leave for the session to run after their reply.
    after_reply: AfterReply
    #: Which opens the kernel serves from the blob (the session asks it whether INIT asks for it).
    passthrough: Passthrough


def build(store: Store, policy: EvictionPolicy, kernel: KernelCaches, tier_options: TierOptions | None = None, *,
          after_crash: bool = False, fixed_settings: frozenset[str] = frozenset(),
          supervisor: Supervisor | None = None, restarts: Restarts | None = None,
          lookups: LookupCounts | None = None, journal: CreateJournal | None = None, passthrough: str = "off",
          backing: BackingFiles | None = None, held: HeldTables | None = None) -> Mounted:
    """The filesystem of *store*, with every collaborator it needs (see the module doc).

    *passthrough* is a ``fs.passthrough.MODES`` mode; *backing* registers backing files on the mount's
    connection (none: no passthrough); *held* is the connection's tables of what the kernel holds
    (``fs.passthrough.held_table``).
    """
    tier_options = tier_options or TierOptions()
    ns, blobs = store.ns, store.blobs
    limiter = trio.CapacityLimiter(OFFLOAD_THREADS)
    kept = KeptCounters(ns, read_only=store.read_only)
    stats = kept.stats
    request_times = RequestTimes()
    stats.requests = request_times
    events = EventLog(None if store.read_only else store.root / "events.jsonl")
    paths = DirPaths(ns)
    tops = TopDirs(ns, paths)
    commit_listeners: list[CommitListener] = []
    supervisor = supervisor or NoSupervisor()
    writes = WritePath(ns, blobs, stats, limiter, commit_listeners, supervisor)
    recency = Recency(ns)
    lifetimes = Lifetimes(ns, blobs, recency, writes.staged.__contains__, kernel, lookups)

    recompiles = Recompiles(ns, paths, stats, events, tops)
    tier: Tier = NullTier()
    if tier_options.remote is not None:
        tier = RemoteTier(ns, blobs, paths, events, lifetimes, tier_options.remote, policy, writes.physical,
                         recompiles, owner=tier_options.owner, requeue=after_crash,
                         startup_set=tier_options.startup_set, prefetch_at_start=tier_options.prefetch,
                         prefetch_background=tier_options.prefetch_background,
                         feed=open_feed(tier_options.remote))
    budget = Budget(store, policy, writes, lifetimes, recency, stats, events, tops, evicted=tier)
    commit_listeners += [tier, budget, recompiles]
    integrity = Integrity(store, lifetimes, budget, tier, stats, events, tops, limiter, ReadAhead(blobs, stats))
    after_reply = AfterReply()
    passthrough_choice = Passthrough(passthrough, backing, integrity, writes, lifetimes, tier, held)
    control = ControlFiles()
    duties = Duties(store, budget, writes, lifetimes, recency, tier, kept, events, restarts or Restarts(),
                    recompiles, supervisor)
    control.add_json_async(b"stats.json", duties.fresh_snapshot)
    Commands(store, budget, writes, tier, kept, paths, limiter, fixed_settings=fixed_settings).register(control)
    ops = Operations(Parts(store=store, writes=writes, lifetimes=lifetimes, recency=recency, budget=budget,
                           integrity=integrity, tier=tier, control=ControlNode(control), stats=stats, events=events,
                           tops=tops, names=Names(ns, writes, lifetimes, tops, tier, journal, after_reply.when_idle),
                           recompiles=recompiles,
                           after_reply=after_reply, passthrough=passthrough_choice))
    return Mounted(ops=ops, duties=duties, tier=tier, events=events, control=control, request_times=request_times,
                   after_reply=after_reply, passthrough=passthrough_choice)
