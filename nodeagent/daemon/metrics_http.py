"""The metrics endpoint (:class:`MetricsEndpoint`): Prometheus scrapes served by hand-parsed
HTTP/1.1 on non-blocking sockets in the daemon's own loop, bounded in connections, bytes, time
and share of the loop whatever peers do; the exposition is written in 0.5 ms steps
(:class:`Exposition`). Its bounds and eviction order: docs/internals.md.
"""

from __future__ import annotations

import collections
import errno
import logging
import re
import select
import socket
from dataclasses import dataclass, field
from http import HTTPStatus
from typing import Callable, NamedTuple

from nodeagent.daemon.loop import POLLIN, POLLOUT, EventLoopPoller, listening_socket, send_and_close
from nodeagent.metrics import CONTENT_TYPE, Exposition

log = logging.getLogger("nodeagent.metrics")

_MAX_HEAD_BYTES = 8 * 1024
_READ_BYTES = 4096
# Connections accepted per wake-up: at the cap each costs an eviction too (about 70 us together on 2
# shared cores), so a flood of them holds a handoff up by about half a millisecond at most.
_ACCEPT_BUDGET = 8
_MAX_REQUESTS = 100  # per keep-alive connection
_STEP_BUDGET_S = 0.0005  # CPU per loop turn while an exposition is written
_COST_FACTOR = 20  # the next exposition starts no sooner than this many times the last one's CPU after it
_ACCEPT_PAUSE_S = 0.1  # out of descriptors: stop accepting this long (the listener would stay readable)
_PARTIAL_PAUSE_S = 0.05  # after part of a request head, before reading that connection again
_NEW_GRACE_S = 0.5  # a connection this new (or this recently answered) goes after every repeater
_HANGUP = select.EPOLLHUP | select.EPOLLERR
_HEAD_END = re.compile(rb"\r?\n\r?\n")
_REQUEST_LINE = re.compile(r"([!#$%&'*+.^_`|~0-9A-Za-z-]+) (\S+) HTTP/(\d)\.(\d)\Z")

# Connection states: reading its request head, waiting for an exposition, writing its response.
READING, WAITING, WRITING = "reading", "waiting", "writing"


class HttpError(Exception):
    def __init__(self, status: int, why: str) -> None:
        super().__init__(why)
        self.status = status


class Request(NamedTuple):
    method: str
    path: str
    keep_alive: bool


def parse_head(head: bytes) -> Request:
    """A request head (request line and headers, without the blank line) as a
    :class:`Request`; :class:`HttpError` for anything that is not HTTP/1.x."""
    try:
        text = head.decode("ascii")
    except UnicodeDecodeError:
        raise HttpError(400, "not ASCII") from None
    lines = text.replace("\r\n", "\n").split("\n")
    m = _REQUEST_LINE.match(lines[0])
    if m is None:
        raise HttpError(400, "malformed request line")
    method, target, major, minor = m.group(1), m.group(2), int(m.group(3)), int(m.group(4))
    if major != 1:
        raise HttpError(505, f"HTTP/{major}.{minor}")
    headers: dict[str, str] = {}
    for line in lines[1:]:
        name, sep, value = line.partition(":")
        if not sep or not name or name != name.strip() or line[0] in " \t":
            raise HttpError(400, "malformed header")
        headers[name.lower()] = value.strip().lower()
    connection = {t.strip() for t in headers.get("connection", "").split(",")}
    keep_alive = "keep-alive" in connection if minor == 0 else "close" not in connection
    length = headers.get("content-length", "0")
    if not length.isdigit():
        raise HttpError(400, "bad Content-Length")
    if int(length) or "transfer-encoding" in headers:
        keep_alive = False  # a body we do not read: answer, then close
    return Request(method, target.partition("?")[0], keep_alive)


def response_head(status: int, length: int, keep_alive: bool, content_type: str = "text/plain; charset=utf-8",
                  extra: str = "") -> bytes:
    return (f"HTTP/1.1 {status} {HTTPStatus(status).phrase}\r\nContent-Type: {content_type}\r\n"
            f"Content-Length: {length}\r\nConnection: {'keep-alive' if keep_alive else 'close'}\r\n"
            f"{extra}\r\n").encode("ascii")


def error_response(status: int, why: str, extra: str = "") -> bytes:
    body = f"{status} {HTTPStatus(status).phrase}: {why}\n".encode("ascii", "replace")
    return response_head(status, len(body), False, extra=extra) + body


