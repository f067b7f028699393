"""``fleet gc``: a budget for the shared tier, run from anywhere that reaches it (a CronJob, a timer).

The remote settings and secrets are resolved as ``mount`` resolves them
(``mount_commands._remote_stores``, ``_remote_password``, ``remote_key``, ``check_namespace``): the same
flags, the same AWS_* variables, the same password file or environment.
"""

from __future__ import annotations

import argparse
import json
import sys

from mithrilfs.cli.client import usage_error
from mithrilfs.cli.mount_commands import _remote_password, _remote_stores, check_namespace, remote_key
from mithrilfs.shared.stores.redis.url import without_password
from mithrilfs.units import format_duration_short, format_size


def _cmd_fleet(args: argparse.Namespace) -> int:
    from mithrilfs.shared.fleet import gc
    from mithrilfs.shared.stores import ages
    from mithrilfs.shared.stores.connect import RemoteError, RemoteSpec, collector_for, open_remote

    args.remote_owner = None  # what ``_remote_password`` checks for mount
    behind, s3 = _remote_stores(args)
    key = remote_key(args)
    check_namespace(args)
    least = ages.min_grace()
    grace = least if args.grace is None else args.grace
    if grace < least:
        usage_error(f"--grace must be at least {format_duration_short(least)}: a writer may rely on a blob"
                    " that long before its name is published (docs/design.md, Fleet gc)")
    password = _remote_password(args)
    spec = RemoteSpec(without_password(args.remote), args.remote_namespace, key, password, args.remote_cluster,
                      behind, s3)
    store = open_remote(spec)
    try:
        report = gc.run(collector_for(store), max_size=args.max_size, max_age=args.max_age, grace=grace,
                        dry_run=args.dry_run)
    except RemoteError as e:
        print(f"mithrilfs: error: fleet gc of {store.url}: {e}", file=sys.stderr)
        return 1
    finally:
        store.close()
    if args.json:
        print(json.dumps({"url": store.url, "namespace": args.remote_namespace, **report.as_json()}, sort_keys=True))
        return 0
    verb = "would delete" if report.dry_run else "deleted"
    print(f"fleet gc {store.url} (namespace {args.remote_namespace}){' -- dry run' if report.dry_run else ''}")
    print(f"  names: {verb} {report.deleted_names} in {report.deleted_dirs} directories; {report.names} in "
          f"{report.dirs} directories left, naming {format_size(report.bytes)}"
          + (f"; {report.relinked} directories re-linked" if report.relinked else ""))
    print(f"  blobs: {verb} {report.deleted_blobs} and {report.deleted_packs} packs ({format_size(report.freed_bytes)})"
          + ("" if report.dry_run else f"; {report.blobs} and {report.packs} packs left, "
             f"{format_size(report.kept_bytes)} of them unnamed but younger than the grace"
             f" ({format_duration_short(grace)})"))
    print(f"  {report.requests} requests in {report.seconds:.1f} s"
          + (f"; {report.rejected} refused as hostile (entries, manifests, use records)" if report.rejected
             else ""))
    return 0


COMMANDS = {"fleet": _cmd_fleet}
