"""The cluster-side client: one placement layer talking to many nodeagent daemons at once, and
their events as one stream. Not thread-safe (ZeroMQ sockets are not): use one PlacementClient
per thread. Detail: docs/internals.md.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass
from typing import TypeVar

import msgspec
import zmq
import zmq.auth

from client_lib import codec, framing
from client_lib import protocol as p
from client_lib.endpoint import ipc_path
from client_lib.limits import DEFAULT_SUSPEND_DEADLINE_MS
from client_lib.errors import DaemonError

log = logging.getLogger("client_lib.placement")

__all__ = ["ClientKeys", "NodeResult", "NodeTimeoutError", "PlacementClient", "PlacementError",
           "load_server_public"]

E_BAD_REPLY = "E_BAD_REPLY"
E_NOT_SUSPENDED = "E_NOT_SUSPENDED"  # lend(..., suspend=...): a session did not end suspended

R = TypeVar("R")


class PlacementError(DaemonError):
    """A node refused or failed a request. ``code`` is an :class:`~client_lib.protocol.ErrorCode`
    (or E_TIMEOUT, E_UNAVAILABLE, E_BAD_REPLY, E_NOT_SUSPENDED from this side); ``node`` names the node."""

    def __init__(self, code: str, message: str, node: str) -> None:
        super().__init__(f"{node}: {code}: {message}", code)
        self.node = node
        self.reason = message


class NodeTimeoutError(PlacementError, TimeoutError):
    """No reply from ``node`` within the timeout (down, unreachable, a key it does not allow, or slow)."""

    def __init__(self, node: str, endpoint: str, timeout_ms: float) -> None:
        super().__init__(p.ErrorCode.TIMEOUT, f"no reply from {endpoint} within {timeout_ms:g} ms (daemon "
                         "down, unreachable, or our key not in its allowed/ directory?)", node)
        self.endpoint = endpoint
        self.timeout_ms = timeout_ms


@dataclass(frozen=True)
class ClientKeys:
    """This client's CURVE key pair (Z85 bytes, as ``nodeagent keys generate`` writes them)."""

    public: bytes
    secret: bytes

    @classmethod
    def load(cls, path: str) -> ClientKeys:
        """From a ``.key_secret`` certificate file; ValueError naming the file when it is not one."""
        try:
            public, secret = zmq.auth.load_certificate(path)
        except (OSError, ValueError) as exc:
            raise ValueError(f"{path}: cannot load client keys: {exc}") from None
        if secret is None:
            raise ValueError(f"{path}: holds only a public key; give this client's .key_secret file")
        if zmq.curve_public(secret) != public:
            raise ValueError(f"{path}: the public key does not belong to the secret key")
        return cls(public, secret)


def load_server_public(path: str) -> bytes:
    """A daemon's public key from its ``server.key`` file (ValueError naming the file otherwise)."""
    try:
        public, _ = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: cannot load the server public key: {exc}") from None
    return public


@dataclass(frozen=True)
class NodeResult:
    """One node's answer to :meth:`PlacementClient.call`: ``reply`` (an ``Error`` reply too), or ``error``."""

    node: str
    reply: object | None
    error: Exception | None

    @property
    def ok(self) -> bool:
        return self.error is None


def _server_key(key: Mapping[str, bytes] | bytes | None, name: str) -> bytes:
    if not isinstance(key, (bytes, str)):
        if key is None or name not in key:
            raise ValueError(f"no server public key for node {name!r}: pass server_keys (its server.key, "
                             "see load_server_public) or keys=None for plain tcp")
        key = key[name]
    return key.encode() if isinstance(key, str) else key


def _named(what: str, endpoints: Sequence[str] | Mapping[str, str]) -> dict[str, str]:
    if isinstance(endpoints, str):
        raise ValueError(f"{what} must be a list of endpoints or a mapping of name to endpoint, not a string")
    named = dict(endpoints) if isinstance(endpoints, Mapping) else {e: e for e in endpoints}
    if not isinstance(endpoints, Mapping) and len(named) != len(endpoints):
        raise ValueError(f"{what} lists an endpoint more than once")
    for name, endpoint in named.items():
        if not isinstance(endpoint, str) or "://" not in endpoint:
            raise ValueError(f"{what}[{name!r}] = {endpoint!r} is not an endpoint like tcp://HOST:PORT")
    return named


