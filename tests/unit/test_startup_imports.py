"""The command line loads the daemon's modules for ``mount`` and ``run`` alone, and the supervisor never.

Every other command (``status``, ``umount``, ``gc``, ``push``, ...) acts on a
mount through its control files and needs neither the request loop, the
write path nor trio; the supervisor, started with every mount and living as
long as it, implements one interface of the write path (``WriteWatcher``)
and keeps what INIT agreed, and needs none of them either.  What this saves is in
docs/design.md ("Layers")."""

from __future__ import annotations

import json
import subprocess
import sys

HEAVY = ("trio", "mithrilfs.kernel.session", "mithrilfs.cache.writepath", "mithrilfs.daemon.launch",
         "mithrilfs.daemon.serve", "mithrilfs.shared.remote_tier")


def heavy_modules_loaded_by(module: str) -> list[str]:
    """Which of ``HEAVY`` a fresh interpreter holds after importing *module*."""
    probe = f"import json, sys\nimport {module}\nprint(json.dumps([m for m in {HEAVY!r} if m in sys.modules]))"
    res = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr
    return json.loads(res.stdout)


def test_the_command_line_starts_without_the_daemons_modules():
    assert heavy_modules_loaded_by("mithrilfs.cli.main") == []


def test_the_request_loop_still_loads_where_it_is_asked_for():
    """``kernel.Session`` and the names beside it load on first use (``kernel.__getattr__``)."""
    probe = ("import sys\nfrom mithrilfs import kernel\nassert 'trio' not in sys.modules\n"
             "from mithrilfs.kernel import ProtocolError, Session, URING_VARIABLE\n"
             "assert Session.__module__ == 'mithrilfs.kernel.session' and 'trio' in sys.modules\n"
             "assert kernel.Session is Session and isinstance(URING_VARIABLE, str)\n"
             "try:\n    kernel.NoSuchThing\nexcept AttributeError:\n    pass\nelse:\n    raise SystemExit('no error')\n")
    res = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, timeout=60)
    assert res.returncode == 0, res.stderr


def test_the_supervisor_starts_without_trio_or_the_write_path():
    assert heavy_modules_loaded_by("mithrilfs.daemon.supervisor") == []
