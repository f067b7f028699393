"""``mithrilfs.testing.delay_proxy``, the latency benchmark's network: bytes unchanged, the delay added, requests counted.

A real HTTP server (``http.server`` in a thread, keep-alive, chunked
uploads) and a real redis-server (the ``redis_server`` fixture) sit behind
the proxy.  Timings only have lower bounds (a loaded machine is slower,
never faster, than the delay it is given), except one comparison: a
pipeline must cost less than three sequential commands, which it does by
two whole round trips.
"""

from __future__ import annotations

import http.client
import http.server
import os
import random
import socket
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

import pytest
import redis
from conftest import RedisServer, wait_for

from mithrilfs.testing.delay_proxy import DelayProxy

T = TypeVar("T")


class Objects(http.server.BaseHTTPRequestHandler):
    """A tiny object store: PUT stores the body (Content-Length or chunked), GET returns it, the rest answer 204."""

    protocol_version = "HTTP/1.1"  # keep-alive: several requests on one connection
    store: dict[str, bytes] = {}

    def log_message(self, format: str, *args: object) -> None:
        pass

    def do_PUT(self) -> None:
        if "chunked" in self.headers.get("Transfer-Encoding", ""):
            body = bytearray()
            while size := int(self.rfile.readline().split(b";")[0], 16):
                body += self.rfile.read(size)
                self.rfile.readline()
            while self.rfile.readline() not in (b"\r\n", b"\n", b""):
                pass
        else:
            body = bytearray(self.rfile.read(int(self.headers["Content-Length"])))
        self.store[self.path] = bytes(body)
        self.answer(200, b"")

    def do_GET(self) -> None:
        body = self.store.get(self.path)
        self.answer(404, b"") if body is None else self.answer(200, body)

    def do_HEAD(self) -> None:
        self.answer(204, b"")

    def do_DELETE(self) -> None:
        self.answer(204, b"")

    def do_POST(self) -> None:
        self.rfile.read(int(self.headers.get("Content-Length", 0)))
        self.answer(200, b"ok")

    def answer(self, status: int, body: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        if self.command != "HEAD":
            self.wfile.write(body)


class ObjectServer(http.server.ThreadingHTTPServer):
    #: The proxy opens up to 32 connections at once: with the default backlog (5) and the accepting thread
    #: slow to run, the kernel drops the SYNs past it (a retry a second later).  A quiet suite's run saw
    #: one of them closed by the proxy without a response; the backlog keeps them all queued.
    request_queue_size = 128


@pytest.fixture
def http_server() -> Iterator[int]:
    server = ObjectServer(("127.0.0.1", 0), Objects)
    server.daemon_threads = True
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()
        Objects.store.clear()


def request(conn: http.client.HTTPConnection, method: str, path: str, body: bytes | None = None,
            chunked: bool = False) -> tuple[int, bytes]:
    if chunked and body is not None:
        pieces = [body[i:i + 100_000] for i in range(0, len(body), 100_000)]
        conn.request(method, path, body=iter(pieces), encode_chunked=True)
    else:
        conn.request(method, path, body=body)
    res = conn.getresponse()
    return res.status, res.read()


def test_http_bytes_pass_unchanged_and_every_request_is_counted(http_server: int) -> None:
    rnd = random.Random(21)
    payloads = {f"/bucket/k{i}": rnd.randbytes(rnd.choice([0, 1, 1000, 300_000, 3_000_000])) for i in range(8)}
    with DelayProxy("127.0.0.1", http_server, protocol="http",
                       label=lambda method, target: f"{method} {target.split('?')[0][8:9]}") as proxy:
        conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=30)
        for i, (path, data) in enumerate(payloads.items()):  # one keep-alive connection, every other one chunked
            assert request(conn, "PUT", path, data, chunked=i % 2 == 1) == (200, b"")
        for path, data in payloads.items():
            for _ in range(2):
                assert request(conn, "GET", path) == (200, data)
        assert request(conn, "GET", "/bucket?list-type=2&prefix=x")[0] == 404
        assert request(conn, "GET", "/bucket/")[0] == 404
        assert request(conn, "HEAD", "/bucket/k1")[0] == 204
        assert request(conn, "DELETE", "/bucket/k1")[0] == 204
        assert request(conn, "POST", "/bucket/k1?uploads", b"x" * 5000) == (200, b"ok")
        conn.close()
        wait_for(lambda: proxy.counts().get("bytes_down", 0) >= sum(len(d) for d in payloads.values()) * 2,
                 what="the responses counted")
        counts = proxy.counts()
        assert {k: counts.get(k) for k in ("PUT", "GET", "LIST", "HEAD", "DELETE", "POST", "requests")} == \
            {"PUT": 8, "GET": 16, "LIST": 2, "HEAD": 1, "DELETE": 1, "POST": 1, "requests": 29}
        assert counts["connections"] == 1 and counts["round_trips"] == 29 and "unparsed" not in counts
        assert counts["bytes_up"] > sum(len(d) for d in payloads.values())
        assert proxy.labels()["PUT k"] == 8 and proxy.labels()["GET k"] == 16
        proxy.reset()
        assert proxy.counts() == {}
    assert {p: Objects.store[p] for p in payloads} == payloads


