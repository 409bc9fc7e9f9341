"""The events socket of the cluster endpoint (:class:`EventPublisher`): what happened on this
node, numbered, one :class:`client_lib.protocol.Event` per message under its ``kind`` as topic.
Detail: docs/internals.md.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import zmq

from client_lib import codec
from client_lib import protocol as p

log = logging.getLogger("nodeagent.events")

KINDS = ("device_state", "grant", "preempt", "session_join", "session_leave", "suspend", "resume",
         "reclaim", "lend", "policy", "health", "renew", "weight")
"""Every ``Event.kind`` the daemon publishes (the topic frame of each message)."""

_TOPICS = {kind: kind.encode() for kind in KINDS}


class EventPublisher:
    """Numbers, stamps and sends events on a bound XPUB socket it does not own."""

    def __init__(self, sock: zmq.Socket, node: str, boot: int,
                 wall_clock: Callable[[], float] = time.time) -> None:
        self._sock = sock
        self.node = node
        self.boot = boot
        self.seq = 0  # of the last event published
        self.dropped = 0  # events libzmq would not take (socket closed or full)
        self._wall = wall_clock
        self._prefixes: set[bytes] = set()  # topics subscribed to by someone (SUB filters are prefixes)
        self._wanted = dict.fromkeys(KINDS, False)

    def wanted(self, kind: str) -> bool:
        """Whether a subscriber would receive an event of ``kind``."""
        return self._wanted.get(kind, False)

    def on_subscriptions(self) -> None:
        """Read (un)subscriptions off the socket; the loop calls this when it is readable.

        A non-verbose XPUB passes a topic's first subscription and its last
        unsubscription (a subscriber leaving counts), so a set is enough."""
        changed = False
        while True:
            try:
                msg = self._sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            if msg[:1] == b"\x01":
                self._prefixes.add(msg[1:])
                changed = True
            elif msg[:1] == b"\x00":
                self._prefixes.discard(msg[1:])
                changed = True
        if changed:
            self._wanted = {kind: any(topic.startswith(prefix) for prefix in self._prefixes)
                            for kind, topic in _TOPICS.items()}
            log.info("[events] subscriptions now %s", sorted(k for k, on in self._wanted.items() if on) or "none")

    def publish(self, kind: str, device: int | None = None, session: str | None = None, **data) -> None:
        """Send one event if anyone subscribed to its kind; never blocks (PUB drops for a slow subscriber)."""
        wanted = self._wanted.get(kind)
        if not wanted:
            if wanted is None:
                raise ValueError(f"unknown event kind {kind!r}; add it to nodeagent.daemon.events.KINDS")
            return
        self.seq += 1
        event = p.Event(node=self.node, seq=self.seq, boot=self.boot, time=self._wall(), kind=kind,
                        device=device, session=session, data=data)
        try:
            self._sock.send_multipart([_TOPICS[kind], codec.encode(event)], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            self.dropped += 1
            log.warning("[events] dropped seq=%d kind=%s: %s", self.seq, kind, exc)
