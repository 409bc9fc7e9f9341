"""The metrics endpoint in the daemon's loop, driven by hand: HTTP it speaks, what it
refuses, and the bounds it keeps (connections, time, bytes, CPU) whatever peers do.
The daemon-level tests (a storm of slow scrapers beside token grants) are in
tests/bench/test_metrics_storm.py."""

from __future__ import annotations

import select
import socket

import pytest
from prometheus_client import CollectorRegistry, Counter, Enum, Info, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from nodeagent.daemon.loop import EventLoopPoller
from nodeagent.daemon.metrics_http import HttpError, MetricsEndpoint, error_response, parse_head
from nodeagent.metrics import CONTENT_TYPE, DeviceRow, Exposition, Metrics, SessionRow


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


class Harness:
    """A MetricsEndpoint on a real socket, its loop turned by hand (:meth:`turn`)."""

    def __init__(self, registry=None, **kwargs) -> None:
        self.clock = Clock()
        self.poller = EventLoopPoller()
        if registry is None:
            registry = CollectorRegistry()
            Counter("scrapes_seen", "a counter", registry=registry).inc()
        self.drops: list[str] = []
        self.ep = MetricsEndpoint(self.poller, registry, clock=self.clock, on_drop=self.drops.append, **kwargs)
        self.port = self.ep.bind("127.0.0.1", 0)
        self.peers: list[socket.socket] = []

    def turn(self, times: int = 3) -> None:
        """What the daemon's loop does: ready descriptors, then timers (an exposition step)."""
        for _ in range(times):
            for fd, ev in self.poller.poll(0):
                self.ep.on_ready(fd, ev)
            self.ep.on_timers(self.clock.now)

    def connect(self, rcvbuf: int | None = None) -> socket.socket:
        s = socket.socket()
        if rcvbuf is not None:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf)
        s.connect(("127.0.0.1", self.port))
        s.settimeout(0)
        self.peers.append(s)
        self.turn()
        return s

    def response(self, s: socket.socket, turns: int = 200) -> bytes:
        """What the endpoint wrote to ``s`` until it closed it (or ``turns`` turns passed)."""
        got = b""
        for _ in range(turns):
            self.turn(1)
            try:
                chunk = s.recv(1 << 20)
            except BlockingIOError:
                continue
            except ConnectionResetError:
                return got
            if not chunk:
                return got
            got += chunk
        return got

    def one_response(self, s: socket.socket, turns: int = 200, head_only: bool = False) -> tuple[int, dict, bytes]:
        """One response read off a connection that stays open: status, headers, body
        (``head_only``: the answer to a HEAD, which has none)."""
        got = b""
        for _ in range(turns):
            self.turn(1)
            try:
                got += s.recv(1 << 20)
            except BlockingIOError:
                pass
            head, sep, body = got.partition(b"\r\n\r\n")
            if sep:
                status, headers = split_head(head)
                if head_only or len(body) >= int(headers.get("content-length", 0)):
                    return status, headers, body
        raise AssertionError(f"no whole response; got {got[:200]!r}")

    def closed_by_endpoint(self, s: socket.socket) -> bool:
        """Whether the endpoint closed ``s`` (whatever it had written is read and dropped). The
        kernel delivers a closed socket's unsent bytes before its FIN: while bytes still come,
        the end may be behind them, so a pause in them is waited out (a short while) first."""
        self.turn()
        read = False
        while True:
            try:
                chunk = s.recv(1 << 20)
            except BlockingIOError:
                if read and select.select([s], [], [], 0.5)[0]:
                    read = False
                    continue  # more came (or the end): read on
                return False
            except ConnectionResetError:
                return True
            if chunk == b"":
                return True
            read = True

    def close(self) -> None:
        for s in self.peers:
            s.close()
        self.ep.close()
        self.poller.close()


def split_head(head: bytes) -> tuple[int, dict]:
    lines = head.decode().split("\r\n")
    status = int(lines[0].split()[1])
    return status, {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines[1:])}


def status_of(response: bytes) -> int:
    return split_head(response.partition(b"\r\n\r\n")[0])[0]


@pytest.fixture
def harness():
    made = []

    def make(**kwargs) -> Harness:
        h = Harness(**kwargs)
        made.append(h)
        return h

    yield make
    for h in made:
        h.close()