def test_http_many_concurrent_connections(http_server: int) -> None:
    with DelayProxy("127.0.0.1", http_server, rtt_ms=20, protocol="http") as proxy:
        def client(i: int) -> bool:
            data = os.urandom(random.randrange(1, 500_000))
            conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=30)
            try:
                ok = request(conn, "PUT", f"/b/c{i}", data) == (200, b"")
                return ok and all(request(conn, "GET", f"/b/c{i}") == (200, data) for _ in range(3))
            finally:
                conn.close()

        with ThreadPoolExecutor(32) as pool:
            assert all(pool.map(client, range(64)))
        counts = proxy.counts()
        assert (counts["connections"], counts["PUT"], counts["GET"]) == (64, 64, 192)


def test_http_a_request_costs_the_round_trip_and_a_new_connection_one_more(http_server: int) -> None:
    with DelayProxy("127.0.0.1", http_server, rtt_ms=50, protocol="http", connect_rtts=1) as proxy:
        conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=30)
        t = time.monotonic()
        assert request(conn, "PUT", "/b/x", b"abc") == (200, b"")
        first = time.monotonic() - t
        t = time.monotonic()
        assert request(conn, "GET", "/b/x") == (200, b"abc")
        second = time.monotonic() - t
        conn.close()
    assert first >= 0.100, f"a request on a new connection took {first * 1000:.0f} ms through a 50 ms proxy"
    assert second >= 0.050, f"a request took {second * 1000:.0f} ms through a 50 ms proxy"


def test_held_requests_are_counted_and_reach_the_server_only_when_released(http_server: int) -> None:
    """``hold(match)``: a test catches a client with its request on the wire (counted, not passed on);
    requests it does not pick pass."""
    with DelayProxy("127.0.0.1", http_server, protocol="http",
                       label=lambda method, target: f"{method} {target}") as proxy, ThreadPoolExecutor(1) as pool:
        proxy.hold(lambda label: label == "PUT /b/held")
        other = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=30)
        assert request(other, "PUT", "/b/passes", b"not picked") == (200, b"")
        conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=30)
        answer = pool.submit(request, conn, "PUT", "/b/held", b"while held")
        wait_for(lambda: proxy.labels().get("PUT /b/held") == 1, what="the held request counted")
        assert request(other, "GET", "/b/passes") == (200, b"not picked")
        assert not answer.done() and "/b/held" not in Objects.store
        proxy.release()
        assert answer.result(timeout=30) == (200, b"") and Objects.store["/b/held"] == b"while held"
        conn.close()
        other.close()


def test_every_nth_request_is_answered_slow_down_and_never_reaches_the_server(http_server: int) -> None:
    """``slowdown_every=3``: the 3rd, 6th ... request is answered ``503 Slow Down`` with S3's XML body and
    ``Retry-After`` by the proxy (a PUT's body swallowed, chunked or not; a HEAD's answer without one), the
    keep-alive connection carries on, and the server never sees those requests."""
    sent = [("PUT", "/b/k0", os.urandom(300_000), False), ("PUT", "/b/k1", b"small", False),
            ("PUT", "/b/k2", os.urandom(100_000), True), ("GET", "/b/none", None, False),
            ("PUT", "/b/k4", b"p", False), ("HEAD", "/b/k4", None, False), ("GET", "/b/k0", None, False)]
    with DelayProxy("127.0.0.1", http_server, protocol="http", slowdown_every=3, retry_after=1) as proxy:
        conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=30)
        answers = []
        for method, path, body, chunked in sent:  # one connection
            conn.request(method, path, body=iter([body]) if chunked else body, encode_chunked=chunked)
            res = conn.getresponse()
            answers.append((res.status, res.getheader("Retry-After"), res.read()))
        conn.close()
        counts = proxy.counts()
    assert [status for status, _, _ in answers] == [200, 200, 503, 404, 200, 503, 200]
    _, retry_after, body = answers[2]
    assert retry_after == "1" and b"<Code>SlowDown</Code>" in body and b"<Resource>/b/k2</Resource>" in body
    assert answers[5][2] == b""  # a HEAD's answer has no body (else it would be read as the next answer)
    assert answers[6][2] == sent[0][2]
    assert (counts["requests"], counts["slowdowns"], counts["connections"]) == (7, 2, 1)
    assert set(Objects.store) == {"/b/k0", "/b/k1", "/b/k4"}  # the refused PUT never got there


