"""A bare DEALER speaking the wire protocol by hand, for tests that need to
misbehave in ways the client library never would."""

from __future__ import annotations

import os

import zmq

from client_lib import codec
from client_lib import protocol as p


class RawPeer:
    def __init__(self, endpoint: str) -> None:
        self.ctx = zmq.Context.instance()
        self.sock = self.ctx.socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.connect(endpoint)
        self._next_id = 1
        self.notices: list = []

    def take_id(self) -> int:
        rid = self._next_id
        self._next_id += 1
        return rid

    def send(self, msg) -> None:
        self.sock.send(msg if isinstance(msg, bytes) else codec.encode(msg))

    def recv(self, timeout: float = 5.0):
        if not self.sock.poll(int(timeout * 1000), zmq.POLLIN):
            raise TimeoutError(f"nothing from the daemon within {timeout} s")
        return codec.decode_reply(self.sock.recv())

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
        self.sock.close(0)
