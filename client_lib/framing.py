"""The local endpoint's framing: length-prefixed MessagePack over a unix (or TCP) stream socket.
docs/protocol.md specifies it.
"""

from __future__ import annotations

import errno
import itertools
import logging
import select
import socket
import struct
import time
from contextlib import suppress
from typing import NamedTuple

from client_lib.endpoint import ipc_path

log = logging.getLogger("client_lib.framing")

HEADER = struct.Struct(">I")
HEADER_BYTES = HEADER.size
MAX_DAEMON_FRAME_BYTES = 16 * 1024 * 1024
"""Largest message the daemon sends (a status of thousands of sessions fits)."""

_RECV_CHUNK = 64 * 1024  # below glibc's mmap threshold; read into one buffer kept per connection
_CONNECT_RETRY_FIRST_S = 0.001  # a full backlog: the first wait before connecting again, doubled each try
_CONNECT_RETRY_MAX_S = 0.05


class BacklogFull(ConnectionError):
    """The daemon's listen backlog stayed full (EAGAIN on connect) for the whole timeout."""

    def __init__(self, tries: int, waited_s: float) -> None:
        super().__init__(errno.EAGAIN, f"the daemon's listen backlog stayed full for {waited_s:.1f} s "
                                       f"({tries} tries)")


class FrameTooLarge(ValueError):
    """A frame declared more bytes than its direction allows."""

    def __init__(self, declared: int, limit: int) -> None:
        super().__init__(f"frame declares {declared} bytes, more than the {limit}-byte limit")


def pack(body: bytes) -> bytes:
    """One frame: the length header and ``body``."""
    return HEADER.pack(len(body)) + body


class Oversized(NamedTuple):
    """Stands, in :meth:`FrameBuffer.feed`'s output, for a frame longer than the
    buffer's bound but short enough to skip: its body is discarded unread."""

    declared: int
    limit: int


class FrameBuffer:
    """Reassembles frames from a byte stream, holding at most ``max_frame_bytes``
    of any one frame.

    ``feed`` bytes as they arrive; it returns the frames they completed. A
    frame over ``max_frame_bytes`` but within ``skip_up_to_bytes`` comes out as
    an :class:`Oversized` marker and its body is dropped as it streams in; a
    header declaring more than that raises :class:`FrameTooLarge` at once."""

    __slots__ = ("_buf", "_max", "_skip_limit", "_skipping")

    def __init__(self, max_frame_bytes: int, skip_up_to_bytes: int = 0) -> None:
        self._buf = bytearray()
        self._max = max_frame_bytes
        self._skip_limit = max(skip_up_to_bytes, max_frame_bytes)
        self._skipping = 0  # body bytes of an oversized frame still to discard

    def __len__(self) -> int:
        return len(self._buf)

    def feed(self, data: bytes) -> list:
        """Add ``data``; returns the frames (bytes, or :class:`Oversized`) it completed."""
        if self._skipping:
            dropped = min(self._skipping, len(data))
            self._skipping -= dropped
            data = data[dropped:]
        buf = self._buf
        buf += data
        out: list = []
        start = 0
        end = len(buf)
        while end - start >= HEADER_BYTES:
            (length,) = HEADER.unpack_from(buf, start)
            if length > self._max:
                if length > self._skip_limit:
                    raise FrameTooLarge(length, self._skip_limit)
                out.append(Oversized(length, self._max))
                start += HEADER_BYTES
                dropped = min(length, end - start)
                start += dropped
                if dropped < length:
                    self._skipping = length - dropped
                    break
                continue
            stop = start + HEADER_BYTES + length
            if stop > end:
                break
            out.append(bytes(buf[start + HEADER_BYTES:stop]))
            start = stop
        if start:
            del buf[:start]
        return out


def parse_endpoint(endpoint: str) -> tuple[int, object]:
    """(address family, address) of a local endpoint: ``ipc://PATH`` or ``tcp://HOST:PORT``."""
    path = ipc_path(endpoint)
    if path is not None:
        if not path:
            raise ValueError(f"endpoint {endpoint!r} names no socket path")
        return socket.AF_UNIX, path
    if endpoint.startswith("tcp://"):
        host, sep, port = endpoint[len("tcp://"):].rpartition(":")
        if not sep or not port.isdigit():
            raise ValueError(f"endpoint {endpoint!r} is not tcp://HOST:PORT")
        host = host.strip("[]")
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        return family, (host, int(port))
    raise ValueError(f"endpoint {endpoint!r} is neither ipc://PATH nor tcp://HOST:PORT")


