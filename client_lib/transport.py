"""The client's connection to the daemon: open it, number and send requests, wait for replies.
It knows nothing of sessions: what a notice means is the :class:`~client_lib.client.Client`'s
to decide. Detail: docs/internals.md.
"""

from __future__ import annotations

import errno
import itertools
import logging
import threading
import time
from typing import Callable

from client_lib import codec, framing
from client_lib import protocol as p
from client_lib.endpoint import ENV_ENDPOINT, SOCKET_GROUP, client_endpoint, socket_group
from client_lib.errors import DaemonUnavailableError, HandshakeTimeoutError, NodeAgentError, from_reply

log = logging.getLogger("client_lib.client")

ENV_HANDSHAKE_TIMEOUT = "NODEAGENT_HANDSHAKE_TIMEOUT_S"
POLL_SLICE_MS = 50  # longest blind wait: how soon a lost daemon is noticed while blocked


class Transport:
    """One client's connection to the daemon at ``endpoint``; see the module docstring."""

    def __init__(self, endpoint: str) -> None:
        self.endpoint = endpoint
        self.conn: framing.Connection | None = None
        self.io = threading.RLock()  # held while the client reads or writes; the liveness thread only tries it
        self._ids = itertools.count(1)
        self._replies: dict[int, p.DaemonMessage] = {}
        self._awaiting: set[int] = set()  # ids of requests a call() is waiting on

    # ------------------------------------------------------------ connection

    def open(self, timeout: float) -> None:
        """A new connection (the old one, if any, is closed first); it answers nothing the old one asked."""
        self.close()
        self._replies.clear()
        self.conn = open_connection(self.endpoint, timeout)

    def close(self) -> None:
        if self.conn is not None:
            self.conn.close()
            self.conn = None

    @property
    def healthy(self) -> bool:
        """False once the daemon closed the connection (it went away or restarted), or none is open."""
        conn = self.conn
        return conn is not None and not conn.closed_by_peer

    # -------------------------------------------------------------- requests

    def take_id(self) -> int:
        return next(self._ids)

    def send_quiet(self, req: p.ClientMessage) -> None:
        """Send ``req`` (its id from :meth:`take_id`) without waiting: only an error reply matters, and
        the client raises it later. A daemon that went away is noticed by the client's next check. The
        caller builds ``req``: no keyword packing on the path of every release and request."""
        with self.io:
            conn = self.conn
            if conn is None:
                return
            try:  # not contextlib.suppress: 0.3 us more on every release and request
                conn.send(codec.encode(req))
            except ConnectionError:
                pass  # conn.closed_by_peer is set: the daemon is gone

    def call(self, req: p.ClientMessage, timeout: float, pump: Callable[[int], object],
             handshake: bool = False) -> p.DaemonMessage:
        """Send ``req`` and wait for its reply; ``pump(ms)`` handles what arrives meanwhile
        (it hands replies back through :meth:`deliver`). An error reply is raised."""
        with self.io:
            conn = self.conn
            if conn is None:  # the last attempt to (re)connect failed
                raise DaemonUnavailableError(self.endpoint, "no connection (the last attempt to connect failed)")
            try:
                conn.send(codec.encode(req))
            except ConnectionError as exc:
                raise DaemonUnavailableError(self.endpoint, f"connection lost ({exc.strerror or exc})") from None
            deadline = time.monotonic() + timeout
            self._awaiting.add(req.id)
            try:
                while req.id not in self._replies:
                    if conn.closed_by_peer:
                        raise DaemonUnavailableError(self.endpoint, "the daemon closed the connection before "
                                                     f"answering {type(req).__name__}")
                    remaining = deadline - time.monotonic()
                    if remaining <= 0 and handshake:
                        raise HandshakeTimeoutError(
                            self.endpoint, f"no welcome within {timeout} s (is `nodeagent serve` running? "
                            f"raise handshake_timeout_s or {ENV_HANDSHAKE_TIMEOUT} if it is slow to answer)")
                    if remaining <= 0:
                        raise DaemonUnavailableError(self.endpoint,
                                                     f"no reply to {type(req).__name__} within {timeout} s")
                    pump(min(POLL_SLICE_MS, max(1, int(remaining * 1000))))
            finally:
                self._awaiting.discard(req.id)
            reply = self._replies.pop(req.id)
        if isinstance(reply, p.Error):
            raise from_reply(reply.code, reply.message)
        return reply

    def receive(self, timeout_ms: int) -> list[p.DaemonMessage] | None:
        """The daemon's messages that arrive within ``timeout_ms``; None when there is no
        connection to wait on (none open, or the daemon closed it). Call under :attr:`io`."""
        conn = self.conn
        if conn is None or conn.closed_by_peer:
            if timeout_ms:
                time.sleep(min(timeout_ms, POLL_SLICE_MS) / 1000.0)  # nothing to wait on: do not spin
            return None
        try:
            frames = conn.recv(timeout_ms / 1000.0)
        except ConnectionError:
            return None  # the daemon went away: the client decides what follows
        messages = []
        for frame in frames:
            try:
                messages.append(codec.decode_reply(frame))
            except codec.BadFrame as exc:
                log.warning("[client] ignoring a frame from the daemon: %s", exc)
        return messages

    def deliver(self, msg: p.DaemonMessage) -> bool:
        """Keep ``msg`` if it answers a request being waited on; True if it did."""
        if msg.id in self._awaiting:
            self._replies[msg.id] = msg
            return True
        return False