# ------------------------------------------------------------------ the exposition


def _populated_registry() -> CollectorRegistry:
    m = Metrics(CollectorRegistry())
    devices = [DeviceRow(str(i), "FREE", False, i == 0, 2) for i in range(4)]
    sessions = [SessionRow(str(i % 4), "training", "idle", 1 << 20) for i in range(200)]
    m.watch(4, lambda: devices, lambda: sessions)
    for d in range(4):
        for w in ("training", "inference"):
            m.token_wait.labels(str(d), w).observe(0.003 * (d + 1))
    m.internal_errors.labels('a "quoted"\\back\nslash').inc()  # label values are escaped
    return m.registry


class _Odd:
    """Families the fast path leaves to generate_latest: a created sample, a name with a
    dot, a timestamp, a label name with a colon."""

    def collect(self):
        c = CounterMetricFamily("odd_c", "help \\ with\nnewline", labels=["a"], created=12.5)
        c.add_metric(["x"], 1.0)
        yield c
        for name, label, ts in (("odd.dotted", "b", None), ("odd_ts", "b", 1234.5), ("odd_lab", "b:c", None)):
            g = GaugeMetricFamily(name, "g", labels=[label])
            g.add_metric(["y"], 1e300, timestamp=ts)
            yield g


@pytest.mark.parametrize("budget_s", [1e-6, 5e-4, 10.0])
def test_the_exposition_written_in_steps_is_generate_latest_byte_for_byte(budget_s):
    registry = _populated_registry()
    registry.register(_Odd())
    Info("an", "an info", registry=registry).info({"v": "1"})
    Enum("state", "an enum", states=["a", "b"], registry=registry)
    e = Exposition(registry)
    steps = 1
    while not e.step(budget_s):
        steps += 1
    assert e.result == generate_latest(registry)
    assert e.cpu_s > 0
    if budget_s < 1e-3:
        assert steps > 1  # it yielded to the loop between steps
    else:
        assert steps == 1


# ------------------------------------------------------------------ HTTP


@pytest.mark.parametrize("head, problem", [
    (b"garbage", 400),
    (b"GET /metrics", 400),
    (b"GET /metrics HTTP/2.0", 505),
    (b"GET  /metrics HTTP/1.1", 400),
    (b"GET /metrics HTTP/1.1\r\nno colon here", 400),
    (b"GET /metrics HTTP/1.1\r\n folded: header", 400),
    (b"GET /metrics HTTP/1.1\r\nContent-Length: -1", 400),
    (b"GET /metrics HTTP/1.1\r\nHost: \xff", 400),
])
def test_a_malformed_head_is_an_http_error(head, problem):
    with pytest.raises(HttpError) as exc:
        parse_head(head)
    assert exc.value.status == problem


def test_keep_alive_follows_the_version_connection_and_any_body():
    assert parse_head(b"GET /metrics HTTP/1.1\r\nHost: x").keep_alive
    assert not parse_head(b"GET /metrics HTTP/1.1\r\nConnection: close").keep_alive
    assert not parse_head(b"GET /metrics HTTP/1.0").keep_alive
    assert parse_head(b"GET /metrics HTTP/1.0\r\nConnection: Keep-Alive").keep_alive
    assert not parse_head(b"GET /metrics HTTP/1.1\r\nContent-Length: 5").keep_alive  # a body it will not read
    assert not parse_head(b"GET /metrics HTTP/1.1\r\nTransfer-Encoding: chunked").keep_alive
    assert parse_head(b"GET /metrics?name[]=x HTTP/1.1").path == "/metrics"


def test_an_error_response_names_its_status_in_the_standard_words():
    assert error_response(431, "too long") == (
        b"HTTP/1.1 431 Request Header Fields Too Large\r\nContent-Type: text/plain; charset=utf-8\r\n"
        b"Content-Length: 46\r\nConnection: close\r\n\r\n431 Request Header Fields Too Large: too long\n")
    assert error_response(505, "HTTP/2.0").startswith(b"HTTP/1.1 505 HTTP Version Not Supported\r\n")


