"""``mithrilfs``: dispatch a command; user mistakes end with one line on stderr, never a traceback.

Exit status 2 for bad usage, 1 when the operation failed.
"""

from __future__ import annotations

import logging
import os
import sys
from collections.abc import Sequence

from mithrilfs.cli import (
    cache_commands,
    fleet_commands,
    forget_command,
    jit_commands,
    mount_commands,
    store_commands,
    store_settings,
    tier_commands,
)
from mithrilfs.cli.parser import build_parser
from mithrilfs.errors import MountError, UsageError
from mithrilfs.store.open import StoreError


def main(argv: Sequence[str] | None = None) -> int:
    # a library's warning (a shared tier that does not answer) is the command's to word, in one line
    logging.getLogger("mithrilfs").addHandler(logging.NullHandler())
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:  # ``mithrilfs`` alone
        parser.print_help()
        return 2
    if args.command in ("fsck", "import", "config", "export"):
        os.umask(0o077)  # files they add to a store are private, like the daemon's; an archive too
    try:
        commands = {**mount_commands.COMMANDS, **cache_commands.COMMANDS, **store_commands.COMMANDS,
                    **tier_commands.COMMANDS, **store_settings.COMMANDS, **jit_commands.COMMANDS,
                    **fleet_commands.COMMANDS, **forget_command.COMMANDS}
        return commands[args.command](args)
    except UsageError as e:
        print(f"mithrilfs: error: {e}", file=sys.stderr)
        return 2
    except (MountError, StoreError) as e:
        print(f"mithrilfs: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # ``mithrilfs stats --watch 1 MNT | head -3``: the reader is done
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        return 0
    except OSError as e:  # what no command foresaw (a path too long for the kernel, say): one line, not a traceback
        name = str(e.filename) if e.filename is not None else ""
        if len(name) > 100:
            name = f"{name[:60]}...({len(name)} bytes)"
        print(f"mithrilfs: error: {name + ': ' if name else ''}{e.strerror or e}", file=sys.stderr)
        return 1

