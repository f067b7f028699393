"""``push`` and ``prefetch``: moving files between a mount and its shared tier, with progress drawn.

Both ask the mount's daemon and then follow its stats until the work is
done; a daemon replaced meanwhile (a crash, a restart) is asked again.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

from mithrilfs.cli.client import (
    DaemonChanged,
    progress_bar,
    read_stats,
    tier_command,
)
from mithrilfs.units import format_size


def _cmd_prefetch(args: argparse.Namespace) -> int:
    """Start the prefetch asked for, or join the same one running (the mount's background one, another
    command's), and follow it to its result."""
    mp = args.mountpoint.expanduser().absolute()
    request = "all" if args.all else f"set={args.set}"
    try:
        answer = ask_prefetch(mp, request)
    except DaemonChanged:  # the daemon that started it died before answering: following asks its successor
        answer = {"started": True}
    if not answer.get("started"):
        print(f"mithrilfs: error: cannot prefetch: {answer['error']}", file=sys.stderr)
        return 1
    return follow_prefetch(mp, request, run=answer.get("run"))


#: How often a prefetch is asked again of a daemon that replaced the one running it (a crash loop ends it).
PREFETCH_RESUMES = 5
#: How often a followed prefetch's state is read: each read makes the daemon build its whole snapshot
#: (``stats.json``: the index's totals, the tier's counters); ten a second were a tenth of the daemon's
#: time during a prefetch (py-spy).
FOLLOW_SECONDS = 0.25


def ask_prefetch(mp: Path, request: str) -> dict:
    """Ask the mount for a prefetch (*request*, as the command takes it); its answer.  While one of
    another set runs, the mount refuses it (``busy``): that one is waited for, then this one asked again."""
    while True:
        answer = tier_command(mp, "prefetch", request)
        if "busy" not in answer:
            return answer
        print(f"mithrilfs: {answer['error']}: this one starts when it ends", file=sys.stderr)
        while read_stats(mp).get("prefetch", {}).get("state") == "running":
            time.sleep(FOLLOW_SECONDS)


def follow_prefetch(mp: Path, request: str, *, run: int | None = None, warn_only: bool = False) -> int:
    """Wait for the mount's prefetch number *run* (None: the one the mount shows), drawing its progress on
    a terminal; print its summary.  One that ended while another began since is in that one's state
    (``earlier``).

    A daemon that takes a mount over (a crash, a restart) does not go on with its predecessor's prefetch:
    its state is "idle".  The prefetch (*request*, as the command takes it) is then asked again; what the
    first daemon fetched is local already and is not fetched twice.
    """
    draw = progress_bar("prefetching")
    resumes = 0
    while True:
        state = read_stats(mp).get("prefetch", {})
        if state.get("state") == "idle" and resumes < PREFETCH_RESUMES:
            resumes += 1
            try:
                answer = ask_prefetch(mp, request)
            except DaemonChanged:  # replaced again between asking and answering: the next look asks again
                continue
            if not answer.get("started"):
                state = {"state": "failed", "error": answer.get("error")}
                break
            run = answer.get("run")
            continue
        run = state.get("run") if run is None else run
        if state.get("run") not in (None, run):  # it ended, and another began since
            state = next((s for s in state.get("earlier", []) if s.get("run") == run),
                         {"state": "failed", "error": "later prefetches ended before its result was read"})
            break
        if state.get("state") != "running":
            break
        if draw and state.get("total_files"):
            draw(min(state["files"] + state["misses"], state["total_files"]), state["total_files"])
        time.sleep(FOLLOW_SECONDS)
    if state.get("state") != "done":
        print(f"mithrilfs: {'warning' if warn_only else 'error'}: prefetch failed: {state.get('error')}",
              file=sys.stderr)
        return 0 if warn_only else 1
    rate = state["bytes"] / max(state["seconds"], 1e-3)
    print(f"prefetched {state['files']} files, {format_size(state['bytes'])} in {state['seconds']:.1f} s "
          f"({format_size(int(rate))}/s); {state['misses']} misses"
          + (f", {state['skipped_for_budget']} left out for the budget" if state["skipped_for_budget"] else ""),
          file=sys.stderr if warn_only else sys.stdout)
    return 0


def _cmd_push(args: argparse.Namespace) -> int:
    mp = args.mountpoint.expanduser().absolute()
    start = read_stats(mp)
    answer = tier_command(mp, "push", "push")
    if "error" in answer:
        print(f"mithrilfs: error: cannot push: {answer['error']}", file=sys.stderr)
        return 1
    queued = answer["queued"]
    draw = progress_bar("uploading")
    last_left, progress_at = None, time.monotonic()
    while True:
        snap = read_stats(mp)
        left = snap["upload_queue"]
        if draw:
            draw(queued - min(left, queued), queued)
        if left == 0:
            break
        if left != last_left:
            last_left, progress_at = left, time.monotonic()
        elif snap["remote_last_error"] and time.monotonic() - progress_at > PUSH_STALL_SECONDS:
            print(f"mithrilfs: error: cannot push: {snap['remote_last_error']}; {left} files still queued"
                  " (kept, sent when the shared tier answers)", file=sys.stderr)
            return 1
        time.sleep(0.2)
    sent = snap["remote_uploaded_bytes"] - start["remote_uploaded_bytes"]
    print(f"pushed {queued} files; {format_size(sent)} of new blobs uploaded")
    return 0


#: ``push`` gives up after this long without progress while the tier reports errors.
PUSH_STALL_SECONDS = 5.0


#: Each command's function, by the name the parser gives it.
COMMANDS = {"push": _cmd_push, "prefetch": _cmd_prefetch}