def test_a_scrape_gets_the_exposition_with_its_type_length_and_keep_alive(harness):
    h = harness()
    s = h.connect()
    s.sendall(b"GET /metrics HTTP/1.1\r\nHost: a\r\nAccept: application/openmetrics-text\r\n\r\n")
    status, headers, body = h.one_response(s)
    assert status == 200 and headers["content-type"] == CONTENT_TYPE
    assert headers["connection"] == "keep-alive" and int(headers["content-length"]) == len(body)
    assert b"scrapes_seen_total 1.0\n" in body
    h.clock.now += 1.0  # past the interval between expositions
    s.sendall(b"HEAD /metrics HTTP/1.1\r\n\r\nGET /metrics HTTP/1.1\r\nConnection: close\r\n\r\n")  # pipelined
    status, headers, nothing = h.one_response(s, head_only=True)
    assert status == 200 and int(headers["content-length"]) == len(body) and nothing == b""  # a HEAD: no body
    h.clock.now += 1.0  # the GET behind it waits for the next exposition
    rest = h.response(s)  # then the endpoint closes
    assert status_of(rest) == 200 and rest.endswith(body) and b"Connection: close" in rest
    assert len(h.ep) == 0 and h.drops == []


@pytest.mark.parametrize("request_bytes, status", [
    (b"GET / HTTP/1.1\r\n\r\n", 404),
    (b"GET /metricsx HTTP/1.1\r\n\r\n", 404),
    (b"POST /metrics HTTP/1.1\r\nContent-Length: 3\r\n\r\nabc", 405),
    (b"DELETE /metrics HTTP/1.1\r\n\r\n", 405),
    (b"\x16\x03\x01\x02\x00\x01\x00\x01\xfc\x03\x03\r\n\r\n", 400),  # a TLS hello
    (b"GET /metrics HTTP/3.0\r\n\r\n", 505),
    (b"GET /metrics HTTP/1.1\r\n" + b"X-Long: " + b"a" * 9000 + b"\r\n\r\n", 431),
    (b"\r\n\r\n", 400),
])
def test_what_is_not_a_scrape_gets_an_error_and_the_connection_closed(harness, request_bytes, status):
    h = harness()
    s = h.connect()
    s.sendall(request_bytes)
    out = h.response(s)
    assert status_of(out) == status and b"Connection: close" in out
    if status == 405:
        assert b"Allow: GET, HEAD" in out
    assert len(h.ep) == 0 and h.drops == ["bad_request"]


def test_expositions_are_shared_and_spaced_however_many_ask(harness):
    """Scrapes waiting together share one exposition; one asked within the interval
    waits for the next, which reads the registry after it was asked."""
    registry = CollectorRegistry()
    counter = Counter("seen", "c", registry=registry)
    h = harness(registry=registry, min_interval_s=0.5)
    peers = [h.connect() for _ in range(5)]
    for s in peers:
        s.sendall(b"GET /metrics HTTP/1.1\r\n\r\n")
    bodies = {h.one_response(s)[2] for s in peers}
    assert len(bodies) == 1 and h.ep.expositions == 1
    counter.inc()
    peers[0].sendall(b"GET /metrics HTTP/1.1\r\n\r\n")
    h.turn(20)
    assert h.ep.expositions == 1  # within the interval: it waits
    h.clock.now += 0.5
    _, _, body = h.one_response(peers[0])
    assert h.ep.expositions == 2 and b"seen_total 1.0" in body


def test_a_slow_request_is_closed_at_the_timeout_however_it_trickles(harness):
    h = harness(timeout_s=2.0)
    slow, idle = h.connect(), h.connect()
    for _ in range(4):  # a byte a "second": never a whole head
        slow.send(b"G")
        h.clock.now += 0.45
        h.turn()
    assert not h.closed_by_endpoint(slow) and not h.closed_by_endpoint(idle)
    h.clock.now += 0.3
    assert h.closed_by_endpoint(slow) and h.closed_by_endpoint(idle)
    assert h.drops == ["timeout", "timeout"] and len(h.ep) == 0
    assert h.ep.next_deadline(h.clock.now) is None  # nothing left to wake for


def test_a_keep_alive_connection_gets_the_timeout_anew_after_each_response(harness):
    h = harness(timeout_s=2.0, min_interval_s=0.0)
    s = h.connect()
    for _ in range(3):
        h.clock.now += 1.5
        s.sendall(b"GET /metrics HTTP/1.1\r\n\r\n")
        assert h.one_response(s)[0] == 200
    assert len(h.ep) == 1 and h.drops == []


