"""Text from the store, a bucket or an event log, made safe to print on a terminal.

A name can hold any byte but "/" and NUL, and a shared tier lets anyone who
can write to it plant one: printed raw, its escape sequences would drive the
reader's terminal (retitle it, clear it, hide lines).  Every human-readable
output of such text goes through ``shown``; ``--json`` output needs nothing
(``json.dumps`` escapes control characters itself).
"""

from __future__ import annotations


def shown(text: str) -> str:
    """*text* with each character a terminal would not print as itself (control characters, C1 codes,
    undecodable bytes kept as surrogates) written as its Python escape: ``\\x1b``, ``\\x9b``, ``\\udcff``."""
    if text.isprintable():
        return text
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in text)
