"""The client side of a nodeagent session: connect, take turns at the device.

    with Client("trainer", workload="training") as client:
        with client.slice():            # blocks until this process holds the token
            for batch in loader:
                step(batch)
                client.yield_point()    # gives the token up only if the daemon asked

A :class:`Client` is used from one thread (like the ZeroMQ socket it owns).
A small background thread with its own socket sends heartbeats, so a long
step never looks like a dead client, and notices when the daemon goes away.
No torch here: :mod:`client_lib.torch` holds the torch helpers.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from contextlib import contextmanager
from typing import Iterator

import zmq

from client_lib import codec
from client_lib import protocol as p
from client_lib.endpoint import client_endpoint
from client_lib.errors import (DaemonError, DaemonUnavailableError, GrantTimeoutError,
                               HandshakeTimeoutError, NodeAgentError, NoSessionError, from_reply)

log = logging.getLogger("client_lib.client")

ENV_HANDSHAKE_TIMEOUT = "NODEAGENT_HANDSHAKE_TIMEOUT_S"
_POLL_SLICE_MS = 50  # longest blind wait: how soon a lost daemon is noticed while blocked


class Client:
    """One session with the local nodeagent daemon.

    ``reconnect``: when the daemon goes away (restart, crash), wait up to
    ``reconnect_timeout_s`` for it to come back and open a new session instead
    of raising :class:`DaemonUnavailableError`. A token held at that moment is
    lost either way.
    """

    def __init__(self, name: str, workload: str = "training", weight: float = 1.0,
                 device: int | None = None, endpoint: str | None = None, *,
                 memory_mb: int = 0, handshake_timeout_s: float | None = None,
                 reconnect: bool = False, reconnect_timeout_s: float = 30.0,
                 context: zmq.Context | None = None) -> None:
        if workload not in p.WORKLOADS:
            raise ValueError(f"workload must be one of {', '.join(p.WORKLOADS)}, got {workload!r}")
        self.name = name
        self.workload = workload
        self.weight = float(weight)
        self.memory_mb = int(memory_mb)
        self.endpoint = endpoint or client_endpoint()
        self.reconnect = reconnect
        self.reconnect_timeout_s = reconnect_timeout_s
        if handshake_timeout_s is None:
            handshake_timeout_s = float(os.environ.get(ENV_HANDSHAKE_TIMEOUT, "5"))
        self.handshake_timeout_s = handshake_timeout_s
        self._wanted_device = device
        self._ctx = context if context is not None else zmq.Context.instance()
        self._sock: zmq.Socket | None = None
        self._next_id = 1
        self._replies: dict[int, p.DaemonMessage] = {}
        self._awaiting: set[int] = set()  # ids of requests a _call() is waiting on
        self._async_error: DaemonError | None = None  # error reply to a fire-and-forget request
        self._grant: int | None = None
        self._yield_requested = False
        self._in_slice = False
        self._closed = False
        self._heartbeat: _HeartbeatThread | None = None
        self.welcome: p.Welcome | None = None
        self.revocations = 0
        self._connect()

    # ------------------------------------------------------------ properties

    @property
    def session_id(self) -> str:
        return self.welcome.session

    @property
    def device(self) -> int:
        return self.welcome.device

    @property
    def slice_ms(self) -> float:
        return self.welcome.slice_ms

    @property
    def holding(self) -> bool:
        """True while this client holds its device's token (as last heard)."""
        self._pump(0)
        return self._grant is not None

    @property
    def yield_requested(self) -> bool:
        self._pump(0)
        return self._yield_requested

    # ---------------------------------------------------------------- token

    def acquire(self, timeout: float | None = None) -> int:
        """Block until this session holds the token; returns the grant id.

        ``GrantTimeoutError`` after ``timeout`` seconds (the request is withdrawn)."""
        self._check_open()
        self._pump(0)
        if self._grant is not None:
            return self._grant
        self._send_quiet(p.Acquire(id=self._take_id(), quiet=True))
        return self._wait_for_grant(timeout)

    def _wait_for_grant(self, timeout: float | None) -> int:
        asked_in = self.welcome.session
        deadline = None if timeout is None else time.monotonic() + timeout
        while self._grant is None:
            if self.welcome.session != asked_in:  # reconnected: the new session must ask again
                asked_in = self.welcome.session
                self._send_quiet(p.Acquire(id=self._take_id(), quiet=True))
            remaining_ms = _POLL_SLICE_MS
            if deadline is not None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    self._send_quiet(p.Cancel(id=self._take_id()))
                    raise GrantTimeoutError(f"no grant within {timeout} s on device {self.device}")
                remaining_ms = min(remaining_ms, max(1, int(remaining * 1000)))
            if not self._pump(remaining_ms):
                self._check_daemon()
        return self._grant

    def release(self) -> None:
        """Give the token back (no-op when not holding). Does not wait for the daemon."""
        if self._grant is None:
            return
        # Send before reading anything: the next holder is waiting on this frame.
        self._send_quiet(p.Release(id=self._take_id(), grant=self._grant, quiet=True))
        self._grant = None
        self._yield_requested = False
        self._pump(0)

    @contextmanager
    def slice(self, timeout: float | None = None) -> Iterator[int]:
        """Hold the token for the block; yields the grant id."""
        grant = self.acquire(timeout)
        self._in_slice = True
        try:
            yield grant
        finally:
            self._in_slice = False
            if not self._closed:
                self.release()

    def yield_point(self) -> bool:
        """Call often (every iteration). Returns at once unless the daemon asked
        this client to yield or took its token: then it gives the token back,
        waits for the next grant, and returns True."""
        self._pump(0)
        if self._yield_requested and self._grant is not None:
            # requeue: released and waiting again in one step, so no acquire to send.
            self._send_quiet(p.Release(id=self._take_id(), grant=self._grant, requeue=True, quiet=True))
            self._grant = None
            self._yield_requested = False
            self._wait_for_grant(None)
            return True
        if self._in_slice and self._grant is None:  # revoked: wait for our turn again
            self.acquire()
            return True
        self._check_daemon()
        return False

    # --------------------------------------------------------------- others

    def status(self, timeout: float = 5.0) -> p.StatusReply:
        """The daemon's status snapshot."""
        return self._call(p.StatusRequest(id=self._take_id()), timeout)

    def close(self) -> None:
        """End the session (the token, if held, passes on) and close sockets."""
        if self._closed:
            return
        self._closed = True
        if self._sock is not None:
            # Wait for the bye's answer: a process that exits at once (os._exit)
            # would otherwise take the unsent frame with it, and look crashed.
            if self._heartbeat is None or self._heartbeat.healthy():
                try:
                    self._call(p.Goodbye(id=self._take_id()), timeout=1.0)
                except NodeAgentError:
                    pass
            self._sock.close(linger=0)
            self._sock = None
        if self._heartbeat is not None:
            self._heartbeat.stop()
        self._grant = None

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:
            pass

    # ------------------------------------------------------------ internals

    def _connect(self) -> None:
        """Open the socket and handshake (resuming the old session if any)."""
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self.endpoint)
        self._sock = sock
        old = self.welcome
        hello = p.Hello(
            id=self._take_id(), protocol=p.PROTOCOL_VERSION, name=self.name, pid=os.getpid(),
            workload=self.workload, weight=self.weight, device=self._wanted_device,
            memory_mb=self.memory_mb, resume_session=old.session if old else None,
            resume_key=old.key if old else None)
        try:
            welcome = self._call(hello, self.handshake_timeout_s, handshake=True)
        except BaseException:
            sock.close(0)
            self._sock = None
            raise
        if not isinstance(welcome, p.Welcome):
            raise NodeAgentError(f"expected welcome from {self.endpoint}, got {type(welcome).__name__}")
        self.welcome = welcome
        self._heartbeat = _HeartbeatThread(self._ctx, self.endpoint, welcome)
        self._heartbeat.start()
        log.debug("[client] session=%s device=%d slice_ms=%.0f", welcome.session, welcome.device,
                  welcome.slice_ms)

    def _reconnect(self, cause: str) -> None:
        log.warning("[client] daemon at %s lost (%s); reconnecting", self.endpoint, cause)
        if self._heartbeat is not None:
            self._heartbeat.stop()
        if self._sock is not None:
            self._sock.close(0)
        self._sock = None
        self._grant = None
        self._yield_requested = False
        self._replies.clear()
        self._awaiting.clear()
        self._async_error = None
        deadline = time.monotonic() + self.reconnect_timeout_s
        while True:
            try:
                self._connect()
                return
            except DaemonUnavailableError:
                if time.monotonic() >= deadline:
                    raise DaemonUnavailableError(
                        self.endpoint, f"did not come back within reconnect_timeout_s={self.reconnect_timeout_s}")

    def _take_id(self) -> int:
        rid = self._next_id
        self._next_id += 1
        return rid

    def _check_open(self) -> None:
        if self._closed:
            raise NodeAgentError("client is closed")

    def _send_quiet(self, req: p.ClientMessage) -> None:
        """Send without waiting: only an error reply matters, and it is raised later."""
        self._sock.send(codec.encode(req))

    def _call(self, req: p.ClientMessage, timeout: float, handshake: bool = False) -> p.DaemonMessage:
        """Send ``req`` and wait for its reply, handling notices meanwhile."""
        self._awaiting.add(req.id)
        try:
            return self._wait_reply(req, timeout, handshake)
        finally:
            self._awaiting.discard(req.id)

    def _wait_reply(self, req: p.ClientMessage, timeout: float, handshake: bool) -> p.DaemonMessage:
        self._sock.send(codec.encode(req))
        deadline = time.monotonic() + timeout
        while req.id not in self._replies:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                if handshake:
                    raise HandshakeTimeoutError(
                        self.endpoint, f"no welcome within {timeout} s (is `nodeagent serve` running? "
                        f"raise handshake_timeout_s or {ENV_HANDSHAKE_TIMEOUT} if it is slow to answer)")
                raise DaemonUnavailableError(self.endpoint, f"no reply to {type(req).__name__} within {timeout} s")
            if not self._pump(min(_POLL_SLICE_MS, max(1, int(remaining * 1000)))) and not handshake:
                self._check_daemon()
        reply = self._replies.pop(req.id)
        if isinstance(reply, p.Error):
            raise from_reply(reply.code, reply.message)
        return reply

    def _pump(self, timeout_ms: int) -> bool:
        """Handle every message that arrives within ``timeout_ms``; True if any did."""
        sock = self._sock
        if sock is None:
            return False
        if not sock.poll(timeout_ms, zmq.POLLIN):
            return False
        while True:
            try:
                frame = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            try:
                msg = codec.decode_reply(frame)
            except codec.BadFrame as exc:
                log.warning("[client] ignoring a frame from the daemon: %s", exc)
                continue
            self._handle(msg)
        if self._async_error is not None:
            err, self._async_error = self._async_error, None
            if isinstance(err, NoSessionError) and self.reconnect:
                self._reconnect(str(err))
            else:
                raise err
        return True

    def _handle(self, msg: p.DaemonMessage) -> None:
        kind = type(msg)
        if kind is p.Grant:
            self._grant = msg.grant
            self._yield_requested = False
        elif kind is p.YieldRequest:
            if msg.grant == self._grant:
                self._yield_requested = True
        elif kind is p.Revoke:
            if msg.grant == self._grant:
                self._grant = None
                self._yield_requested = False
                self.revocations += 1
                log.warning("[client] token revoked grant=%d reason=%s", msg.grant, msg.reason)
        elif msg.id in self._awaiting:
            self._replies[msg.id] = msg
        elif kind is p.Error and msg.code != p.ErrorCode.NOT_HOLDER:
            # Error to a request sent without waiting. A release that raced a
            # revoke (E_NOT_HOLDER) is harmless; anything else is raised.
            self._async_error = from_reply(msg.code, msg.message)

    def _check_daemon(self) -> None:
        hb = self._heartbeat
        if hb is None or hb.healthy():
            return
        cause = hb.failure()
        if self.reconnect and not self._closed:
            self._reconnect(cause)
        else:
            raise DaemonUnavailableError(self.endpoint, cause)