def open_connection(endpoint: str, timeout: float) -> framing.Connection:
    """A connection to the daemon; :class:`DaemonUnavailableError` saying why there is none."""
    try:
        return framing.Connection(endpoint, timeout)
    except framing.BacklogFull as exc:
        raise DaemonUnavailableError(endpoint, f"{exc.strerror}: the daemon is not accepting connections as fast "
                                     "as they come (overloaded, or stopped); retry later or allow a longer "
                                     "timeout") from None
    except (FileNotFoundError, ConnectionRefusedError):
        raise DaemonUnavailableError(endpoint, "nothing listens there (is `nodeagent serve` running? "
                                     f"set {ENV_ENDPOINT} to its endpoint)") from None
    except PermissionError:
        group = socket_group(endpoint)
        if group is None:
            raise DaemonUnavailableError(endpoint, f"permission denied: the socket is for root only (its daemon "
                                         f"found no group {SOCKET_GROUP!r} to give it; create that group, add "
                                         "your user to it and restart the daemon)") from None
        raise DaemonUnavailableError(endpoint, f"permission denied: the socket is for root and {group} (ask "
                                     "to be added to it, then log in again)") from None
    except TimeoutError:
        raise DaemonUnavailableError(endpoint, f"no connection within {timeout} s") from None
    except ValueError as exc:
        raise DaemonUnavailableError(endpoint, str(exc)) from None
    except OSError as exc:
        if exc.errno in (errno.EMFILE, errno.ENFILE):
            raise NodeAgentError(f"cannot connect to the daemon at {endpoint}: this process is out of file "
                                 "descriptors (close unused clients or raise its limit)") from None
        raise DaemonUnavailableError(endpoint, exc.strerror or str(exc)) from None


def one_shot(request: p.ClientMessage, expected: type, endpoint: str | None, timeout: float, what: str):
    """Send one request without a session and return its typed reply."""
    endpoint = endpoint or client_endpoint()
    conn = open_connection(endpoint, timeout)
    try:
        deadline = time.monotonic() + timeout
        try:
            conn.send(codec.encode(request), timeout)
            reply = None
            while reply is None:
                frames = conn.recv(max(0.0, deadline - time.monotonic()))
                reply = next((msg for msg in map(codec.decode_reply, frames)
                              if msg.id == request.id or (isinstance(msg, p.Error) and msg.id == 0)), None)
                if reply is None and not frames and time.monotonic() >= deadline:
                    raise DaemonUnavailableError(endpoint, f"no {what} reply within {timeout} s")
        except ConnectionError:
            raise DaemonUnavailableError(endpoint, f"the daemon closed the connection before its {what} "
                                         "reply") from None
    finally:
        conn.close()
    if isinstance(reply, p.Error):
        raise from_reply(reply.code, reply.message)
    if not isinstance(reply, expected):
        raise NodeAgentError(f"expected {expected.__name__}, got {type(reply).__name__}")
    return reply
