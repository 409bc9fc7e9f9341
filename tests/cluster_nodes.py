"""A daemon's cluster endpoint as the tests reach it: keys and a ``[cluster]`` config written
for ``start_daemon``, a CURVE peer that speaks the wire protocol by hand, the events stream."""

from __future__ import annotations

import os
import shutil
import time
from dataclasses import dataclass

import msgspec
import zmq

from client_lib import codec
from client_lib import protocol as p
from nodeagent import keys
from tests.conftest import free_port


_event_decoder = msgspec.msgpack.Decoder(p.Event)


@dataclass
class ClusterNode:
    """What a test needs to reach one daemon's cluster endpoint."""

    daemon: object  # tests.conftest.Daemon
    endpoint: str
    events: str
    keys_dir: str
    client_secret: str  # the allowed "placement" client's key file

    @property
    def server_public(self) -> bytes:
        return keys.server_public(self.keys_dir)

    def peer(self, keypair: tuple[bytes, bytes] | None = None) -> CurvePeer:
        return CurvePeer(self.endpoint, self.server_public, keypair or keys.load_client(self.client_secret))

    def subscriber(self, keypair: tuple[bytes, bytes] | None = None, topics: tuple[bytes, ...] = (b"",)
                   ) -> EventStream:
        return EventStream(self.events, self.server_public, keypair or keys.load_client(self.client_secret), topics)


def write_cluster_config(workdir: str, *, node: str = "n1", protect_s: float = 60.0,
                         health_interval_s: float = 0.2, extra: str = "",
                         allow: ClusterNode | None = None) -> ClusterNode:
    """Keys under ``workdir/keys`` and a ``[cluster]`` section in ``workdir/nodeagent.toml``
    (what ``start_daemon`` reads) on two free loopback ports. ``allow``: another node whose
    "placement" client is to be allowed here too (else one is made for this node)."""
    keys_dir = os.path.join(workdir, "keys")
    if allow is None:
        client_secret = keys.generate(keys_dir, clients=("placement",)).clients["placement"]
    else:  # this node's own server key; the other node's client public key copied into allowed/
        keys.generate(keys_dir, clients=())
        os.makedirs(os.path.join(keys_dir, keys.ALLOWED_DIR), exist_ok=True)
        shutil.copy(os.path.join(allow.keys_dir, keys.ALLOWED_DIR, "placement.key"),
                    os.path.join(keys_dir, keys.ALLOWED_DIR, "placement.key"))
        client_secret = allow.client_secret
    endpoint, events = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    with open(os.path.join(workdir, "nodeagent.toml"), "w") as f:
        f.write(f'{extra}\n[cluster]\nendpoint = "{endpoint}"\nevents_endpoint = "{events}"\n'
                f'keys_dir = "{keys_dir}"\nnode = "{node}"\nprotect_s = {protect_s}\n'
                f'health_interval_s = {health_interval_s}\n')
    return ClusterNode(None, endpoint, events, keys_dir, client_secret)


class CurvePeer:
    """A DEALER with CURVE client keys, speaking the wire protocol by hand."""

    def __init__(self, endpoint: str, server_public: bytes | None, keypair: tuple[bytes, bytes] | None) -> None:
        self.sock = zmq.Context.instance().socket(zmq.DEALER)
        self.sock.setsockopt(zmq.LINGER, 0)
        if keypair is not None:
            self.sock.curve_publickey, self.sock.curve_secretkey = keypair
            self.sock.curve_serverkey = server_public
        self.sock.connect(endpoint)
        self._next_id = 0

    def call(self, msg, timeout: float = 10.0):
        """Send ``msg`` (its id replaced by a fresh one) and return the reply with that id."""
        return self.reply(self.send(msg, timeout), timeout)

    def send(self, msg, timeout: float = 10.0) -> int:
        """Send ``msg`` with a fresh id (returned) without waiting for the reply."""
        self._next_id += 1
        msg.id = self._next_id
        # A DEALER holds a message only for a peer it is connected to (handshake done): wait for one.
        try:
            if not self.sock.poll(int(timeout * 1000), zmq.POLLOUT):
                raise zmq.Again()
            self.sock.send(codec.encode(msg), zmq.NOBLOCK)
        except zmq.Again:  # the connection went (a refused handshake) between the poll and the send
            raise TimeoutError(f"no connection to send {type(msg).__name__} on within {timeout} s") from None
        return msg.id

    def reply(self, request_id: int, timeout: float = 10.0):
        """The reply to request ``request_id``."""
        deadline = time.monotonic() + timeout
        while True:
            left_ms = int((deadline - time.monotonic()) * 1000)
            if left_ms <= 0 or not self.sock.poll(left_ms):
                raise TimeoutError(f"no reply to request {request_id} within {timeout} s")
            reply = codec.decode_reply(self.sock.recv())
            if reply.id == request_id:
                return reply

    def close(self) -> None:
        self.sock.close(0)


class EventStream:
    """A CURVE SUB socket on the events endpoint, keeping what arrives in order."""

    def __init__(self, endpoint: str, server_public: bytes, keypair: tuple[bytes, bytes],
                 topics: tuple[bytes, ...] = (b"",)) -> None:
        self.sock = zmq.Context.instance().socket(zmq.SUB)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.curve_publickey, self.sock.curve_secretkey = keypair
        self.sock.curve_serverkey = server_public
        for topic in topics:
            self.sock.setsockopt(zmq.SUBSCRIBE, topic)
        self.sock.connect(endpoint)
        self.events: list[p.Event] = []

    def pump(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self.sock.poll(max(0, int((deadline - time.monotonic()) * 1000))):
            topic, body = self.sock.recv_multipart()
            event = _event_decoder.decode(body)
            assert topic == event.kind.encode()
            self.events.append(event)
            if time.monotonic() >= deadline:
                return

    def wait_for(self, predicate, timeout: float = 10.0) -> p.Event:
        """The first event (kept or new) for which ``predicate`` holds."""
        deadline = time.monotonic() + timeout
        seen = 0
        while True:
            for event in self.events[seen:]:
                if predicate(event):
                    return event
            seen = len(self.events)
            left = deadline - time.monotonic()
            if left <= 0:
                raise AssertionError(f"no matching event within {timeout} s; got {[e.kind for e in self.events]}")
            self.pump(min(left, 0.05))

    def close(self) -> None:
        self.sock.close(0)


def inventory_or_none(peer: CurvePeer):
    try:
        return peer.call(p.Inventory(id=0), timeout=0.5)
    except TimeoutError:
        return None