def test_a_peer_that_never_reads_is_closed_at_the_timeout(harness):
    registry = CollectorRegistry()
    big = Counter("big", "c", ["label"], registry=registry)
    for i in range(20_000):
        big.labels(f"value-{i:06d}").inc()  # an exposition of about a MB, more than the socket buffers hold
    h = harness(registry=registry, timeout_s=2.0)
    s = h.connect(rcvbuf=4096)
    s.sendall(b"GET /metrics HTTP/1.1\r\n\r\n")
    for _ in range(5000):
        h.turn(1)
        if h.ep.expositions:
            break
    h.turn()
    assert len(h.ep) == 1  # still writing: the peer does not read
    h.clock.now += 2.1
    h.turn()
    assert len(h.ep) == 0 and h.drops == ["timeout"]


def test_past_the_cap_a_newcomer_takes_the_slot_of_the_oldest_idle_connection(harness):
    h = harness(max_connections=3, timeout_s=5.0)
    old = [h.connect() for _ in range(3)]
    newcomer = h.connect()
    assert h.closed_by_endpoint(old[0]) and h.drops == ["evicted"]
    assert not any(h.closed_by_endpoint(s) for s in (*old[1:], newcomer))
    newcomer.sendall(b"GET /metrics HTTP/1.1\r\n\r\n")
    assert h.one_response(newcomer)[0] == 200
    assert len(h.ep) == 3


def test_a_peer_that_does_not_take_its_response_gives_its_slot_up_before_a_scrape_waiting(harness):
    registry = CollectorRegistry()
    big = Counter("big", "c", ["label"], registry=registry)
    for i in range(20_000):
        big.labels(f"value-{i:06d}").inc()  # more than the socket buffers hold
    h = harness(registry=registry, max_connections=2, min_interval_s=0.0, timeout_s=1000.0)
    stuck = h.connect(rcvbuf=4096)
    stuck.sendall(b"GET /metrics HTTP/1.1\r\n\r\n")
    for _ in range(5000):
        h.turn(1)
        if h.ep.expositions:
            break
    h.turn()
    waiting = h.connect()
    waiting.sendall(b"GET /metrics HTTP/1.1\r\n\r\n")
    h.turn(1)  # asked for the next exposition, which is 20 times the last one's CPU away
    h.clock.now += 100.0
    h.connect()  # a third: the one that does not read goes, not the one waiting
    assert h.drops == ["evicted"] and h.closed_by_endpoint(stuck)
    assert h.one_response(waiting, turns=5000)[0] == 200


def test_with_every_slot_waiting_a_newcomer_takes_the_oldest_repeaters_slot(harness):
    """Issue 32 item 8: connections waiting for an exposition were never evicted, so keep-alive
    peers pipelining requests held every slot and a real scrape got 503. Now the oldest waiting
    one that was answered before on its connection gives its slot up, then the oldest first-timer."""
    h = harness(max_connections=3, min_interval_s=10.0, timeout_s=60.0)
    hogs = [h.connect() for _ in range(2)]
    for hog in hogs:
        hog.sendall(b"GET /metrics HTTP/1.1\r\n\r\n" * 5)  # pipelined: answered, it waits again at once
    assert all(h.one_response(hog)[0] == 200 for hog in hogs)  # the interval starts now
    first_timer = h.connect()
    first_timer.sendall(b"GET /metrics HTTP/1.1\r\n\r\n")
    h.turn()  # every slot waits for the next exposition
    scrape = h.connect()
    assert h.drops == ["evicted"] and h.closed_by_endpoint(hogs[0])  # the oldest repeater
    scrape.sendall(b"GET /metrics HTTP/1.1\r\n\r\n")
    h.turn()
    later = h.connect()
    assert h.drops == ["evicted"] * 2 and h.closed_by_endpoint(hogs[1])  # repeaters go before first requests
    later.sendall(b"GET /metrics HTTP/1.1\r\n\r\n")
    h.turn()
    h.connect()
    assert h.drops == ["evicted"] * 3 and h.closed_by_endpoint(first_timer)  # then the oldest first request
    assert not h.closed_by_endpoint(scrape) and not h.closed_by_endpoint(later)
    h.clock.now += 10.0
    assert h.one_response(scrape)[0] == 200


