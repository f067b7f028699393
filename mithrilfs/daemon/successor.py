"""A daemon started by the supervisor on a live mount: ``python -m mithrilfs.daemon.successor``.

Its ``Handover`` (``daemon.channel``) comes as JSON on stdin; it serves the
inherited fd like the daemon before it (``lifecycle.serve``), from the code
installed now.  It logs where its predecessor did: the store's log, or
stderr for a ``--foreground`` mount.
"""

from __future__ import annotations

import logging
import os
import sys

from mithrilfs.daemon import lifecycle
from mithrilfs.daemon.channel import Handover

log = logging.getLogger(__name__)


def main() -> int:
    handover = Handover.loads(sys.stdin.read())
    opts = lifecycle.MountOptions.from_json(handover.options)
    devnull = os.open(os.devnull, os.O_RDONLY)
    os.dup2(devnull, 0)
    os.close(devnull)
    if opts.foreground:
        lifecycle.setup_logging(None, opts.debug)

    def announce(msg: str) -> None:
        if not msg.startswith("ok"):
            log.error("the new daemon could not take over: %s", msg)

    return lifecycle.serve(opts, announce, log_in_store=not opts.foreground, handover=handover)


if __name__ == "__main__":
    sys.exit(main())
