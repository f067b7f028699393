"""The descriptor limit of the daemon and its supervisor.

Both hold a descriptor per file being written (a memfd mirror or a staging
file, ``cache.writepath``): thousands while a compile writes its cache,
more than the usual soft limit of 1024.
"""

from __future__ import annotations

import logging
import resource

log = logging.getLogger(__name__)


def raise_fd_limit() -> None:
    """Raise this process's descriptor limit to its hard limit (best effort)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
        except (ValueError, OSError) as e:
            log.debug("cannot raise the descriptor limit: %s", e)
