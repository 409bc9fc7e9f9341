"""A bare connection speaking the wire protocol by hand, for tests that need to
misbehave in ways the client library never would: raw bytes, bad headers,
frames it never reads the answers to."""

from __future__ import annotations

import os
import select
import time

from client_lib import codec, framing
from client_lib import protocol as p


class RawPeer:
    def __init__(self, endpoint: str, timeout: float = 5.0) -> None:
        self.conn = framing.Connection(endpoint, timeout)
        self._next_id = 1
        self.notices: list = []

    def take_id(self) -> int:
        rid = self._next_id
        self._next_id += 1
        return rid

    def send(self, msg) -> None:
        """One frame: a message, or ``bytes`` used as the frame's body as they are."""
        self.conn.send(msg if isinstance(msg, bytes) else codec.encode(msg))

    def send_raw(self, data: bytes) -> None:
        """Bytes onto the stream with no framing added (bad headers, split frames)."""
        self.conn.sock.setblocking(True)
        try:
            self.conn.sock.sendall(data)
        finally:
            self.conn.sock.setblocking(False)

    def recv_frames(self, timeout: float = 0.0) -> list[bytes]:
        """Raw frames that arrive within ``timeout`` (ConnectionError once closed)."""
        return self.conn.recv(timeout)

    def readable(self, timeout: float) -> bool:
        poller = select.poll()
        poller.register(self.conn.fileno(), select.POLLIN)
        return bool(poller.poll(int(timeout * 1000)))

    def recv(self, timeout: float = 5.0):
        deadline = time.monotonic() + timeout
        while True:
            if self._pending:
                return codec.decode_reply(self._pending.pop(0))
            left = deadline - time.monotonic()
            frames = self.conn.recv(max(0.0, left))
            if frames:
                self._pending.extend(frames)
                continue
            if time.monotonic() >= deadline:
                raise TimeoutError(f"nothing from the daemon within {timeout} s")

    @property
    def _pending(self) -> list[bytes]:
        pending = self.__dict__.get("_frames_pending")
        if pending is None:
            pending = self.__dict__["_frames_pending"] = []
        return pending

    def call(self, msg, timeout: float = 5.0):
        """Send and return the reply with the same id; notices are kept in ``notices``."""
        self.send(msg)
        while True:
            reply = self.recv(timeout)
            if reply.id == msg.id and reply.id != 0:
                return reply
            self.notices.append(reply)

    def next_notice(self, kind, timeout: float = 5.0):
        """The next notice of type ``kind`` (already received ones first)."""
        for i, n in enumerate(self.notices):
            if isinstance(n, kind):
                return self.notices.pop(i)
        while True:
            msg = self.recv(timeout)
            if isinstance(msg, kind):
                return msg
            self.notices.append(msg)

    def hello(self, name: str = "raw", workload: str = "training", **fields) -> p.Welcome:
        fields.setdefault("pid", os.getpid())
        fields.setdefault("protocol", p.PROTOCOL_VERSION)
        reply = self.call(p.Hello(id=self.take_id(), name=name, workload=workload, **fields))
        assert isinstance(reply, p.Welcome), reply
        return reply

    def close(self) -> None:
        self.conn.close()