class Connection:
    """The client's end of one connection to the daemon, used from one thread
    at a time. Sends whole frames; receives into a :class:`FrameBuffer`."""

    def __init__(self, endpoint: str, timeout: float) -> None:
        family, address = parse_endpoint(endpoint)
        sock = socket.socket(family, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            sock.settimeout(max(timeout, 0.001))
            _connect(sock, address, endpoint, timeout)
            if family != socket.AF_UNIX:
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        except BaseException:
            sock.close()
            raise
        sock.setblocking(False)
        self.sock = sock
        self._frames = FrameBuffer(MAX_DAEMON_FRAME_BYTES)
        self._ready: list[bytes] = []
        self._rbuf = bytearray(_RECV_CHUNK)
        self._rview = memoryview(self._rbuf)
        self._poll_in = select.poll()  # kept: a wait for the grant is the hot path
        self._poll_in.register(sock, select.POLLIN)
        self.closed_by_peer = False

    def fileno(self) -> int:
        return self.sock.fileno()

    def send(self, body: bytes, timeout: float = 5.0) -> None:
        """Send one frame whole. ``ConnectionError`` if the daemon is gone, or if it
        has not read for ``timeout`` seconds (our bytes cannot leave)."""
        data = memoryview(pack(body))
        deadline = None
        while data:
            try:
                sent = self.sock.send(data)
            except BlockingIOError:
                now = time.monotonic()
                deadline = deadline or now + timeout
                poller = select.poll()
                poller.register(self.sock, select.POLLOUT)
                if now >= deadline or not poller.poll(max(0, int((deadline - now) * 1000 + 0.999))):
                    raise ConnectionError(errno.ETIMEDOUT, "daemon is not reading") from None
                continue
            except OSError as exc:
                self.closed_by_peer = True
                raise ConnectionError(exc.errno, str(exc)) from None
            data = data[sent:]

    def recv(self, timeout: float) -> list[bytes]:
        """Frames that arrive within ``timeout`` seconds (0: only those here now).
        ``ConnectionError`` once the daemon closed the connection and every frame
        it sent before was taken."""
        if self._ready:
            frames, self._ready = self._ready, []
            return frames
        if self.closed_by_peer:
            raise ConnectionError(errno.ECONNRESET, "daemon closed the connection")
        deadline = None
        while True:
            try:
                n = self.sock.recv_into(self._rbuf)
            except BlockingIOError:
                now = time.monotonic()
                deadline = deadline or now + timeout
                left = deadline - now
                if left <= 0 or not self._poll_in.poll(int(left * 1000 + 0.999)):
                    return []
                continue
            except OSError as exc:
                self.closed_by_peer = True
                raise ConnectionError(exc.errno, str(exc)) from None
            if not n:
                self.closed_by_peer = True
                raise ConnectionError(errno.ECONNRESET, "daemon closed the connection")
            frames = self._frames.feed(self._rview[:n])
            if frames:
                return frames

    def close(self) -> None:
        with suppress(OSError):
            self.sock.close()


def _connect(sock: socket.socket, address, endpoint: str, timeout_s: float) -> None:
    """Connect, trying again while the daemon's backlog is full: a unix socket's connect
    fails at once with EAGAIN then (TCP waits in SYN retries instead). Waits 1 ms, then
    twice as long each try up to 50 ms, until ``timeout_s`` has passed: :class:`BacklogFull`."""
    start = time.monotonic()
    delay = _CONNECT_RETRY_FIRST_S
    for tries in itertools.count(1):
        try:
            sock.connect(address)
            return
        except BlockingIOError:
            waited = time.monotonic() - start
            if tries == 1:
                log.debug("[client] %s: the daemon's listen backlog is full; connecting again for up to %.1f s",
                          endpoint, timeout_s)
            if waited >= timeout_s:
                raise BacklogFull(tries, waited) from None
            time.sleep(min(delay, timeout_s - waited))
            delay = min(delay * 2, _CONNECT_RETRY_MAX_S)


__all__ = ["BacklogFull", "Connection", "FrameBuffer", "FrameTooLarge", "HEADER_BYTES", "MAX_DAEMON_FRAME_BYTES",
           "Oversized", "pack", "parse_endpoint"]
