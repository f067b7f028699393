"""A TCP proxy that adds network latency and counts requests: the shared tier as a fleet sees it.

Every shared-tier figure taken on loopback hides the price of a request: a
fleet's bucket is 10-50 ms away.  This proxy sits on a loopback port in
front of a target (SeaweedFS's S3 gateway, a redis-server) and makes each
exchange cost a chosen round-trip time, so a benchmark shows what a
request pattern costs on a real network, and it counts the requests, so
the pattern itself is visible (requests per file published or loaded).

**Where the delay goes.**  Each direction of each connection is a *delay
line*: a chunk read at time t is written on at t + RTT/2, half the round
trip on the way to the server and half on the way back, as on a symmetric
link.  Why this and not a sleep per request: a sleep per request makes a
pipeline (Redis: many commands sent together, one round trip on a real
network) cost one delay per command, and a sleep before each response
needs the responses parsed; a delay line needs neither, gives a pipeline
one round trip (its commands arrive together, so they leave together),
leaves the order and the bytes untouched, and limits no bandwidth (every
byte is late by the same RTT/2, none waits for another: only latency).  A
request/response exchange (an HTTP request on a keep-alive connection, a
Redis command or pipeline) thus costs exactly one RTT more than on
loopback.  A new connection costs ``connect_rtts`` more round trips (1: the
TCP handshake; a TLS endpoint would add one or two): its first bytes are
held that long.

**What is counted** (``counts()``), from the client's bytes as they arrive:

- ``http``: each request (request line, headers, then a body by
  Content-Length or chunked; keep-alive and pipelining aware), by method:
  GET, PUT, HEAD, POST, DELETE, and LIST (a GET of a bucket listing:
  ``?list-type=``, or a path-style path without a key); ``label`` (a function of the
  method and the target) counts them in finer groups (``labels()``);
- ``redis``: each command (RESP arrays, or inline commands), by name;
- both: ``requests``, ``connections``, ``round_trips`` (client bytes that
  arrive after the server has answered: a pipeline is one), ``bytes_up``
  and ``bytes_down``, and ``unparsed`` (connections whose bytes stopped
  parsing; they still pass, uncounted).

**SlowDown, as S3 answers a burst** (``slowdown_every``, ``slowdown_rate``;
``--slowdown-every N``, ``--slowdown-rate R``).  S3 answers ``503 Slow
Down`` (an XML error body, code ``SlowDown``) when requests to one key
prefix come faster than it has partitioned for, as under a burst of new
nodes.  The proxy answers so itself to every Nth HTTP request, and to the
requests past R in one second under one key prefix (the target's path up to
its last ``/``; with ``slowdown_depth`` D, its first D segments: 1 is the
whole bucket, as S3 partitions a new bucket, before it splits it by prefix
under load), with ``Retry-After`` when told to (``retry_after``; S3
sends none): the request's bytes never reach the server, the answer goes
back a round trip after its last byte came, and the connection stays open
for the next request.  Each such request is counted as a request and in
``slowdowns``.

**Per client, per second.**  ``add_client(name)`` opens another loopback port in front of the same
target, for one client (a node of a fleet) to use: its connections share everything with the main
port's (the delay, the SlowDown rates of each prefix) and are counted in ``counts()`` and also under
``clients()[name]``.  ``per_second(key)`` is how many ``requests`` (or ``slowdowns``) arrived in each
whole second since the start or the last ``reset()``: a burst's peak rate at the bucket.

Library (a thread runs the proxy; ``.port``, ``.counts()``, ``.reset()``; ``.hold(match)`` holds the
requests *match* picks on their way to the server until ``.release()``, for a test to act while one waits)::

    with DelayProxy("127.0.0.1", 8333, rtt_ms=20, protocol="http") as proxy:
        ... point the client at 127.0.0.1:proxy.port ...
        print(proxy.counts())

Command line (prints the port, then the counts as JSON at Ctrl-C)::

    .venv/bin/python -m mithrilfs.testing.delay_proxy 127.0.0.1:8333 --rtt-ms 20 --protocol http [--port 9333] \\
        [--slowdown-every 3] [--slowdown-rate 100] [--slowdown-depth 1] [--retry-after 1]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import html
import json
import secrets
import signal
import sys
import threading
import time
from collections import Counter
from collections.abc import Callable
from types import TracebackType
from urllib.parse import urlsplit

from mithrilfs.testing.framing import HttpRequests, RedisCommands, http_method_key

#: A read from a socket: large enough for a prefetch's throughput, small enough to keep chunks moving.
READ_SIZE = 256 * 1024
#: Chunks in flight per direction (at most READ_SIZE each): the bandwidth-delay product it allows,
#: 64 MiB per connection and direction, is far above any RTT x rate measured here.
IN_FLIGHT = 256


class DelayProxy:
    """The proxy, run by an asyncio loop in a thread of its own; a context manager.

    ``target_host``/``target_port``: where connections go; ``rtt_ms``: the
    round trip added to every exchange; ``protocol``: "http", "redis" or
    "raw" (count connections and bytes only); ``port``: 0 for a free one;
    ``label``: for HTTP, maps (method key, target) to a group ``labels()``
    counts; ``slowdown_every`` N: every Nth HTTP request is answered
    ``503 Slow Down`` by the proxy itself, ``slowdown_rate`` R: so is every
    request past R in one second under one key prefix (both 0: none;
    ``slowdown_depth`` D > 0: a prefix is the path's first D segments, the
    bucket's name the first, else all but the last), with ``Retry-After:
    retry_after`` (None: no such header).
    """

    def __init__(self, target_host: str, target_port: int, rtt_ms: float = 0.0, protocol: str = "http",
                 port: int = 0, connect_rtts: int = 1, label: Callable[[str, str], str] | None = None, *,
                 slowdown_every: int = 0, slowdown_rate: float = 0.0, slowdown_depth: int = 0,
                 retry_after: int | None = None) -> None:
        if protocol not in ("http", "redis", "raw"):
            raise ValueError(f"unknown protocol {protocol!r} (http, redis or raw)")
        if min(slowdown_every, slowdown_rate, slowdown_depth) < 0 or (retry_after is not None and retry_after < 0):
            raise ValueError("slowdown_every, slowdown_rate, slowdown_depth and retry_after cannot be negative")
        self.slowdown_depth = slowdown_depth
        self.slowdown_every = slowdown_every
        self.slowdown_rate = slowdown_rate
        self.retry_after = retry_after
        self._arrived = 0
        self._rates: dict[str, tuple[int, int]] = {}
        self.target = (target_host, target_port)
        self.rtt = rtt_ms / 1000
        self.protocol = protocol
        self.connect_rtts = connect_rtts
        self._label = label
        self._want_port = port
        self.port = 0
        self._lock = threading.Lock()
        self._counts: Counter[str] = Counter()
        self._labels: Counter[str] = Counter()
        self._clients: dict[str, Counter[str]] = {}
        self._seconds: Counter[tuple[int, str]] = Counter()
        self._origin = time.monotonic()
        self._tasks: set[asyncio.Task[None]] = set()
        self._servers: list[asyncio.Server] = []
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._stop: asyncio.Event | None = None
        self._started = threading.Event()
        self._error: BaseException | None = None
        self._open: asyncio.Event | None = None
        self._holding: Callable[[str], bool] | None = None

    # -- the library's face -------------------------------------------------------------------------

    def start(self) -> DelayProxy:
        self._thread = threading.Thread(target=self._run, name=f"delay-proxy-{self.target[1]}", daemon=True)
        self._thread.start()
        self._started.wait()
        if self._error is not None:
            raise self._error
        return self

    def close(self) -> None:
        """Stop listening and close every connection (both ends)."""
        if self._loop is not None and self._stop is not None and self._thread is not None:
            self._loop.call_soon_threadsafe(self._stop.set)
            self._thread.join(timeout=30)

    def __enter__(self) -> DelayProxy:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()

    def hold(self, match: Callable[[str], bool] = lambda _: True) -> None:
        """Hold each request that *match* picks from now on (by its label, else its method key or Redis
        command), and what its connection sends after it, until ``release()``; counted as they arrive:
        a test catches a client with a request on the wire and acts while it waits for the answer."""
        def close() -> None:
            self._holding = match
            self._gate().clear()
        self._on_loop(close)

    def release(self) -> None:
        def open_() -> None:
            self._holding = None
            self._gate().set()
        self._on_loop(open_)

    def add_client(self, name: str) -> int:
        """Open another loopback port in front of the target for the client *name*; its port.  Its
        connections are counted in ``counts()`` and under ``clients()[name]`` too."""
        assert self._loop is not None, "the proxy is not started"
        with self._lock:
            if name in self._clients:
                raise ValueError(f"the proxy has a client {name!r} already")
            self._clients[name] = Counter()
        return asyncio.run_coroutine_threadsafe(self._listen(0, name), self._loop).result(timeout=30)

    def clients(self) -> dict[str, dict[str, int]]:
        """The counters of each client's port (``add_client``) since the start or the last ``reset()``."""
        with self._lock:
            return {name: dict(c) for name, c in self._clients.items()}

    def per_second(self, key: str = "requests") -> list[int]:
        """How many *key* (``requests``, ``slowdowns``) came in each whole second since the start or the
        last ``reset()``, up to the last second one came in."""
        with self._lock:
            seconds = [s for s, k in self._seconds if k == key]
            return [self._seconds[(s, key)] for s in range(max(seconds) + 1)] if seconds else []

    def _on_loop(self, fn: Callable[[], None]) -> None:
        assert self._loop is not None, "the proxy is not started"

        async def call() -> None:
            fn()
        asyncio.run_coroutine_threadsafe(call(), self._loop).result(timeout=30)

    def _gate(self) -> asyncio.Event:
        if self._open is None:
            self._open = asyncio.Event()
            self._open.set()
        return self._open

    def counts(self) -> dict[str, int]:
        """The counters since the start or the last ``reset()``."""
        with self._lock:
            return dict(self._counts)

    def labels(self) -> dict[str, int]:
        """Requests per group of ``label`` (HTTP only)."""
        with self._lock:
            return dict(self._labels)

    def reset(self) -> None:
        with self._lock:
            self._counts.clear()
            self._labels.clear()
            self._seconds.clear()
            self._origin = time.monotonic()
            for c in self._clients.values():
                c.clear()

    def _count(self, key: str, n: int = 1, client: str | None = None) -> None:
        with self._lock:
            self._add(key, n, client)

    def _add(self, key: str, n: int, client: str | None) -> None:
        """Count (the lock held) in the totals, the client's counters and, for requests and slowdowns, the
        second's."""
        self._counts[key] += n
        if client is not None:
            self._clients[client][key] += n
        if key in ("requests", "slowdowns"):
            self._seconds[(int(time.monotonic() - self._origin), key)] += n

    # -- the loop -----------------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            asyncio.run(self._serve())
        except BaseException as e:  # reported by start() when it happens before serving
            self._error = e
            self._started.set()

    async def _serve(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        self.port = await self._listen(self._want_port, None)
        self._started.set()
        await self._stop.wait()
        for server in self._servers:
            server.close()
        for task in list(self._tasks):
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)

    async def _listen(self, port: int, client: str | None) -> int:
        """Listen on a loopback *port* (0: a free one) for *client*'s connections (None: the main port's)."""
        def accepted(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
            task = asyncio.ensure_future(self._connection(reader, writer, client))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

        server = await asyncio.start_server(accepted, "127.0.0.1", port, backlog=1024)
        self._servers.append(server)
        return int(server.sockets[0].getsockname()[1])

    async def _connection(self, c_reader: asyncio.StreamReader, c_writer: asyncio.StreamWriter,
                          client: str | None = None) -> None:
        self._count("connections", client=client)
        accepted_at = time.monotonic()
        try:
            s_reader, s_writer = await asyncio.open_connection(*self.target)
        except OSError:
            self._count("connect_errors", client=client)
            c_writer.close()
            return
        # The handshake's round trips: a byte sent before a real connection would be up leaves when it is
        # (the client's connect() returned at once, so its first request waits here instead)
        ready = accepted_at + self.connect_rtts * self.rtt
        state = {"answered": True, "held": False}
        refusals = Refusals()
        parse = self._parser(state, refusals, client)

        def upstream(data: bytes) -> tuple[bytes, list[bytes]]:
            self._count("bytes_up", len(data), client)
            if state["answered"]:
                self._count("round_trips", client=client)
                state["answered"] = False
            nonlocal parse
            refusals.next_piece(len(data))
            if parse is not None:
                try:
                    parse(data)
                except Exception:  # Unparsable, or a label function's error: the bytes still pass, uncounted
                    self._count("unparsed", client=client)
                    parse = None
            passed, answers = refusals.take(data)
            if answers:
                state["answered"] = True
            return passed, answers

        def downstream(data: bytes) -> tuple[bytes, list[bytes]]:
            self._count("bytes_down", len(data), client)
            state["answered"] = True
            return data, []

        def held() -> bool:
            """Whether the chunk just seen holds a request ``hold()`` picked (reset for the next one)."""
            picked, state["held"] = state["held"], False
            return picked

        to_server: asyncio.Queue[tuple[float, bytes, bool]] = asyncio.Queue(IN_FLIGHT)
        to_client: asyncio.Queue[tuple[float, bytes, bool]] = asyncio.Queue(IN_FLIGHT)
        pumps = [asyncio.ensure_future(self._pump(c_reader, s_writer, upstream, ready, held, to_server, to_client)),
                 asyncio.ensure_future(self._pump(s_reader, c_writer, downstream, ready, lambda: False, to_client,
                                                  to_server))]
        try:
            await asyncio.gather(*pumps)
        except (OSError, asyncio.IncompleteReadError):
            pass  # a reset on either side: both ends are closed below
        finally:
            for pump in pumps:
                pump.cancel()
            await asyncio.gather(*pumps, return_exceptions=True)
            for w in (s_writer, c_writer):
                w.close()
            for w in (s_writer, c_writer):
                with contextlib.suppress(OSError, asyncio.CancelledError):
                    await w.wait_closed()

    async def _pump(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter,
                    seen: Callable[[bytes], tuple[bytes, list[bytes]]], ready: float, held: Callable[[], bool],
                    line: asyncio.Queue[tuple[float, bytes, bool]],
                    back: asyncio.Queue[tuple[float, bytes, bool]]) -> None:
        """One direction: each chunk goes on RTT/2 after it arrived (or after *ready*, the connection's
        handshake done, if that is later), one *held* (``hold()``) once released; EOF goes on likewise.
        *seen* says what of a chunk goes on, and the answers the proxy gives itself, which go *back* a whole
        round trip after the request's last byte arrived (half to the server's place, half back)."""
        half = self.rtt / 2

        async def send() -> None:
            while True:
                due, data, wait_gate = await line.get()
                wait = due - time.monotonic()
                if wait > 0:
                    await asyncio.sleep(wait)
                if wait_gate:
                    await self._gate().wait()
                if not data:
                    if writer.can_write_eof():
                        writer.write_eof()
                    return
                writer.write(data)
                await writer.drain()

        async def receive() -> None:
            while True:
                data = await reader.read(READ_SIZE)
                passed, answers = seen(data) if data else (data, [])
                due = max(time.monotonic(), ready) + half
                if passed or not data:  # b"" is the end of the stream: a chunk refused whole is not one
                    await line.put((due, passed, held()))
                for answer in answers:
                    await back.put((due + half, answer, False))
                if not data:
                    return

        # Either half failing (a reset, a peer gone) ends the direction at once, not at the other's next byte
        halves = [asyncio.ensure_future(receive()), asyncio.ensure_future(send())]
        try:
            pending: set[asyncio.Future[None]] = set(halves)
            while pending:
                done, pending = await asyncio.wait(pending, return_when=asyncio.FIRST_EXCEPTION)
                for task in done:
                    task.result()
        finally:
            for task in halves:
                task.cancel()
            await asyncio.gather(*halves, return_exceptions=True)

    def _parser(self, state: dict[str, bool], refusals: Refusals,
                client: str | None) -> Callable[[bytes], None] | None:
        """A connection's parser; a request ``hold()`` picks sets *state*["held"], one the proxy answers
        itself (``slowdown_every``, ``slowdown_rate``) goes to *refusals*."""
        def pick(name: str) -> None:
            if self._holding is not None and self._holding(name):
                state["held"] = True

        def request(method: str, target: str, at: int) -> None:
            pick(self._http_request(method, target, client))
            if (self.slowdown_every or self.slowdown_rate) and refusals.can_refuse(at) and self._slow_down(target,
                                                                                                          client):
                refusals.refuse(at, slow_down(method, target, self.retry_after))

        if self.protocol == "http":
            return HttpRequests(request, refusals.ended).feed
        if self.protocol == "redis":
            return RedisCommands(lambda name: pick(self._redis_command(name, client))).feed
        return None

    def _slow_down(self, target: str, client: str | None) -> bool:
        """Whether to answer this request 503 SlowDown: it is the Nth since the last one so answered, or its
        key prefix is over the rate this second.  Counted (``slowdowns``)."""
        now = int(time.monotonic())
        path = urlsplit(target).path
        if self.slowdown_depth:
            prefix = "/" + "/".join(path.strip("/").split("/")[:self.slowdown_depth]) + "/"
        else:
            prefix = path.rpartition("/")[0] + "/"
        with self._lock:
            self._arrived += 1
            refuse = bool(self.slowdown_every) and self._arrived % self.slowdown_every == 0
            if self.slowdown_rate:
                second, n = self._rates.get(prefix, (now, 0))
                n = n + 1 if second == now else 1
                self._rates[prefix] = (now, n)
                refuse = refuse or n > self.slowdown_rate
            if refuse:
                self._add("slowdowns", 1, client)
        return refuse

    def _http_request(self, method: str, target: str, client: str | None) -> str:
        """Count a request; its label (else its method key)."""
        key = http_method_key(method, target)
        with self._lock:
            self._add("requests", 1, client)
            self._add(key, 1, client)
            if self._label is None:
                return key
            label = self._label(key, target)
            self._labels[label] += 1
            return label

    def _redis_command(self, name: str, client: str | None) -> str:
        with self._lock:
            self._add("requests", 1, client)
            self._add(name, 1, client)
        return name


class Refusals:
    """The requests of one connection's client stream the proxy answers itself: their bytes never reach the
    server, and their answers go back in their place.

    Clients send a request once the answer to the previous one came (HTTP/1.1 clients do not pipeline),
    so an answer put back when its request's last byte is in lands in order.  A request whose first bytes
    already went on in an earlier piece (its request line cut across two reads) is passed on whole.
    """

    def __init__(self) -> None:
        self._piece = self._piece_end = 0  # where the piece being parsed begins and ends in the stream
        self._from: int | None = None  # where the refused request in progress began
        self._answer = b""
        self._spans: list[tuple[int, int]] = []
        self._answers: list[bytes] = []

    def next_piece(self, size: int) -> None:
        self._piece_end = self._piece + size

    def can_refuse(self, at: int) -> bool:
        return at >= self._piece

    def refuse(self, at: int, answer: bytes) -> None:
        self._from, self._answer = at, answer

    def ended(self, at: int) -> None:
        if self._from is not None:
            self._spans.append((self._from, at))
            self._answers.append(self._answer)
            self._from = None

    def take(self, data: bytes) -> tuple[bytes, list[bytes]]:
        """What of the piece just parsed goes on, and the answers of the refused requests it ended."""
        start, end = self._piece, self._piece_end
        spans = self._spans + ([(self._from, end)] if self._from is not None else [])
        if not spans:
            passed = data
        else:
            parts, at = [], start
            for a, b in spans:
                a, b = max(a, start), min(b, end)
                parts.append(data[at - start:a - start])
                at = b
            parts.append(data[at - start:])
            passed = b"".join(parts)
        if self._from is not None:
            self._from = end  # the refused request goes on in the next piece
        answers, self._spans, self._answers = self._answers, [], []
        self._piece = end
        return passed, answers


def slow_down(method: str, target: str, retry_after: int | None) -> bytes:
    """S3's answer to a request rate it will not take: ``503 Slow Down`` with its XML error body."""
    body = ("<?xml version=\"1.0\" encoding=\"UTF-8\"?>\n<Error><Code>SlowDown</Code>"
            "<Message>Please reduce your request rate.</Message>"
            f"<Resource>{html.escape(urlsplit(target).path)}</Resource>"
            f"<RequestId>{secrets.token_hex(8).upper()}</RequestId></Error>").encode()
    head = ["HTTP/1.1 503 Slow Down", "Content-Type: application/xml", f"x-amz-request-id: {secrets.token_hex(8)}",
            f"Content-Length: {0 if method == 'HEAD' else len(body)}"]
    if retry_after is not None:
        head.append(f"Retry-After: {retry_after}")
    return "\r\n".join(head).encode() + b"\r\n\r\n" + (b"" if method == "HEAD" else body)


def slowdown_arguments(ap: argparse.ArgumentParser) -> None:
    """The options of a SlowDown by rate (``--slowdown-rate``, ``--slowdown-depth``, ``--retry-after``), for
    this command and the benchmarks that run the proxy."""
    ap.add_argument("--slowdown-rate", type=float, default=0.0, metavar="R",
                    help="answer 503 SlowDown to requests past R a second under one key prefix (default: none)")
    ap.add_argument("--slowdown-depth", type=int, default=0, metavar="D",
                    help="a prefix of --slowdown-rate is the path's first D segments (1: the whole bucket, as S3"
                         " partitions a new one; default: the key's directory, e.g. packs/5d/)")
    ap.add_argument("--retry-after", type=int, default=None, metavar="S",
                    help="the Retry-After header (seconds) of a SlowDown answer (default: none, as S3)")


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("target", metavar="HOST:PORT", help="where the connections go")
    ap.add_argument("--rtt-ms", type=float, default=0.0, help="round trip added to every exchange (default 0)")
    ap.add_argument("--protocol", choices=("http", "redis", "raw"), default="http", help="what to count")
    ap.add_argument("--port", type=int, default=0, help="the loopback port to listen on (default: a free one)")
    ap.add_argument("--connect-rtts", type=int, default=1, help="round trips a new connection costs (default 1)")
    ap.add_argument("--slowdown-every", type=int, default=0, metavar="N",
                    help="answer every Nth HTTP request 503 SlowDown, as S3 does under a burst (default: none)")
    slowdown_arguments(ap)
    args = ap.parse_args()
    host, _, port = args.target.rpartition(":")
    if not host or not port.isdigit():
        ap.error(f"the target must be HOST:PORT, not {args.target!r}")
    if (args.slowdown_every or args.slowdown_rate) and args.protocol != "http":
        ap.error("--slowdown-every and --slowdown-rate need --protocol http")
    try:
        proxy = DelayProxy(host, int(port), args.rtt_ms, args.protocol, args.port, args.connect_rtts,
                           slowdown_every=args.slowdown_every, slowdown_rate=args.slowdown_rate,
                           slowdown_depth=args.slowdown_depth, retry_after=args.retry_after).start()
    except ValueError as e:
        ap.error(str(e))
    except OSError as e:
        print(f"delay_proxy: cannot listen on port {args.port}: {e.strerror}", file=sys.stderr)
        return 1
    print(f"127.0.0.1:{proxy.port} -> {args.target}, +{args.rtt_ms:g} ms a round trip ({args.protocol})",
          flush=True)
    done = threading.Event()
    signal.signal(signal.SIGINT, lambda *_: done.set())
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    done.wait()
    proxy.close()
    print(json.dumps(proxy.counts()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
