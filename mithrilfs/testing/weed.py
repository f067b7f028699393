"""What a SeaweedFS (``weed``) started by a test or a benchmark leaves behind it."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path


def remove_sockets(ports: Iterable[int]) -> None:
    """Remove the unix sockets a stopped ``weed`` left in /tmp for *ports*.  It makes one per service and
    port there (the gRPC ones at a fixed place: no option, not ``TMPDIR``) and removes none when killed."""
    for port in ports:
        for sock in Path("/tmp").glob(f"seaweedfs-*-{port}.sock"):
            sock.unlink(missing_ok=True)