def test_many_connections_at_once_are_accepted_or_shed_at_once(harness):
    """The backlog is a real one and the cap sheds the oldest: 600 connections
    opened without the loop turning all complete, and the endpoint ends with its cap."""
    h = harness(max_connections=16)
    peers = []
    for _ in range(600):
        s = socket.create_connection(("127.0.0.1", h.port), timeout=1.0)  # fails if the backlog were full
        s.setblocking(False)
        peers.append(s)
    h.peers.extend(peers)
    for _ in range(100):  # 8 accepted a turn, 500 a second
        h.clock.now += 0.02
        h.turn(1)
    assert len(h.ep) == 16 and h.drops.count("evicted") == 600 - 16


def test_a_connect_flood_is_accepted_no_faster_than_the_rate(harness):
    h = harness(max_connections=16, accept_rate_per_s=100.0)
    for _ in range(300):
        s = socket.create_connection(("127.0.0.1", h.port), timeout=1.0)
        s.setblocking(False)
        h.peers.append(s)
    h.turn(100)
    assert len(h.drops) == 16 and len(h.ep) == 16  # a burst of twice the cap, then nothing while no time passes
    assert h.ep.next_deadline(h.clock.now) == h.clock.now + 8 / 100.0  # back when a wake-up's worth (8) has accrued
    h.clock.now += 0.2
    h.turn(100)
    assert len(h.drops) == 16 + 20  # 100 a second for 0.2 s, each taking an idle one's slot


def test_a_collector_that_raises_costs_its_scrape_a_500_and_nothing_more(harness):
    class Broken:
        def collect(self):
            raise RuntimeError("a bug in a collector")

    registry = CollectorRegistry()
    registry.register(Broken())
    h = harness(registry=registry)
    s = h.connect()
    s.sendall(b"GET /metrics HTTP/1.1\r\n\r\n")
    with pytest.raises(RuntimeError):  # the loop's _contain counts it as an internal error
        h.turn()
    assert status_of(h.response(s)) == 500
    assert h.ep.next_deadline(h.clock.now) is None or h.ep.next_deadline(h.clock.now) > 0.0  # no exposition left under way


def test_a_request_that_arrived_but_was_not_read_yet_is_served_not_evicted(harness):
    h = harness(max_connections=2, timeout_s=5.0)
    asking, idle = h.connect(), h.connect()
    asking.sendall(b"GET /metrics HTTP/1.1\r\n\r\n")  # in its socket; the loop has not turned since
    newcomer = socket.create_connection(("127.0.0.1", h.port))
    newcomer.setblocking(False)
    h.peers.append(newcomer)
    for fd, _ in h.poller.poll(0):
        if fd == h.ep._listener.fileno():
            h.ep.on_ready(fd, 0)  # the listener's readiness handled before the asking one's
    assert h.drops == ["evicted"] and h.closed_by_endpoint(idle)
    assert h.one_response(asking)[0] == 200


def test_a_peer_trickling_bytes_fast_is_read_at_most_every_50_ms(harness):
    h = harness(timeout_s=5.0)
    s = h.connect()
    s.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # each byte leaves at once
    head = b"GET /metrics HTTP/1.1\r\nX-Padding: " + b"a" * 100 + b"\r\n\r\n"
    conn = next(iter(h.ep._conns.values()))

    def trickle(part: bytes) -> None:
        for byte in part:
            s.send(bytes([byte]))
            h.turn(1)

    trickle(head[:50])
    assert len(conn.inbuf) == 1  # one byte read, then the connection is not watched while no time passes
    h.clock.now += 0.05
    h.turn(2)  # watched again at the timers, read at the next wake-up
    got = len(conn.inbuf)
    assert got > 1  # what had come by then, in one read
    trickle(head[50:100])
    assert len(conn.inbuf) == got  # and again nothing more for 50 ms
    s.sendall(head[100:])
    for _ in range(20):  # a whole head is served as ever
        h.clock.now += 0.05
        h.turn(2)
        if conn.state != "reading":
            break
    assert h.one_response(s)[0] == 200