class PlacementClient:
    """Requests to many nodeagent daemons at once, and their events as one stream.

    ``nodes``: cluster endpoints (each is then its own name) or name -> endpoint.
    ``keys``: this client's key pair; None speaks plain tcp (tests, a trusted network).
    ``server_keys``: each node's server public key by name, or one key shared by all.
    ``events``: events endpoints, in the order of ``nodes``, or node name -> endpoint.
    """

    def __init__(self, nodes: Sequence[str] | Mapping[str, str], *, keys: ClientKeys | None,
                 server_keys: Mapping[str, bytes] | bytes | None = None, timeout_ms: float = 5000.0,
                 events: Sequence[str] | Mapping[str, str] | None = None) -> None:
        self._nodes = _named("nodes", nodes)
        if not self._nodes:
            raise ValueError("nodes is empty: give at least one daemon endpoint")
        if not timeout_ms > 0:
            raise ValueError(f"timeout_ms must be > 0, got {timeout_ms!r}")
        self.timeout_ms = float(timeout_ms)
        self._keys = keys
        # each node's server key, found now to fail naming the node rather than at the first call
        self._server_public = ({name: _server_key(server_keys, name) for name in self._nodes}
                               if keys is not None else {})
        self._events_at: dict[str, str] = {}
        if events is not None:
            if isinstance(events, Mapping):
                unknown = sorted(set(events) - set(self._nodes))
                if unknown:
                    raise ValueError(f"events names nodes that are not in nodes: {', '.join(unknown)}")
                self._events_at = _named("events", events)
            else:
                listed = _named("events", events)
                if len(listed) != len(self._nodes):
                    raise ValueError(f"events lists {len(listed)} endpoints for {len(self._nodes)} nodes; "
                                     "give one per node in the same order, or a mapping of node name to endpoint")
                self._events_at = dict(zip(self._nodes, listed.values()))
        self._ids = itertools.count(1)
        self._ctx = zmq.Context()
        self._dealers: dict[str, zmq.Socket] = {}
        self._subs: dict[str, zmq.Socket] = {}
        self._last_seq: dict[str, tuple[int, int]] = {}
        self.event_gaps: dict[str, int] = {name: 0 for name in self._events_at}
        """Events a node published that this client never saw (PUB drops when we are slow or reconnecting)."""
        self._event_decoder = msgspec.msgpack.Decoder(p.Event)
        self._closed = False
        try:
            for name in self._nodes:
                self._connect(name)
            for name, endpoint in self._events_at.items():
                sub = self._socket(zmq.SUB, name)
                sub.setsockopt(zmq.SUBSCRIBE, b"")
                sub.connect(endpoint)
                self._subs[name] = sub
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------ sockets

    def _socket(self, kind: int, name: str) -> zmq.Socket:
        sock = self._ctx.socket(kind)
        sock.linger = 0
        if self._keys is not None:
            sock.curve_publickey = self._keys.public
            sock.curve_secretkey = self._keys.secret
            sock.curve_serverkey = self._server_public[name]
        return sock

    def _connect(self, name: str) -> None:
        """A fresh DEALER for ``name``; the old one (and what was queued on it) is dropped."""
        old = self._dealers.pop(name, None)
        if old is not None:
            old.close(0)
        if ipc_path(self._nodes[name]) is not None:  # the node's local socket: framed, not ZeroMQ
            sock = _LocalDealer(self._nodes[name])
        else:
            sock = self._socket(zmq.DEALER, name)
            sock.connect(self._nodes[name])
        self._dealers[name] = sock

    @property
    def nodes(self) -> list[str]:
        return list(self._nodes)

    # ------------------------------------------------------------ requests

    def call(self, request_factory: Callable[..., p.Request], nodes: Sequence[str] | None = None,
             timeout_ms: float | None = None) -> dict[str, NodeResult]:
        """Send ``request_factory(id=...)`` to each node (all nodes by default) at once; gather the replies.

        Returns a result per node within ``timeout_ms`` (default: the client's), whatever the others do.
        An ``error`` reply becomes a :class:`PlacementError` in ``NodeResult.error`` (``reply`` keeps it).
        """
        if self._closed:
            raise RuntimeError("PlacementClient is closed")
        names = list(self._nodes) if nodes is None else list(nodes)
        unknown = [n for n in names if n not in self._nodes]
        if unknown:
            raise ValueError(f"unknown node(s) {', '.join(map(repr, unknown))}; known: {', '.join(self._nodes)}")
        timeout_ms = self.timeout_ms if timeout_ms is None else float(timeout_ms)
        results: dict[str, NodeResult] = {}
        pending: dict[int, str] = {}
        # Build every request before sending any: a factory that raises must not leave some nodes asked.
        frames = {name: (rid, codec.encode(request_factory(id=rid)))
                  for name, rid in zip(dict.fromkeys(names), self._ids)}
        for name, (rid, frame) in frames.items():
            try:
                self._dealers[name].send(frame, zmq.NOBLOCK)
            except ConnectionError as exc:  # a local socket nobody listens on
                why = f"cannot reach {self._nodes[name]}: {exc.strerror or exc}"
            except zmq.Again:
                why = f"cannot queue a request to {self._nodes[name]} (send queue full)"
            else:
                pending[rid] = name
                continue
            results[name] = NodeResult(name, None, PlacementError(p.ErrorCode.UNAVAILABLE, why, name))
            self._connect(name)
        deadline = time.monotonic() + timeout_ms / 1000.0
        poller = zmq.Poller()
        by_socket = {self._dealers[name]: name for name in pending.values()}
        for sock in by_socket:
            poller.register(sock, zmq.POLLIN)
        while pending:
            remaining_ms = (deadline - time.monotonic()) * 1000.0
            if remaining_ms <= 0:
                break
            local = {d.fileno(): d for d in self._dealers.values() if isinstance(d, _LocalDealer)}
            for sock, _ in poller.poll(math.ceil(remaining_ms)):
                if isinstance(sock, int):  # pyzmq names a plain descriptor by its number
                    sock = local[sock]
                self._drain(sock, by_socket[sock], pending, results, poller)
        for rid, name in pending.items():
            results[name] = NodeResult(name, None, NodeTimeoutError(name, self._nodes[name], timeout_ms))
            log.warning("[placement] timeout node=%s endpoint=%s timeout_ms=%.0f", name, self._nodes[name],
                        timeout_ms)
            self._connect(name)  # drop the queued request: it must not run when the node comes back
        return {name: results[name] for name in dict.fromkeys(names)}

    def _drain(self, sock: zmq.Socket, name: str, pending: dict[int, str], results: dict[str, NodeResult],
               poller: zmq.Poller) -> None:
        """Read every frame waiting on node ``name``'s ``sock``; keep the ones answering a pending request."""
        while True:
            try:
                frame = sock.recv(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                reply = codec.decode_reply(frame)
            except codec.BadFrame as exc:
                reply, rid, error = None, exc.request_id, PlacementError(E_BAD_REPLY, str(exc), name)
            else:
                rid = reply.id
                error = PlacementError(reply.code, reply.message, name) if isinstance(reply, p.Error) else None
            if pending.get(rid) != name:
                if reply is None:
                    log.warning("[placement] undecodable frame from node=%s: %s", name, error.reason)
                else:  # a late reply to a request that timed out, or a notice: not what anyone waits for
                    log.debug("[placement] discarded reply id=%d op=%s from node=%s", rid, type(reply).__name__, name)
                continue
            del pending[rid]
            poller.unregister(sock)
            results[name] = NodeResult(name, reply, error)

    def _one(self, node: str, factory: Callable[..., p.Request], expected: type[R],
             timeout_ms: float | None = None) -> R:
        if node not in self._nodes:
            raise ValueError(f"unknown node {node!r}; known: {', '.join(self._nodes)}")
        result = self.call(factory, [node], timeout_ms)[node]
        if result.error is not None:
            raise result.error
        if not isinstance(result.reply, expected):
            raise PlacementError(E_BAD_REPLY, f"expected {expected.__name__}, got {type(result.reply).__name__}",
                                 node)
        return result.reply

    def inventory(self, nodes: Sequence[str] | None = None) -> dict[str, NodeResult]:
        """Every (or the named) node's devices, lifecycle states and sessions: ``InventoryReply`` per node."""
        return self.call(p.Inventory, nodes)

    def lend(self, node: str, device: int, borrower: str, max_s: float | None = None, *,
             suspend: Sequence[str] = (), deadline_ms: float = DEFAULT_SUSPEND_DEADLINE_MS,
             borrower_uids: Sequence[int] | None = None) -> p.LifecycleReply:
        """Lend ``device`` on ``node`` to ``borrower``'s training sessions (``changed`` False: it already was).
        ``borrower_uids``: the users whose sessions may join as ``borrower`` (the node checks the uid the
        kernel gives it; None: only the node's root). ``suspend``: sessions to put to sleep once lent, each
        within ``deadline_ms``; one that does not end ``suspended`` raises ``E_NOT_SUSPENDED`` naming it
        after all were asked, the device left lent (docs/architecture.md, examples/llm_server.py)."""
        uids = None if borrower_uids is None else [int(uid) for uid in borrower_uids]
        reply = self._one(node, lambda id: p.Lend(id=id, device=device, borrower=borrower, max_s=max_s,
                                                   borrower_uids=uids), p.LifecycleReply)
        failed = []
        for session in suspend:
            try:
                outcome = self.suspend(node, session, deadline_ms).outcome
            except PlacementError as exc:  # no such session, not ours to suspend, no answer
                outcome = f"{exc.code}: {exc.reason}"
            if outcome != "suspended":
                failed.append(f"{session} ({outcome})")
        if failed:
            raise PlacementError(E_NOT_SUSPENDED, f"device {device} is lent to {borrower}, but not every session "
                                 f"was suspended: {', '.join(failed)}", node)
        return reply

    def reclaim(self, node: str, device: int, deadline_ms: float = DEFAULT_SUSPEND_DEADLINE_MS,
                timeout_ms: float | None = None, *, resume: Sequence[str] = ()) -> p.ReclaimReply:
        """Take ``device`` back for inference; the node answers once it is free (default timeout:
        ``deadline_ms`` plus the client's). ``resume``: sessions to wake then (those a lend's ``suspend``
        put to sleep), each even if an earlier one fails; the first failure is raised after."""
        timeout_ms = deadline_ms + self.timeout_ms if timeout_ms is None else timeout_ms
        reply = self._one(node, lambda id: p.Reclaim(id=id, device=device, deadline_ms=deadline_ms),
                          p.ReclaimReply, timeout_ms)
        first_error = None
        for session in resume:
            try:
                self.resume(node, session)
            except PlacementError as exc:
                log.warning("[placement] resume after reclaim failed node=%s session=%s: %s", node, session, exc)
                first_error = first_error or exc
        if first_error is not None:
            raise first_error
        return reply

    def renew(self, node: str, device: int, borrower: str, max_s: float) -> p.LifecycleReply:
        """A new term for the lend of ``device`` to ``borrower``: it ends ``max_s`` seconds from now
        (``lent_until``, unix time). ``E_STATE`` if the device is not lent to ``borrower`` (reclaimed,
        or its lease already ran out)."""
        return self._one(node, lambda id: p.Renew(id=id, device=device, borrower=borrower, max_s=max_s),
                         p.LifecycleReply)

    def set_weight(self, node: str, session: str, weight: float) -> p.Ok:
        """``session``'s share of its device's time within its class, from now."""
        return self._one(node, lambda id: p.SetWeight(id=id, session=session, weight=weight), p.Ok)

    def attained(self, nodes: Sequence[str] | None = None) -> dict[str, float]:
        """GPU-seconds each training job attained, summed over the nodes that answered (each node's
        ledger survives its daemon's restarts); nodes that did not answer are left out."""
        totals: dict[str, float] = {}
        for result in self.inventory(nodes).values():
            if result.ok and isinstance(result.reply, p.InventoryReply):
                for job, gpu_s in result.reply.attained_gpu_s.items():
                    totals[job] = totals.get(job, 0.0) + gpu_s
        return totals

    def drain(self, node: str, device: int, cancel: bool = False) -> p.LifecycleReply:
        return self._one(node, lambda id: p.Drain(id=id, device=device, cancel=cancel), p.LifecycleReply)

    def set_policy(self, node: str, device: int, *, quanta_ms: dict[str, float] | None = None,
                   grace_ms: float | None = None, protect_s: float | None = None) -> p.PolicyReply:
        return self._one(node, lambda id: p.SetPolicy(id=id, device=device, quanta_ms=quanta_ms, grace_ms=grace_ms,
                                                      protect_s=protect_s), p.PolicyReply)

    def partition(self, node: str, device: int, shares: dict[str, float | None],
                  memory_mb: dict[str, int] | None = None) -> p.PartitionReply:
        return self._one(node, lambda id: p.Partition(id=id, device=device, shares=shares, memory_mb=memory_mb),
                         p.PartitionReply)

    def suspend(self, node: str, session: str, deadline_ms: float = DEFAULT_SUSPEND_DEADLINE_MS,
                timeout_ms: float | None = None) -> p.SuspendResult:
        timeout_ms = deadline_ms + self.timeout_ms if timeout_ms is None else timeout_ms
        return self._one(node, lambda id: p.SuspendSession(id=id, session=session, deadline_ms=deadline_ms),
                         p.SuspendResult, timeout_ms)

    def resume(self, node: str, session: str) -> p.Ok:
        return self._one(node, lambda id: p.ResumeSession(id=id, session=session), p.Ok)

    # ------------------------------------------------------------ events

    def events(self, timeout_ms: float | None = None) -> Iterator[tuple[str, p.Event]]:
        """(node name, event) from every node's PUB, in arrival order. Ends after ``timeout_ms`` with
        no event (None: never). Events sent before a SUB connected are not seen; ``event_gaps``
        counts the ones missed in between, so a caller knows to re-read ``inventory``."""
        if not self._subs:
            raise ValueError("this client subscribes to no events: pass events=[...] when creating it")
        poller = zmq.Poller()
        for sock in self._subs.values():
            poller.register(sock, zmq.POLLIN)
        by_sub = {sock: name for name, sock in self._subs.items()}
        while not self._closed:
            ready = poller.poll(None if timeout_ms is None else timeout_ms)
            if not ready:
                return
            for sock, _ in ready:
                name = by_sub[sock]
                while True:
                    try:
                        frames = sock.recv_multipart(zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    event = self._decode_event(name, frames)
                    if event is not None:
                        yield name, event

    def _decode_event(self, name: str, frames: list[bytes]) -> p.Event | None:
        if len(frames) != 2:
            log.warning("[placement] event from node=%s has %d frames, expected 2 (topic, body)", name, len(frames))
            return None
        try:
            event = self._event_decoder.decode(frames[1])
        except (msgspec.ValidationError, msgspec.DecodeError) as exc:
            log.warning("[placement] undecodable event from node=%s: %s", name, exc)
            return None
        last = self._last_seq.get(name)
        if last is not None and last[0] == event.boot and event.seq > last[1] + 1:
            self.event_gaps[name] += event.seq - last[1] - 1
            log.warning("[placement] missed events node=%s seq %d..%d", name, last[1] + 1, event.seq - 1)
        self._last_seq[name] = (event.boot, event.seq)
        return event

    # ------------------------------------------------------------ lifetime

    def close(self) -> None:
        """Close every socket; pending requests are dropped."""
        self._closed = True
        for sock in self._dealers.values():
            if isinstance(sock, _LocalDealer):
                sock.close(0)
        self._ctx.destroy(linger=0)

    def __enter__(self) -> PlacementClient:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()


class _LocalDealer:
    """The few DEALER calls this client makes, over a node's local unix socket
    (length-prefixed frames, :mod:`client_lib.framing`): a node-local agent needs
    no keys there, and the daemon knows it by its peer credentials."""

    def __init__(self, endpoint: str) -> None:
        self._endpoint = endpoint
        self._conn: framing.Connection | None = None
        self._frames: list[bytes] = []
        self._quiet_r, self._quiet_w = os.pipe()  # polled instead of a connection that is gone

    def fileno(self) -> int:
        conn = self._conn
        return conn.fileno() if conn is not None and not conn.closed_by_peer else self._quiet_r

    def send(self, frame: bytes, flags: int = 0) -> None:
        if self._conn is None:
            self._conn = framing.Connection(self._endpoint, timeout=1.0)
        self._conn.send(frame, timeout=1.0)

    def recv(self, flags: int = 0) -> bytes:
        if not self._frames and self._conn is not None:
            try:
                self._frames = self._conn.recv(0)
            except ConnectionError:
                self._frames = []
        if not self._frames:
            raise zmq.Again()
        return self._frames.pop(0)

    def close(self, linger: int = 0) -> None:
        if self._conn is not None:
            self._conn.close()
            self._conn = None
        if self._quiet_r >= 0:
            os.close(self._quiet_r)
            os.close(self._quiet_w)
            self._quiet_r = self._quiet_w = -1
