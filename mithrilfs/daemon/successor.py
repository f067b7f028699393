"""A daemon started by the supervisor on a live mount: ``python -m mithrilfs.daemon.successor``.

Its ``Handover`` (``daemon.channel``) comes as JSON on stdin; it serves the
inherited fd like the daemon before it (``serve.serve``), from the code
installed now.  It logs where its predecessor did: the store's log, or
stderr for a ``--foreground`` mount.

``--check`` imports everything a daemon serves with and exits 0 without
touching any mount: ``restart`` runs it first (``daemon.upgrade``), so a
broken install is refused while the old daemon still serves, instead of
being found by a successor that dies on a mount nobody serves any more.
"""

from __future__ import annotations

import logging
import os
import sys

from mithrilfs import __version__
from mithrilfs.daemon.channel import Handover
from mithrilfs.daemon.options import MountOptions
from mithrilfs.daemon.serve import serve, setup_logging

log = logging.getLogger(__name__)


def main(argv: list[str]) -> int:
    if argv == ["--check"]:
        print(f"mithrilfs {__version__} starts")
        return 0
    handover = Handover.loads(sys.stdin.read())
    opts = MountOptions.from_json(handover.options)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    if opts.foreground:
        setup_logging(None, opts.debug)

    def announce(msg: str) -> None:
        if not msg.startswith("ok"):
            log.error("the new daemon could not take over: %s", msg)

    return serve(opts, announce, log_in_store=not opts.foreground, handover=handover)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