def in_one_second(proxy: DelayProxy, send: Callable[[int], T]) -> T:
    """``send(attempt)``'s answer, from an attempt whose requests all came in one second of the proxy's clock
    (a loaded machine may cross one: the counts are reset and it is sent again)."""
    for attempt in range(10):
        proxy.reset()
        t = time.monotonic()
        got = send(attempt)
        if int(time.monotonic()) == int(t):
            return got
    raise AssertionError("ten attempts each crossed a second")


@pytest.mark.parametrize("depth, hot_key", [(0, "hot{attempt}/k{i}"), (2, "hot/{attempt}{j}/k{i}")],
                         ids=["the-key-directory", "two-segments"])
def test_requests_past_a_rate_under_one_prefix_are_answered_slow_down(http_server: int, depth: int,
                                                                      hot_key: str) -> None:
    """``slowdown_rate=5``: within one second, the requests past 5 under one key prefix get 503; another
    prefix has its own count.  A prefix is the key's directory, or with ``slowdown_depth=2`` its first two
    segments: every key under ``/b/hot/`` then shares one rate, whatever lies deeper (as S3 counts a
    prefix it has not split yet)."""
    with DelayProxy("127.0.0.1", http_server, protocol="http", slowdown_rate=5, slowdown_depth=depth) as proxy:
        conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=30)
        hot, cold = in_one_second(proxy, lambda attempt: (
            [request(conn, "GET", "/b/" + hot_key.format(attempt=attempt, i=i, j=i % 3))[0] for i in range(8)],
            [request(conn, "GET", f"/b/cold{attempt}/x/k{i}")[0] for i in range(3)]))
        conn.close()
        assert hot == [404] * 5 + [503] * 3 and cold == [404] * 3
        assert proxy.counts()["slowdowns"] == 3
    with pytest.raises(ValueError, match="negative"):
        DelayProxy("127.0.0.1", http_server, slowdown_depth=-1)


def test_each_client_port_is_counted_apart_and_shares_the_prefix_rate(http_server: int) -> None:
    """``add_client(name)``: another port in front of the same server; its requests count in the totals and
    under ``clients()[name]``, and the SlowDown rate of a prefix is one for every port."""
    with DelayProxy("127.0.0.1", http_server, protocol="http", slowdown_rate=5) as proxy:
        ports = {name: proxy.add_client(name) for name in ("n1", "n2")}
        assert len({proxy.port, *ports.values()}) == 3
        with pytest.raises(ValueError, match="n1"):
            proxy.add_client("n1")

        def send(attempt: int) -> dict[str, list[int]]:
            statuses = {}
            for name, port in ports.items():
                conn = http.client.HTTPConnection("127.0.0.1", port, timeout=30)
                statuses[name] = [request(conn, "GET", f"/b/p{attempt}/k{i}")[0] for i in range(4)]
                conn.close()
            main = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=30)
            assert request(main, "PUT", f"/b/q{attempt}/x", b"x") == (200, b"")
            main.close()
            return statuses

        statuses = in_one_second(proxy, send)
        assert statuses == {"n1": [404] * 4, "n2": [404, 503, 503, 503]}
        clients, counts = proxy.clients(), proxy.counts()
    assert {name: (c["GET"], c["requests"], c.get("slowdowns", 0), c["connections"])
            for name, c in clients.items()} == {"n1": (4, 4, 0, 1), "n2": (4, 4, 3, 1)}
    assert (counts["requests"], counts["slowdowns"], counts["connections"]) == (9, 3, 3)
    assert clients["n1"]["bytes_down"] > 0 and clients["n1"]["bytes_up"] < counts["bytes_up"]


