"""The client's bytes cut into requests, to count them: HTTP/1.x and RESP framing, fed in arbitrary pieces.

Only the framing is parsed (what ``delay_proxy`` needs to count requests
and to answer one itself); bytes that are not the protocol raise
``Unparsable`` and the proxy passes them on uncounted.
"""

from __future__ import annotations

from collections.abc import Callable
from urllib.parse import urlsplit

#: A request line, header line or RESP header longer than this is not the protocol we parse.
MAX_LINE = 64 * 1024
#: Bytes of a Redis command's name kept for counting.
MAX_NAME = 32


class Unparsable(Exception):
    """The client's bytes are not the protocol the proxy was told to count."""


class Lines:
    """The line being read from a stream fed in pieces: its bytes gathered up to its newline."""

    def __init__(self) -> None:
        self._line = bytearray()

    @property
    def started(self) -> bool:
        """Whether some bytes of a line came already (the line began in an earlier piece)."""
        return bool(self._line)

    def take(self, data: bytes, i: int) -> tuple[bytes | None, int]:
        """The line that ends in *data* at or after *i* (without its CR LF) and where the rest begins; (None,
        the end of *data*) when *data* ends first, its bytes kept for the next piece.  ``Unparsable`` for a
        line over ``MAX_LINE``."""
        j = data.find(b"\n", i)
        if j < 0:
            self._line += data[i:]
            if len(self._line) > MAX_LINE:
                raise Unparsable("line too long")
            return None, len(data)
        self._line += data[i:j]
        line = bytes(self._line).rstrip(b"\r")
        self._line.clear()
        return line, j + 1


class HttpRequests:
    """Counts HTTP/1.x requests in a client's byte stream, fed in arbitrary pieces.

    Only the framing is parsed: the request line, the headers that say how
    long the body is, and the body's length (Content-Length, or chunked
    with its trailers).  Bodies are skipped without being copied.
    """

    def __init__(self, on_request: Callable[[str, str, int], None],
                 on_end: Callable[[int], None] = lambda _end: None) -> None:
        self._on_request = on_request
        self._on_end = on_end
        self._lines = Lines()
        self._line_at = 0  # where the line being read began in the stream
        self._fed = 0  # bytes of the stream fed before this piece
        self._state = "request"
        self._left = 0  # body bytes still to skip, in state "body" / "chunk"
        self._chunked = False
        self._length = 0

    def feed(self, data: bytes) -> None:
        """Parse the next piece of the stream: ``on_request(method, target, at)`` at each request line (*at*:
        where the request begins in the stream), ``on_end(at)`` once its last byte is in (*at*: just after it)."""
        base, self._fed = self._fed, self._fed + len(data)
        i, n = 0, len(data)
        while i < n:
            if self._state in ("body", "chunk"):
                take = min(self._left, n - i)
                self._left -= take
                i += take
                if self._left == 0:
                    if self._state == "chunk":
                        self._state = "chunk_end"
                    else:
                        self._ended(base + i)
                continue
            if not self._lines.started:
                self._line_at = base + i
            line, i = self._lines.take(data, i)
            if line is None:
                return
            self._on_line(line, base + i)

    def _ended(self, at: int) -> None:
        self._state = "request"
        self._on_end(at)

    def _on_line(self, line: bytes, end: int) -> None:
        if self._state == "request":
            if not line:
                return  # RFC 9112: a server ignores empty lines before a request line
            parts = line.split(b" ")
            if len(parts) != 3 or not parts[2].startswith(b"HTTP/"):
                raise Unparsable(f"not a request line: {line[:80]!r}")
            self._on_request(parts[0].decode("latin-1"), parts[1].decode("latin-1"), self._line_at)
            self._state, self._chunked, self._length = "headers", False, 0
        elif self._state == "headers":
            if line:
                name, _, value = line.partition(b":")
                name = name.strip().lower()
                if name == b"transfer-encoding" and b"chunked" in value.lower():
                    self._chunked = True
                elif name == b"content-length":
                    try:
                        self._length = int(value.strip())
                    except ValueError:
                        raise Unparsable(f"bad Content-Length: {value[:40]!r}") from None
            elif self._chunked:
                self._state = "chunk_size"
            elif self._length > 0:
                self._state, self._left = "body", self._length
            else:
                self._ended(end)
        elif self._state == "chunk_size":
            try:
                size = int(line.split(b";", 1)[0].strip(), 16)
            except ValueError:
                raise Unparsable(f"bad chunk size: {line[:40]!r}") from None
            if size == 0:
                self._state = "trailers"
            else:
                self._state, self._left = "chunk", size
        elif self._state == "chunk_end":
            if line:
                raise Unparsable("chunk data longer than its size")
            self._state = "chunk_size"
        elif self._state == "trailers" and not line:
            self._ended(end)


class RedisCommands:
    """Counts Redis commands (RESP arrays of bulk strings, or inline commands) in a client's byte stream."""

    def __init__(self, on_command: Callable[[str], None]) -> None:
        self._on_command = on_command
        self._lines = Lines()
        self._elements = 0  # elements of the current array still to come
        self._left = 0  # bulk bytes (with their CRLF) still to skip
        self._name: bytearray | None = None  # the first element's bytes, while they come

    def feed(self, data: bytes) -> None:
        i, n = 0, len(data)
        while i < n:
            if self._left:
                take = min(self._left, n - i)
                if self._name is not None and len(self._name) < MAX_NAME:
                    self._name += data[i:i + min(take, MAX_NAME - len(self._name))]
                self._left -= take
                i += take
                if self._left == 0:
                    self._element_done()
                continue
            line, i = self._lines.take(data, i)
            if line is None:
                return
            self._on_line(line)

    def _on_line(self, line: bytes) -> None:
        if self._elements == 0:
            if line.startswith(b"*"):
                count = self._number(line)
                if count > 0:
                    self._elements, self._name = count, bytearray()
            elif line.strip():
                self._on_command(line.split()[0].decode("latin-1").upper())
        elif line.startswith(b"$"):
            size = self._number(line)
            if size < 0:
                self._element_done()
            else:
                self._left = size + 2  # the bytes and their CRLF
        else:  # a client sends bulk strings; any other element is one line
            if self._name is not None:
                self._name += line[1:MAX_NAME]
            self._element_done()

    def _element_done(self) -> None:
        if self._name is not None:
            name = bytes(self._name).rstrip(b"\r\n")
            self._name = None
            self._on_command(name.decode("latin-1").upper() or "?")
        self._elements -= 1

    @staticmethod
    def _number(line: bytes) -> int:
        try:
            return int(line[1:])
        except ValueError:
            raise Unparsable(f"bad RESP header: {line[:40]!r}") from None


def http_method_key(method: str, target: str) -> str:
    """The method a request counts under: a GET of a bucket listing counts as LIST."""
    if method != "GET":
        return method
    parts = urlsplit(target)
    if "list-type=" in parts.query or parts.path.strip("/").count("/") == 0:
        return "LIST"
    return "GET"
