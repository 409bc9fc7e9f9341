"""The cluster endpoint's ZAP thread (pyzmq's, which pulls in asyncio): imported only when a
CURVE cluster endpoint starts, so that a daemon without one does not pay for it at start."""

from __future__ import annotations

from zmq.auth.thread import ThreadAuthenticator
from zmq.utils import z85


class Authenticator(ThreadAuthenticator):
    """pyzmq's ZAP thread, naming an allowed client by its key file (the frames' ``User-Id``)."""

    names: dict[bytes, str]  # z85 public key -> client name; set before start(), replaced whole, never mutated

    def curve_user_id(self, client_public_key: bytes) -> str:
        key = z85.encode(client_public_key)
        return self.names.get(key, key.decode("ascii"))