@dataclass(slots=True, eq=False)  # told apart by identity (the waiting list's remove)
class _Conn:
    sock: socket.socket
    fd: int
    deadline: float
    accepted: int  # the endpoint's count of accepts when it came: lower is older
    since: float  # when it was accepted, last answered or began taking a response
    state: str = READING
    inbuf: bytearray = field(default_factory=bytearray)
    out: list[memoryview] = field(default_factory=list)  # head, then the shared body
    keep_alive: bool = False
    head_only: bool = False  # a HEAD: the response without its body
    served: int = 0
    closed: bool = False
    read_paused: bool = False  # part of a head came: not watched for more until a timer says


class MetricsEndpoint:
    """Serves ``registry``'s exposition on a TCP address from the daemon's loop: the
    loop hands it its descriptors' readiness (:meth:`on_ready`), runs
    :meth:`on_timers` every turn and waits no longer than :meth:`next_deadline`."""

    def __init__(self, poller: EventLoopPoller, registry, *, clock: Callable[[], float], on_drop: Callable[[str], None],
                 max_connections: int = 64, timeout_s: float = 10.0, min_interval_s: float = 0.1,
                 accept_rate_per_s: float = 500.0) -> None:
        self._poller = poller
        self._registry = registry
        self._clock = clock
        self.max_connections = max_connections
        self.timeout_s = timeout_s
        self.min_interval_s = min_interval_s
        self.accept_rate_per_s = accept_rate_per_s
        self._accepts_left = 2.0 * max_connections
        self._accepts_at = clock()
        self._on_drop = on_drop
        self._listener: socket.socket | None = None
        # Ordered by deadline (each is set to now + timeout_s and moved to the end): the first
        # is the next to time out, and the oldest to evict.
        self._conns: collections.OrderedDict[int, _Conn] = collections.OrderedDict()
        self._paused_reads: collections.deque[tuple[float, _Conn]] = collections.deque()  # (when, conn) in order
        self._waiting: list[_Conn] = []  # asked for /metrics, for the next exposition
        self._writing: list[_Conn] = []  # the scrapes the exposition under way is for
        self._exposition: Exposition | None = None
        self._next_start = 0.0  # no exposition starts before this
        self._started_at = 0.0
        self._accept_paused_until: float | None = None
        self._accepted = 0  # connections accepted so far (their age order, for eviction)
        self.expositions = 0  # written so far

    # ------------------------------------------------------------------ life

    def bind(self, addr: str, port: int) -> int:
        """Listen on ``addr:port``; returns the port (``port`` 0 picks one). OSError as bind raises it."""
        family, _, _, _, sockaddr = socket.getaddrinfo(addr or None, port, 0, socket.SOCK_STREAM, 0,
                                                       socket.AI_PASSIVE)[0]
        self._listener = sock = listening_socket(family, sockaddr)
        self._poller.register(sock.fileno(), POLLIN, on_ready=self.on_ready, where="metrics")
        return sock.getsockname()[1]

    def __len__(self) -> int:
        return len(self._conns)

    def close(self) -> None:
        if self._listener is not None:
            self._poller.unregister(self._listener.fileno())
            self._listener.close()
            self._listener = None
        for conn in list(self._conns.values()):
            self._close(conn)
        self._waiting.clear()
        self._writing.clear()
        self._exposition = None

    # ----------------------------------------------------------------- loop

    def next_deadline(self, now: float) -> float | None:
        """When :meth:`on_timers` next has something to do (0.0, long past, while an exposition is under way)."""
        if self._exposition is not None:
            return 0.0
        due = (next(iter(self._conns.values())).deadline if self._conns else None,
               self._next_start if self._waiting else None, self._accept_paused_until,
               self._paused_reads[0][0] if self._paused_reads else None)
        return min((at for at in due if at is not None), default=None)

    def on_timers(self, now: float) -> None:
        while self._conns:
            conn = next(iter(self._conns.values()))
            if conn.deadline > now:
                break
            self._drop(conn, "timeout")
        while self._paused_reads and self._paused_reads[0][0] <= now:
            _, conn = self._paused_reads.popleft()
            if conn.read_paused:
                conn.read_paused = False
                if not conn.closed and conn.state == READING:
                    self._poller.modify(conn.fd, POLLIN)
        if self._accept_paused_until is not None and now >= self._accept_paused_until:
            self._accept_paused_until = None
            if self._listener is not None:
                self._poller.modify(self._listener.fileno(), POLLIN)
        if self._exposition is None and self._waiting and now >= self._next_start:
            self._exposition = Exposition(self._registry)
            self._writing, self._waiting = self._waiting, []
            self._started_at = now
        if self._exposition is not None:
            self._step()

    def on_ready(self, fd: int, events: int) -> None:
        if self._listener is not None and fd == self._listener.fileno():
            self._accept()
            return
        conn = self._conns.get(fd)
        if conn is None:
            return
        if conn.state == READING:
            self._read(conn)
        elif events & _HANGUP:
            self._close(conn)  # gone while it waited or while we wrote: nobody to answer
        elif conn.state == WRITING and events & POLLOUT:
            self._flush(conn)

    # ------------------------------------------------------------ accepting

    def _accept(self) -> None:
        now = self._clock()
        # Refill the accept allowance: a token bucket at accept_rate_per_s, holding enough to
        # replace every connection once at a time.
        self._accepts_left = min(2.0 * self.max_connections,
                                 self._accepts_left + (now - self._accepts_at) * self.accept_rate_per_s)
        self._accepts_at = now
        for _ in range(_ACCEPT_BUDGET):
            if self._accepts_left < 1.0:  # a flood: it waits in the backlog, then in SYN retries
                # Back when a whole wake-up's worth has accrued: one wake-up per batch, not per accept.
                self._pause_accepting(now + (_ACCEPT_BUDGET - self._accepts_left) / self.accept_rate_per_s)
                return
            try:
                sock, _addr = self._listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    log.warning("[metrics] out of descriptors (%s); not accepting scrapes for %.1f s",
                                exc.strerror, _ACCEPT_PAUSE_S)
                    self._pause_accepting(now + _ACCEPT_PAUSE_S)
                    return
                if exc.errno in (errno.ECONNABORTED, errno.EPROTO, errno.EPERM):
                    continue
                raise
            self._accepts_left -= 1.0
            if len(self._conns) >= self.max_connections and not self._evict_one():
                self._on_drop("refused")
                send_and_close(sock, error_response(503, "every connection is busy; retry"))
                continue
            sock.setblocking(False)
            try:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # the listener is TCP (bind)
            except OSError:
                pass
            self._accepted += 1
            now = self._clock()
            conn = _Conn(sock, sock.fileno(), now + self.timeout_s, self._accepted, now)
            self._conns[conn.fd] = conn
            self._poller.register(conn.fd, POLLIN, on_ready=self.on_ready, where="metrics")

    def _pause_accepting(self, until: float) -> None:
        """Stop watching the listener until ``until`` (the timers watch it again)."""
        self._accept_paused_until = until
        self._poller.modify(self._listener.fileno(), 0)

    def _evict_one(self) -> bool:
        """Free a slot by :func:`_eviction_rank`, the oldest of a rank first (False only with no connection);
        a reader whose request arrived unread (readiness later this turn) is read first, kept if a scrape."""
        settled = self._clock() - _NEW_GRACE_S
        for _ in range(len(self._conns) + 1):
            open_conns = [c for c in self._conns.values() if not c.closed]
            if not open_conns:
                return False
            conn = min(open_conns, key=lambda c: (_eviction_rank(c, settled), c.accepted))
            if conn.state == READING:
                self._read(conn)
                if conn.closed:
                    return True  # it had hung up, or was answered with an error and closed
                if conn.state != READING:
                    continue  # a scrape after all: rank it again
            self._drop(conn, "evicted")
            return True
        return False

    # -------------------------------------------------------------- reading

    def _read(self, conn: _Conn) -> None:
        try:
            data = conn.sock.recv(_READ_BYTES)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            data = b""  # reset, or any other error: closed, as an EOF is
        if not data:
            self._close(conn)
            return
        conn.inbuf += data
        self._parse(conn, drained=len(data) < _READ_BYTES)

    def _parse(self, conn: _Conn, drained: bool = False) -> None:
        """Act on the request head in ``conn.inbuf`` if it is whole (``drained``: the read
        that brought the bytes took all there were)."""
        m = _HEAD_END.search(conn.inbuf)
        if m is None:
            if len(conn.inbuf) >= _MAX_HEAD_BYTES:
                self._fail(conn, 431, f"request head over {_MAX_HEAD_BYTES} bytes")
            elif drained and not conn.read_paused:
                # Part of a head: read the rest no sooner than _PARTIAL_PAUSE_S from now, so a peer
                # trickling bytes wakes the loop at most 1/_PARTIAL_PAUSE_S times a second.
                conn.read_paused = True
                self._poller.modify(conn.fd, 0)
                self._paused_reads.append((self._clock() + _PARTIAL_PAUSE_S, conn))
            return
        head = bytes(conn.inbuf[:m.start()])
        del conn.inbuf[:m.end()]
        if len(head) >= _MAX_HEAD_BYTES:
            self._fail(conn, 431, f"request head over {_MAX_HEAD_BYTES} bytes")
            return
        try:
            request = parse_head(head)
        except HttpError as exc:
            self._fail(conn, exc.status, str(exc))
            return
        if request.method not in ("GET", "HEAD"):
            self._fail(conn, 405, f"{request.method} is not served", "Allow: GET, HEAD\r\n")
            return
        if request.path != "/metrics":
            self._fail(conn, 404, "the metrics are at /metrics")
            return
        conn.served += 1
        conn.keep_alive = request.keep_alive and conn.served < _MAX_REQUESTS
        conn.head_only = request.method == "HEAD"
        conn.state = WAITING
        self._poller.modify(conn.fd, 0)  # nothing more is read until it is answered: hang-ups only
        self._waiting.append(conn)

    def _fail(self, conn: _Conn, status: int, why: str, extra: str = "") -> None:
        self._on_drop("bad_request")
        conn.keep_alive = False
        self._start_write(conn, [memoryview(error_response(status, why, extra))])

    # -------------------------------------------------------------- writing

    def _step(self) -> None:
        exposition = self._exposition
        try:
            done = exposition.step(_STEP_BUDGET_S)
        except Exception:  # a collector's bug: those waiting get a 500, the loop counts it and carries on
            self._exposition = None
            self._next_start = self._clock() + self.min_interval_s
            writing, self._writing = self._writing, []
            for conn in writing:
                if not conn.closed:
                    conn.keep_alive = False
                    self._start_write(conn, [memoryview(error_response(500, "the metrics could not be "
                                                                       "collected; see the daemon's log"))])
            raise
        if not done:
            return
        self._exposition = None
        self.expositions += 1
        now = self._clock()
        self._next_start = max(self._started_at + self.min_interval_s, now + _COST_FACTOR * exposition.cpu_s)
        body = memoryview(exposition.result)
        head_ok = response_head(200, len(body), True, CONTENT_TYPE)
        head_close = response_head(200, len(body), False, CONTENT_TYPE)
        writing, self._writing = self._writing, []
        for conn in writing:
            if conn.closed:
                continue
            head = memoryview(head_ok if conn.keep_alive else head_close)
            self._start_write(conn, [head] if conn.head_only else [head, body])

    def _start_write(self, conn: _Conn, parts: list[memoryview]) -> None:
        conn.state = WRITING
        conn.since = self._clock()
        conn.out = parts
        self._flush(conn)
        if not conn.closed and conn.out:
            self._poller.modify(conn.fd, POLLOUT)

    def _flush(self, conn: _Conn) -> None:
        out = conn.out
        while out:
            try:
                sent = conn.sock.sendmsg(out)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                self._close(conn)
                return
            while sent and out:
                if sent >= len(out[0]):
                    sent -= len(out[0])
                    out.pop(0)
                else:
                    out[0] = out[0][sent:]
                    sent = 0
        if not conn.keep_alive:
            self._close(conn)
            return
        # Answered: the next request has timeout_s from now, like a new connection.
        conn.state = READING
        conn.since = self._clock()
        conn.deadline = conn.since + self.timeout_s
        self._conns.move_to_end(conn.fd)
        self._poller.modify(conn.fd, POLLIN)
        if conn.inbuf:
            self._parse(conn)  # pipelined: already here, and bounded by the head limit

    # -------------------------------------------------------------- closing

    def _drop(self, conn: _Conn, reason: str) -> None:
        self._on_drop(reason)
        self._close(conn)

    def _close(self, conn: _Conn) -> None:
        if conn.closed:
            return
        conn.closed = True
        if conn.state == WAITING and conn in self._waiting:
            self._waiting.remove(conn)  # at most max_connections long
        self._conns.pop(conn.fd, None)
        self._poller.unregister(conn.fd)
        try:
            conn.sock.close()
        except OSError:
            pass
        conn.out = []
        conn.inbuf = bytearray()


def _eviction_rank(conn: _Conn, settled: float) -> int:
    """Which connection gives its slot up first (lowest): a slowloris or idle keep-alive, a peer
    that does not read, a pipelining or keep-alive repeater, a newcomer, and a lone first request
    last (the order and its reasons: docs/internals.md)."""
    if conn.state == READING:
        return 0 if conn.since <= settled else 3
    if conn.state == WRITING and conn.since <= settled:
        return 1
    return 2 if conn.inbuf or conn.served > 1 else 4