class _HeartbeatThread(threading.Thread):
    """Sends ``heartbeat`` on its own socket and tells when the daemon stops answering."""

    def __init__(self, ctx: zmq.Context, endpoint: str, welcome: p.Welcome, misses: int = 3) -> None:
        super().__init__(name=f"nodeagent-heartbeat-{welcome.session}", daemon=True)
        self._ctx = ctx
        self._endpoint = endpoint
        self._session = welcome.session
        self._key = welcome.key
        self._interval_s = welcome.heartbeat_ms / 1000.0
        self._limit_s = self._interval_s * misses
        self._stop_event = threading.Event()
        self._last_ok = time.monotonic()
        self._failure: str | None = None

    def healthy(self) -> bool:
        if self._failure is not None:
            return False
        if time.monotonic() - self._last_ok > self._limit_s + self._interval_s:
            return False  # the thread itself is stuck: treat like no answer
        return True

    def failure(self) -> str:
        return self._failure or f"no heartbeat reply for {self._limit_s:.1f} s"

    def stop(self) -> None:
        self._stop_event.set()
        if self.is_alive() and threading.current_thread() is not self:
            self.join(timeout=2.0)

    def run(self) -> None:
        sock = self._ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(self._endpoint)
        rid = 0
        try:
            while not self._stop_event.is_set():
                rid += 1
                sock.send(codec.encode(p.Heartbeat(id=rid, session=self._session, key=self._key)))
                sent = time.monotonic()
                while True:  # wait for this heartbeat's reply, up to one interval
                    left_ms = int((sent + self._interval_s - time.monotonic()) * 1000)
                    if left_ms <= 0 or not sock.poll(left_ms, zmq.POLLIN):
                        break
                    try:
                        reply = codec.decode_reply(sock.recv())
                    except codec.BadFrame:
                        continue
                    if reply.id != rid:
                        continue
                    if isinstance(reply, p.Error):
                        self._failure = f"daemon dropped the session: {reply.code}: {reply.message}"
                        return
                    self._last_ok = time.monotonic()
                    break
                if time.monotonic() - self._last_ok > self._limit_s:
                    self._failure = f"no heartbeat reply for {self._limit_s:.1f} s"
                    return
                self._stop_event.wait(max(0.0, sent + self._interval_s - time.monotonic()))
        finally:
            sock.close(0)


def query_status(endpoint: str | None = None, timeout: float = 5.0,
                 context: zmq.Context | None = None) -> p.StatusReply:
    """One status request without opening a session (what ``nodeagent status`` does)."""
    endpoint = endpoint or client_endpoint()
    ctx = context if context is not None else zmq.Context.instance()
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    try:
        sock.connect(endpoint)
        sock.send(codec.encode(p.StatusRequest(id=1)))
        if not sock.poll(int(timeout * 1000), zmq.POLLIN):
            raise DaemonUnavailableError(endpoint, f"no status reply within {timeout} s "
                                         "(is `nodeagent serve` running there?)")
        reply = codec.decode_reply(sock.recv())
    finally:
        sock.close(0)
    if isinstance(reply, p.Error):
        raise from_reply(reply.code, reply.message)
    if not isinstance(reply, p.StatusReply):
        raise NodeAgentError(f"expected status_reply, got {type(reply).__name__}")
    return reply