def test_requests_are_counted_per_second(http_server: int) -> None:
    """``per_second()``: the requests (``slowdowns``) that came in each whole second since the ``reset()``;
    a reset starts the count again."""
    with DelayProxy("127.0.0.1", http_server, protocol="http", slowdown_every=2) as proxy:
        conn = http.client.HTTPConnection("127.0.0.1", proxy.port, timeout=30)
        assert proxy.per_second() == []
        for _ in range(3):
            request(conn, "GET", "/b/k")
        proxy.reset()
        assert proxy.per_second() == []
        t = time.monotonic()
        for _ in range(4):
            request(conn, "GET", "/b/k")
        wait_for(lambda: time.monotonic() - t > 1.2, what="the next second")
        for _ in range(2):
            request(conn, "GET", "/b/k")
        conn.close()
        per_second, slowdowns = proxy.per_second(), proxy.per_second("slowdowns")
    assert sum(per_second) == 6 and sum(slowdowns) == 3 and len(per_second) >= 2, per_second
    assert per_second[-1] >= 1, per_second


def test_http_bytes_that_do_not_parse_still_pass(http_server: int) -> None:
    with DelayProxy("127.0.0.1", http_server, protocol="http") as proxy, \
            socket.create_connection(("127.0.0.1", proxy.port), timeout=30) as sock:
        sock.sendall(b"NOT HTTP AT ALL\r\n\r\n")
        answer = b"".join(iter(lambda: sock.recv(65536), b""))  # the server answers and closes; so does the proxy
        assert b"400" in answer and b"Bad request" in answer
        wait_for(lambda: proxy.counts().get("unparsed") == 1, what="the connection counted as unparsed")
        assert "requests" not in proxy.counts()


def test_redis_commands_counted_and_a_pipeline_is_one_round_trip(redis_server: RedisServer) -> None:
    rnd = random.Random(7)
    values = [rnd.randbytes(rnd.choice([0, 10, 1000, 60_000])) for _ in range(10)]  # sent in well under RTT/2
    with DelayProxy("127.0.0.1", redis_server.port, rtt_ms=100, protocol="redis", connect_rtts=0) as proxy:
        client = redis.Redis(port=proxy.port, socket_timeout=30)
        assert client.ping()  # the connection's own handshake (HELLO, CLIENT SETINFO ...) is not counted below
        proxy.reset()
        t = time.monotonic()
        pipe = client.pipeline(transaction=False)
        for i, value in enumerate(values):
            pipe.set(f"k{i}", value)
        assert pipe.execute() == [True] * 10
        pipelined = time.monotonic() - t
        counts = proxy.counts()
        assert (counts["SET"], counts["requests"], counts["round_trips"]) == (10, 10, 1)
        t = time.monotonic()
        got = [client.get(f"k{i}") for i in range(3)]
        sequential = time.monotonic() - t
        assert got == values[:3]
        assert proxy.counts()["GET"] == 3 and proxy.counts()["round_trips"] == 4
        assert [redis.Redis(port=redis_server.port).get(f"k{i}") for i in range(10)] == values
        client.close()
    assert pipelined >= 0.100, f"a pipeline took {pipelined * 1000:.0f} ms through a 100 ms proxy"
    assert sequential >= 0.300, f"three commands took {sequential * 1000:.0f} ms through a 100 ms proxy"
    assert pipelined < sequential, "a pipeline of 10 cost more than 3 sequential commands: a delay per command"


def test_redis_connections_closed_both_ways(redis_server: RedisServer) -> None:
    def clients() -> int:
        return int(redis_server.cli("INFO", "clients").stdout.split("connected_clients:")[1].split()[0])

    before = clients()
    with DelayProxy("127.0.0.1", redis_server.port, rtt_ms=10, protocol="redis") as proxy:
        conns = [redis.Redis(port=proxy.port, single_connection_client=True) for _ in range(5)]
        assert all(c.ping() for c in conns)
        wait_for(lambda: clients() == before + 5, what="five connections through the proxy")
        for c in conns:
            c.close()
        wait_for(lambda: clients() == before, what="the server's ends closed after the clients closed")
        held = socket.create_connection(("127.0.0.1", proxy.port), timeout=30)
        held.sendall(b"PING\r\n")
        assert held.recv(100) == b"+PONG\r\n"
        assert proxy.counts()["PING"] == 6  # inline commands count too
    # closing the proxy closes what it still held, on the server's side too
    wait_for(lambda: clients() == before, what="the proxy's connections closed with it")
    with held:
        assert held.recv(100) == b"", "the proxy closed, the client's connection still open"
