"""The cluster endpoint (:class:`ClusterEndpoint`): the placement layer's view of this node and
its levers (``inventory``, ``lend``, ``renew``, ``reclaim``, ``drain``, policies), over a CURVE
ROUTER and an events XPUB (:class:`EventPublisher`). It owns the sockets, the ZAP thread,
each device's :class:`sharing.lifecycle.DeviceLifecycle` and the reclaims under way; its
collaborators are its constructor's parameters. The reclaim walk: docs/architecture.md;
detail: docs/internals.md.
"""

from __future__ import annotations

import logging
import math
import os
import socket
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import zmq

from client_lib import codec
from client_lib import protocol as p
from client_lib.limits import DEFAULT_SUSPEND_DEADLINE_MS
from nodeagent import keys, procwatch
from nodeagent.config import ServeConfig
from nodeagent.daemon.journal_writer import JournalWriter
from nodeagent.daemon.sessions import Session, SessionTable
from nodeagent.daemon.authz import Act, at_home, peer_of, refusal
from nodeagent.daemon.bus import DeviceFacts, Granted, LoopHandle, Published, ServerView, SuspendFinished
from nodeagent.daemon.tokens import Tokens
from sharing.suspension import SuspendState
from sharing import (
    DeviceLifecycle,
    DeviceState,
    LifecycleError,
    ReclaimDue,
    SchedulerPolicy,
    Workload,
)

if TYPE_CHECKING:
    from nodeagent.daemon.zap import Authenticator

log = logging.getLogger("nodeagent.cluster")
events_log = logging.getLogger("nodeagent.events")

FORBIDDEN_ON_CLUSTER = "the cluster endpoint serves placement operations; sessions connect locally"
EXPIRY_DEADLINE_MS = DEFAULT_SUSPEND_DEADLINE_MS  # a lend that ran out (max_s) is reclaimed with this deadline
_MAX_FRAME_BYTES = 1 << 20  # libzmq drops a cluster peer sending more; requests are far smaller
_MAX_BATCH = 256  # cluster frames handled before the loop's other work gets a turn
_SHUTDOWN_LINGER_MS = 100

SHARED_OPS = (p.StatusRequest, p.Inventory, p.Partition, p.SuspendSession, p.ResumeSession)
"""Requests of the local endpoint that the cluster endpoint serves too, with the same handlers."""

# ------------------------------------------------------------------ the events socket
# What happened on this node, numbered, one client_lib.protocol.Event per message under its kind
# as topic (detail: docs/internals.md).

KINDS = ("device_state", "grant", "preempt", "session_join", "session_leave", "suspend", "resume",
         "reclaim", "lend", "policy", "health", "renew", "weight")
"""Every ``Event.kind`` the daemon publishes (the topic frame of each message)."""

_TOPICS = {kind: kind.encode() for kind in KINDS}


class EventPublisher:
    """Numbers, stamps and sends events on a bound XPUB socket it does not own."""

    def __init__(self, sock: zmq.Socket, node: str, boot: int) -> None:
        self._sock = sock
        self.node = node
        self.boot = boot
        self.seq = 0  # of the last event published
        self._prefixes: set[bytes] = set()  # topics subscribed to by someone (SUB filters are prefixes)
        self._wanted = dict.fromkeys(KINDS, False)

    def on_subscriptions(self) -> None:
        """Read the (un)subscriptions waiting on the socket. A non-verbose XPUB passes a topic's first
        subscription and its last unsubscription (a subscriber leaving counts), so a set is enough."""
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
            events_log.info("[events] subscriptions now %s",
                            sorted(k for k, on in self._wanted.items() if on) or "none")

    def publish(self, kind: str, device: int | None = None, session: str | None = None, **data) -> None:
        """Send one event if anyone subscribed to its kind; never blocks (PUB drops for a slow subscriber)."""
        wanted = self._wanted.get(kind)
        if not wanted:
            if wanted is None:
                raise ValueError(f"unknown event kind {kind!r}; add it to nodeagent.daemon.cluster.KINDS")
            return
        self.seq += 1
        event = p.Event(node=self.node, seq=self.seq, boot=self.boot, time=time.time(), kind=kind,
                        device=device, session=session, data=data)
        try:
            self._sock.send_multipart([_TOPICS[kind], codec.encode(event)], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            events_log.warning("[events] dropped seq=%d kind=%s: %s", self.seq, kind, exc)


class ClusterRoute(bytes):
    """Routing id of a peer on the cluster ROUTER. The type tells ``_send`` to answer
    on that socket, and authorisation checks that the peer proved an allowed CURVE key."""

    __slots__ = ()


class ClusterError(OSError):
    """The cluster endpoint cannot start (keys missing or bad, address taken); names the setting."""


@dataclass(eq=False)
class _Reclaim:
    """A reclaim under way: the borrower's sessions on the device and how each got off it."""

    device: int
    borrower: str
    started: float
    outcomes: dict[str, str | None] = field(default_factory=dict)  # session -> outcome; None: under way
    waiters: list[tuple[bytes, int]] = field(default_factory=list)  # (route, request id) to answer


class ClusterEndpoint:
    """Cluster endpoint, device lifecycles and placement operations (what it owns: the module docstring)."""

    def __init__(self, *, config: ServeConfig, loop: LoopHandle, server: ServerView, tokens: Tokens,
                 sessions: SessionTable, journal: JournalWriter, suspensions, devices: DeviceFacts) -> None:
        """``server``: the request table this endpoint shares (:data:`SHARED_OPS`), dispatch, boot,
        metrics and replies; ``journal``: operators' changes are written through it and restored from
        it; ``suspensions``: a reclaim suspends the borrower's sessions (``begin``), reads where each
        stands (``state``, ``under_way``) and what one parked (``parked_bytes``); ``devices``: GPUs
        NVML reports lost are not lent."""
        self._config = config
        self._ctx = server.context
        self._poller = loop.poller
        self._tokens = tokens  # token commands and views
        self._sessions = sessions
        self._metrics = server.metrics
        self._journal = journal
        self._clock = loop.clock
        self._started = server.started
        self._boot = server.boot
        self._send = server.replies.send
        self._error = server.replies.error
        self._bad = server.replies.bad
        self._dispatch = server.dispatch
        self._attained = server.attained
        self._suspensions = suspensions
        self._wake = loop.wake
        self._lost_devices = devices.lost
        self._server_handlers = server.handlers  # complete once bind() is called (the server adds inventory's)
        self._lifecycles = [DeviceLifecycle(i, config.cluster_protect_s) for i in range(tokens.device_count)]
        self._borrower_uids: dict[int, frozenset[int]] = {}  # device -> the uids its lend names (lend.borrower_uids)
        self._node = config.cluster_node or socket.gethostname()
        self._router: zmq.Socket | None = None
        self._events_sock: zmq.Socket | None = None
        self.events: EventPublisher | None = None  # None unless the events socket is bound (tests may record here)
        self._auth: Authenticator | None = None
        self._reclaims: dict[int, _Reclaim] = {}
        self._next_health = math.inf
        self._reload_requested = False
        self._cluster_handlers: dict = {}  # the requests a cluster peer may make: built at bind()

    # ------------------------------------------------------------------ life

    def restore(self, now: float) -> None:
        """Policies and lifecycle states from the journal: a LENT device stays lent. Called
        after :meth:`bind` (the journal is opened once every address is bound): events carry
        the boot number read from it."""
        if self.events is not None:
            self.events.boot = self._boot()
        journal = self._journal.journal
        if journal is None:
            return
        wall = self._wall_at(now)
        count = self._tokens.device_count
        for device, doc in sorted(journal.policies().items()):
            if not 0 <= device < count:
                continue
            try:
                self._set_policy(device, doc.get("quanta_ms"), doc.get("grace_ms"), doc.get("protect_s"), now)
            except (ValueError, TypeError, AttributeError) as exc:
                log.warning("[cluster] journalled policy of device %d ignored: %s", device, exc)
        for device, (state, detail) in sorted(journal.device_states().items()):
            if not 0 <= device < count:
                log.warning("[cluster] journalled state of device %d dropped: the device is gone", device)
                continue
            try:
                life = DeviceLifecycle.restore(device, state, borrower=detail.get("borrower"),
                                               lent_until=_on_clock(detail.get("lent_until_unix"), now, wall),
                                               protect_until=_on_clock(detail.get("protect_until_unix"), now, wall),
                                               protect_s=self._lifecycles[device].protect_s)
            except (ValueError, TypeError) as exc:
                log.warning("[cluster] journalled state of device %d ignored: %s", device, exc)
                continue
            self._lifecycles[device] = life
            uids = detail.get("borrower_uids", [])
            if isinstance(uids, list) and all(type(uid) is int and uid >= 0 for uid in uids):
                self._borrower_uids[device] = frozenset(uids)
            else:
                log.warning("[cluster] journalled borrower_uids of device %d ignored: %r", device, uids)
            log.info("[cluster] restored device=%d state=%s borrower=%s", device, life.state.value, life.borrower)

    def bind(self) -> None:
        """Bind the CURVE ROUTER and XPUB sockets if ``cluster.endpoint`` is set; raises ClusterError."""
        cfg = self._config
        if cfg.cluster_endpoint is None:
            return
        if not zmq.has("curve"):
            raise ClusterError(f"cluster.endpoint is set, but this libzmq ({zmq.zmq_version()}) was built without "
                               "CURVE; install pyzmq with its bundled libzmq, or unset cluster.endpoint")
        try:
            public, secret = keys.load_server(cfg.cluster_keys_dir)
            names = {key: name for name, key in keys.load_allowed(cfg.cluster_keys_dir).items()}
        except keys.KeysError as exc:
            raise ClusterError(f"cluster endpoint {cfg.cluster_endpoint} needs its keys "
                               f"(cluster.keys_dir = {cfg.cluster_keys_dir}): {exc}") from None
        try:
            from nodeagent.daemon.zap import Authenticator  # here: it pulls asyncio in
            self._auth = Authenticator(self._ctx, log=logging.getLogger("nodeagent.cluster.zap"))
            self._auth.names = names
            self._auth.start()
            self._auth.configure_curve(domain="*", location=os.path.join(cfg.cluster_keys_dir, keys.ALLOWED_DIR))
            self._router = self._curve_socket(zmq.ROUTER, public, secret)
            self._router.setsockopt(zmq.ROUTER_MANDATORY, 1)
            _bind(self._router, cfg.cluster_endpoint, "cluster.endpoint")
            if cfg.cluster_events_endpoint:
                self._events_sock = self._curve_socket(zmq.XPUB, public, secret)
                _bind(self._events_sock, cfg.cluster_events_endpoint, "cluster.events_endpoint")
        except BaseException:
            self.close()
            raise
        self._cluster_handlers = {p.Lend: self.on_lend, p.Reclaim: self.on_reclaim, p.Drain: self.on_drain,
                                  p.SetPolicy: self.on_set_policy, p.SetWeight: self.on_set_weight,
                                  p.Renew: self.on_renew, **{kind: self._server_handlers[kind] for kind in SHARED_OPS}}
        self._poller.register(self._router, zmq.POLLIN, on_ready=self._drain, where="poll")
        events_at = None
        if self._events_sock is not None:
            self.events = publisher = EventPublisher(self._events_sock, self._node, self._boot())
            self._poller.register(self._events_sock, zmq.POLLIN, where="poll",  # subscriptions coming in
                                  on_ready=lambda sock, events: publisher.on_subscriptions())
            self._next_health = self._clock() + cfg.cluster_health_interval_s
            events_at = self._events_sock.getsockopt_string(zmq.LAST_ENDPOINT)
        log.info("[cluster] listening endpoint=%s events=%s node=%s allowed_clients=%s",
                 self._router.getsockopt_string(zmq.LAST_ENDPOINT), events_at, self._node,
                 ",".join(sorted(names.values())) or "-")

    def _curve_socket(self, kind: int, public: bytes, secret: bytes) -> zmq.Socket:
        sock = self._ctx.socket(kind)
        sock.setsockopt(zmq.LINGER, 0)
        sock.curve_secretkey = secret
        sock.curve_publickey = public
        sock.curve_server = True
        sock.setsockopt(zmq.MAXMSGSIZE, _MAX_FRAME_BYTES)
        sock.setsockopt(zmq.SNDHWM, 10_000)
        return sock

    def request_reload(self) -> None:
        """Re-read the allowed client keys (SIGHUP). Safe from signal handlers.
        Connections already made stay; a removed key cannot connect again."""
        self._reload_requested = True
        self._wake()

    def _reload_keys(self) -> None:
        self._reload_requested = False
        if self._auth is None:
            return
        try:
            names = {key: name for name, key in keys.load_allowed(self._config.cluster_keys_dir).items()}
        except keys.KeysError as exc:
            log.error("[cluster] keys reload failed, the old ones stay in force: %s", exc)
            return
        self._auth.names = names
        self._auth.configure_curve(domain="*", location=os.path.join(self._config.cluster_keys_dir, keys.ALLOWED_DIR))
        log.info("[cluster] reloaded allowed clients=%s", ",".join(sorted(names.values())) or "-")

    def close(self) -> None:
        """Answer pending reclaims, close the sockets, stop the authenticator (shutdown, failed bind)."""
        for pending in list(self._reclaims.values()):
            for route, request_id in pending.waiters:
                self._error(route, request_id, p.ErrorCode.SHUTTING_DOWN,
                            f"daemon is shutting down; the reclaim of device {pending.device} did not finish")
        self._reclaims.clear()
        self.events = None
        closed = self._close_socket(self._router)
        self._router = None
        self._close_socket(self._events_sock)
        self._events_sock = None
        if self._auth is not None:
            self._auth.stop()
            self._auth = None
        if closed:
            log.info("[shutdown] step=cluster")

    def _close_socket(self, sock) -> bool:
        """Stop polling ``sock`` and close it (None: nothing to do); whether it was open."""
        if sock is None:
            return False
        self._poller.unregister(sock)  # one unregistered already is let be
        sock.close(linger=_SHUTDOWN_LINGER_MS)
        return True

    # ------------------------------------------------------------------ transport

    def _drain(self, sock: zmq.Socket, events: int) -> None:
        """The ROUTER is readable: take up to a batch of its messages (while it is still open)."""
        for _ in range(_MAX_BATCH):
            router = self._router
            if router is None or not router.getsockopt(zmq.EVENTS) & zmq.POLLIN:
                return
            self._on_frames(router.recv_multipart(zmq.NOBLOCK, copy=False))

    def _on_frames(self, frames: list) -> None:
        route = ClusterRoute(frames[0].bytes)
        if len(frames) != 2:
            self._bad(route, 0, f"expected one frame per message, got {len(frames) - 1}")
            return
        try:
            self._dispatch(route, frames[1].bytes, frames[1], self._cluster_handlers, "cluster",
                           unhandled=lambda route, msg: self._error(route, msg.id, p.ErrorCode.FORBIDDEN,
                                                                    FORBIDDEN_ON_CLUSTER))
        except Exception:  # dispatch contains handler bugs; this catches its own
            self._metrics.internal_errors.labels("cluster").inc()
            log.exception("[cluster] internal error while dispatching a frame")
            self._error(route, 0, p.ErrorCode.INTERNAL, "internal error; see the daemon log")

    def send(self, route: ClusterRoute, msg) -> None:
        """Put a reply on the cluster ROUTER (the daemon's ``send`` hands a ClusterRoute here);
        dropped with a warning if that peer is gone or not reading."""
        router = self._router
        if router is None:
            return
        try:
            router.send_multipart([bytes(route), codec.encode(msg)], zmq.NOBLOCK)
        except zmq.ZMQError as exc:
            if exc.errno not in (zmq.EHOSTUNREACH, zmq.EAGAIN):
                raise
            log.warning("[cluster] dropped %s to a placement peer that is gone or not reading", type(msg).__name__)

    def event(self, kind: str, device: int | None = None, session: str | None = None, **data) -> None:
        """Publish one event (a kind of :data:`KINDS`) to whoever subscribed to
        its kind; nothing without the events socket."""
        if self.events is not None:
            self.events.publish(kind, device, session, **data)

    def on_published(self, event: Published) -> None:
        """The bus's :class:`Published`: out on the events socket."""
        self.event(event.kind, event.device, event.session, **event.data)

    def on_granted(self, event: Granted) -> None:
        """The bus's :class:`Granted`: a ``grant`` event, where there is an events socket."""
        self.event("grant", event.session.device, event.session.id, grant=event.grant, waited_ms=event.waited_ms)

    # ------------------------------------------------------------------ loop hooks

    def on_timers(self, now: float) -> None:
        """After every loop turn: tell each lifecycle whether inference wants its device
        (O(1) per device when nothing changed), then act on due deadlines."""
        for device in range(len(self._lifecycles)):
            life = self._observe_now(device, now)
            deadline = life.next_deadline()
            if deadline is not None and deadline <= now:
                for item in life.tick(now):
                    if isinstance(item, ReclaimDue):
                        log.info("[cluster] lend expired device=%d borrower=%s", item.device, item.borrower)
                        self._start_reclaim(item.device, now, EXPIRY_DEADLINE_MS, None)
                    else:
                        self._moved([item], op=False)
        if now >= self._next_health:
            self._publish_health(now)
        if self._reload_requested:
            self._reload_keys()

    def _observe_now(self, device: int, now: float) -> DeviceLifecycle:
        """The device's lifecycle, told first what inference did in the frames handled so far
        this loop turn (an operation must not act on the state of the turn before)."""
        life = self._lifecycles[device]
        active = self._tokens.wanted_by(device, Workload.INFERENCE)
        if active is not life.inference_active:  # None before the first: told then
            self._moved(life.observe(active, now), op=False)
        return life

    def next_deadline(self, now: float) -> float:
        """The earliest lifecycle deadline or health event (monotonic; inf if none)."""
        deadlines = (life.next_deadline() for life in self._lifecycles)
        return min([self._next_health, *(deadline for deadline in deadlines if deadline is not None)])

    def admission_refusal(self, device: int, workload: str, borrower: str | None) -> str | None:
        """Why the device's lifecycle refuses a new session there, or None."""
        return self._lifecycles[device].admits(workload, borrower)

    def borrower_refusal(self, device: int, workload: str, borrower: str | None,
                         creds: procwatch.PeerCredentials | None) -> str | None:
        """Why the peer ``creds`` may not join ``device`` as ``borrower`` (the lend does not name
        its uid), or None. Inference and sessions without a borrower are not borrowers."""
        life = self._lifecycles[device]
        if workload == "inference" or borrower is None or life.state is not DeviceState.LENT \
                or life.borrower != borrower:
            return None  # not joining a lend (the lifecycle refuses a borrower anywhere else)
        if at_home(creds) and creds.uid in (0, os.geteuid()):
            return None  # root, or the daemon's user: it could lend the device itself
        allowed = self._borrower_uids.get(device, frozenset())
        if creds is not None and creds.uid in allowed:
            return None
        who = "an unverifiable peer" if creds is None else f"uid {creds.uid}"
        named = (f"names uids {', '.join(map(str, sorted(allowed)))}" if allowed
                 else "names no borrower_uids (only root's sessions may join)")
        return (f"device {device} is lent to {borrower!r}, and the lend {named}: {who} may not join as "
                f"{borrower!r}; the placement layer names its users in lend.borrower_uids")

    def device_state(self, device: int) -> str:
        """The device's lifecycle state (FREE, RUN, ...); read by metrics at scrape time."""
        return self._lifecycles[device].state.value

    def on_suspend_finished(self, event: SuspendFinished) -> None:
        """The bus's :class:`SuspendFinished`: publish it, and move a reclaim waiting on it on."""
        s, now = event.session, event.now
        self.event("suspend", s.device, s.id, outcome=event.outcome, elapsed_ms=round(event.elapsed_ms, 3),
                   bytes_parked=self._suspensions.parked_bytes(s))
        pending = self._reclaims.get(s.device)
        if pending is None or pending.outcomes.get(s.id, "") is not None:
            return
        if event.outcome == "timeout":  # unverifiable, so not stopped: the token is what can be taken
            self._take_token(s, now)
        pending.outcomes[s.id] = event.outcome
        self._finish_reclaim_if_done(pending, now)

    def _moved(self, transitions: list, *, op: bool) -> None:
        """Log and publish lifecycle transitions (operators' ones at info, inference's at debug)."""
        for t in transitions:
            (log.info if op else log.debug)("[cluster] device=%d %s -> %s reason=%s",
                                            t.device, t.old.value, t.new.value, t.reason)
            self.event("device_state", t.device, old=t.old.value, new=t.new.value, reason=t.reason)

    def _journal_lifecycle(self, device: int, now: float) -> None:
        """Write what an operator made of the device; times as unix seconds, to survive a restart."""
        life, wall = self._lifecycles[device], self._wall_at(now)
        detail: dict = {}
        if life.borrower is not None:
            detail["borrower"] = life.borrower
            detail["borrower_uids"] = sorted(self._borrower_uids.get(device, ()))
        for key, at in (("lent_until_unix", life.lent_until), ("protect_until_unix", life.protect_until)):
            if at is not None:
                detail[key] = _on_wall(at, now, wall)
        self._journal.write(lambda j: j.put_device_state(device, life.state.value, detail))

    def _publish_health(self, now: float) -> None:
        self._next_health = now + self._config.cluster_health_interval_s
        states = {f"state.{i}": life.state.value for i, life in enumerate(self._lifecycles)}
        self.event("health", devices=len(self._lifecycles), sessions=len(self._sessions),
                   uptime_s=round(now - self._started, 3), **states)

    # ------------------------------------------------------------------ operations

    def _operator(self, route: bytes, request_id: int, frame, act: Act) -> bool:
        """True if the peer may do ``act`` (:mod:`nodeagent.daemon.authz`: a CURVE-authenticated
        placement client or local root); else answers E_FORBIDDEN."""
        why = refusal(act, peer_of(route, frame))
        if why is None:
            return True
        self._error(route, request_id, p.ErrorCode.FORBIDDEN, why)
        return False

    def _lifecycle_for(self, route: bytes, request_id: int, device: int, now: float) -> DeviceLifecycle | None:
        count = len(self._lifecycles)
        if not 0 <= device < count:
            self._error(route, request_id, p.ErrorCode.DEVICE,
                        f"no device {device}; this node has devices 0..{count - 1}")
            return None
        return self._observe_now(device, now)

    def _wall_at(self, now: float) -> float:
        """Unix seconds at the loop time ``now`` (a turn's start), not at this call: a time
        converted twice in one turn, or in two turns, comes out the same."""
        return time.time() - (self._clock() - now)

    def lifecycle_facts(self, now: float) -> list[tuple[str, str | None, float | None]]:
        """Each device's (lifecycle state, borrower, lent until on the wall clock) at ``now``."""
        wall = self._wall_at(now)
        lives = [self._observe_now(device, now) for device in range(len(self._lifecycles))]
        return [(life.state.value, life.borrower, _on_wall(life.lent_until, now, wall)) for life in lives]

    def inventory_of(self, status: p.StatusReply, lifecycles: list, now: float,
                     request_id: int) -> p.InventoryReply:
        """The inventory reply from a status and :meth:`lifecycle_facts`, both taken at ``now``."""
        devices = []
        for info in status.devices:
            state, borrower, lent_until = lifecycles[info.index]
            devices.append(p.DeviceInventory(
                index=info.index, uuid=info.uuid, name=info.name, backend=info.backend,
                memory_total_bytes=info.memory_total_bytes, memory_used_bytes=info.memory_used_bytes,
                utilization_percent=info.utilization_percent, state=state, borrower=borrower,
                lent_until=lent_until, sessions=info.sessions, policy=self._policy_info(info.index), mps=info.mps,
                partition=info.partition))
        return p.InventoryReply(id=request_id, node=self._node, boot=self._boot(), devices=devices,
                                attained_gpu_s=status.attained_gpu_s)

    def _lend_or_renew(self, route: bytes, msg: p.Lend | p.Renew, frame, now: float, act: Act):
        """(lifecycle, what its ``lend`` or ``renew`` returned) once the peer may, the device exists
        (and, to lend, works) and the borrower is a valid name; None after answering why not."""
        if not self._operator(route, msg.id, frame, act):
            return None
        life = self._lifecycle_for(route, msg.id, msg.device, now)
        if life is None:
            return None
        # Its length and that it is not blank are the wire type's (client_lib/protocol.py's Borrower).
        if not msg.borrower.isprintable():  # as hello refuses them: it reaches logs, events and status
            self._error(route, msg.id, p.ErrorCode.INVALID, "borrower must be printable (no control characters)")
            return None
        lost = self._lost_devices.refusal(msg.device) if act is Act.LEND else None
        if lost is not None:  # a borrower's workers could not run there
            self._error(route, msg.id, p.ErrorCode.DEVICE, lost)
            return None
        try:
            return life, (life.lend if act is Act.LEND else life.renew)(msg.borrower, now, msg.max_s)
        except LifecycleError as exc:
            self._error(route, msg.id, p.ErrorCode.STATE, str(exc))
        except ValueError as exc:
            self._error(route, msg.id, p.ErrorCode.INVALID, str(exc))
        return None

    def on_lend(self, route: bytes, msg: p.Lend, frame, now: float) -> None:
        done = self._lend_or_renew(route, msg, frame, now, Act.LEND)
        if done is None:
            return
        life, moved = done
        changed = any(t.new is DeviceState.LENT for t in moved)
        self._moved(moved, op=True)
        uids = frozenset(msg.borrower_uids or ())
        if changed or (msg.borrower_uids is not None and uids != self._borrower_uids.get(msg.device)):
            self._borrower_uids[msg.device] = uids  # a new lend names its own; a repeat may name others
            self._journal_lifecycle(msg.device, now)
        if changed:
            self._metrics.lends.labels(str(msg.device)).inc()
            self.event("lend", msg.device, borrower=msg.borrower, max_s=msg.max_s)
            log.info("[cluster] lend device=%d borrower=%s max_s=%s by=%s", msg.device, msg.borrower, msg.max_s,
                     _peer(route, frame))
        self._send(route, p.LifecycleReply(id=msg.id, device=msg.device, state=life.state.value,
                                           borrower=life.borrower, changed=changed,
                                           lent_until=_on_wall(life.lent_until, now, self._wall_at(now))))

    def on_renew(self, route: bytes, msg: p.Renew, frame, now: float) -> None:
        """A new term for a lend (a lease): it ends ``max_s`` from now; journalled, as the lend was."""
        done = self._lend_or_renew(route, msg, frame, now, Act.RENEW)
        if done is None:
            return
        life = done[0]
        self._journal_lifecycle(msg.device, now)
        self.event("renew", msg.device, borrower=msg.borrower, max_s=msg.max_s)
        log.info("[cluster] renew device=%d borrower=%s max_s=%g by=%s", msg.device, msg.borrower, msg.max_s,
                 _peer(route, frame))
        self._send(route, p.LifecycleReply(id=msg.id, device=msg.device, state=life.state.value,
                                           borrower=life.borrower, changed=True,
                                           lent_until=_on_wall(life.lent_until, now, self._wall_at(now))))

    def on_set_weight(self, route: bytes, msg: p.SetWeight, frame, now: float) -> None:
        """A session's share within its class, changed by the placement layer (or local root)."""
        if not self._operator(route, msg.id, frame, Act.SET_WEIGHT):
            return
        s = self._sessions.get(msg.session)
        if s is None or not self._tokens.on_device(s.device, s.id):
            self._error(route, msg.id, p.ErrorCode.NO_SESSION, f"no session {msg.session!r} on this node")
            return
        old = s.weight
        self._tokens.set_weight(s, float(msg.weight), now)
        self.event("weight", s.device, s.id, old=old, weight=s.weight)
        log.info("[cluster] weight session=%s %g -> %g by=%s", s.id, old, s.weight, _peer(route, frame))
        self._send(route, p.Ok(id=msg.id))

    def on_reclaim(self, route: bytes, msg: p.Reclaim, frame, now: float) -> None:
        if not self._operator(route, msg.id, frame, Act.RECLAIM):
            return
        life = self._lifecycle_for(route, msg.id, msg.device, now)
        if life is None:
            return
        pending = self._reclaims.get(msg.device)
        if pending is not None:  # a retry, or a second caller: both hear how the one under way ends
            pending.waiters.append((route, msg.id))
            log.info("[cluster] reclaim device=%d joins the one under way by=%s", msg.device, _peer(route, frame))
            return
        if life.state is not DeviceState.LENT:
            self._send(route, p.ReclaimReply(id=msg.id, device=msg.device, state=life.state.value, free_ms=0.0,
                                             outcomes={}, changed=False))
            return
        log.info("[cluster] reclaim device=%d borrower=%s deadline_ms=%.0f by=%s", msg.device, life.borrower,
                 msg.deadline_ms, _peer(route, frame))
        self._start_reclaim(msg.device, now, msg.deadline_ms, (route, msg.id))

    def _start_reclaim(self, device: int, now: float, deadline_ms: float, waiter: tuple | None) -> None:
        """LENT -> PROTECT, and the borrower's sessions there asked to suspend (stopped at the deadline)."""
        life = self._lifecycles[device]
        pending = _Reclaim(device, life.borrower, now, waiters=[waiter] if waiter else [])
        self._moved(life.reclaim(now), op=True)
        self._journal_lifecycle(device, now)
        self._reclaims[device] = pending
        for s in [s for s in self._sessions.values() if s.device == device and s.borrower == pending.borrower
                  and s.workload is not Workload.INFERENCE]:
            state = self._suspensions.state(s)
            if state in (SuspendState.SUSPENDED, SuspendState.STOPPED):
                pending.outcomes[s.id] = state.wire
            elif state is SuspendState.REQUESTED and self._suspensions.under_way(s):
                pending.outcomes[s.id] = None  # under way already: on_suspend_finished reports it
            elif state is SuspendState.REQUESTED:  # missed an earlier deadline unstopped
                self._take_token(s, now)
                pending.outcomes[s.id] = "timeout"
            else:
                pending.outcomes[s.id] = None
                self._suspensions.begin(s, deadline_ms, now, reason="reclaim")
        self._finish_reclaim_if_done(pending, now)

    def _take_token(self, s: Session, now: float) -> None:
        if self._tokens.grant_of(s) is not None:
            self._tokens.end_slice(s, now)
            self._tokens.revoke(s.device, s.id, now, "suspended")

    def _finish_reclaim_if_done(self, pending: _Reclaim, now: float) -> None:
        if any(outcome is None for outcome in pending.outcomes.values()):
            return
        del self._reclaims[pending.device]
        free_ms = (now - pending.started) * 1000.0
        self._metrics.reclaims.labels(str(pending.device)).inc()
        self._metrics.reclaim_seconds.observe(free_ms / 1000.0)
        state = self._lifecycles[pending.device].state.value
        for route, request_id in pending.waiters:
            self._send(route, p.ReclaimReply(id=request_id, device=pending.device, state=state, free_ms=free_ms,
                                             outcomes=dict(pending.outcomes), changed=True))
        tally = dict(Counter(pending.outcomes.values()))
        self.event("reclaim", pending.device, borrower=pending.borrower, free_ms=round(free_ms, 3),
                   sessions=len(pending.outcomes), attained_gpu_s=self._attained(now).get(pending.borrower, 0.0),
                   **tally)
        log.info("[cluster] reclaimed device=%d borrower=%s free_ms=%.1f outcomes=%s", pending.device,
                 pending.borrower, free_ms, tally or "{}")

    def on_drain(self, route: bytes, msg: p.Drain, frame, now: float) -> None:
        if not self._operator(route, msg.id, frame, Act.DRAIN):
            return
        life = self._lifecycle_for(route, msg.id, msg.device, now)
        if life is None:
            return
        moved = life.undrain(now) if msg.cancel else life.drain(now)
        self._moved(moved, op=True)
        if moved:
            self._journal_lifecycle(msg.device, now)
            log.info("[cluster] %s device=%d by=%s", "undrain" if msg.cancel else "drain", msg.device,
                     _peer(route, frame))
        if moved and not msg.cancel:
            for s in self._sessions.values():
                if s.device == msg.device:
                    self._send(s.route, p.DrainNotice(device=msg.device))
        self._send(route, p.LifecycleReply(id=msg.id, device=msg.device, state=life.state.value,
                                           borrower=life.borrower, changed=bool(moved)))

    def on_set_policy(self, route: bytes, msg: p.SetPolicy, frame, now: float) -> None:
        if not self._operator(route, msg.id, frame, Act.SET_POLICY):
            return
        if self._lifecycle_for(route, msg.id, msg.device, now) is None:
            return
        try:
            self._set_policy(msg.device, msg.quanta_ms, msg.grace_ms, msg.protect_s, now)
        except ValueError as exc:
            self._error(route, msg.id, p.ErrorCode.INVALID, str(exc))
            return
        info = self._policy_info(msg.device)
        doc = {"quanta_ms": dict(info.quanta_ms), "grace_ms": info.grace_ms, "protect_s": info.protect_s}
        self._journal.write(lambda j: j.put_policy(msg.device, doc))
        self.event("policy", msg.device, grace_ms=info.grace_ms, protect_s=info.protect_s,
                   **{f"quantum_ms.{w}": ms for w, ms in info.quanta_ms.items()})
        log.info("[cluster] policy device=%d quanta_ms=%s grace_ms=%g protect_s=%g by=%s", msg.device,
                 info.quanta_ms, info.grace_ms, info.protect_s, _peer(route, frame))
        self._send(route, p.PolicyReply(id=msg.id, device=msg.device, policy=info))

    def _set_policy(self, device: int, quanta_ms, grace_ms, protect_s, now: float) -> None:
        """Change the device's policy fields given (None: keep); ValueError names a bad one, changing nothing."""
        current = self._tokens.policy(device)
        quanta = {w.wire: ms for w, ms in current.quantum_ms.items()}
        quanta.update(quanta_ms or {})
        policy = SchedulerPolicy(quantum_ms=quanta, grace_ms=current.grace_ms if grace_ms is None else grace_ms)
        life = self._lifecycles[device]
        life.set_protect_s(life.protect_s if protect_s is None else protect_s)  # ValueError before any change
        self._tokens.set_policy(device, policy, now)

    def _policy_info(self, device: int) -> p.PolicyInfo:
        policy = self._tokens.policy(device)
        return p.PolicyInfo(quanta_ms={w.wire: ms for w, ms in policy.quantum_ms.items()},
                            grace_ms=policy.grace_ms, protect_s=self._lifecycles[device].protect_s)


def _on_wall(at: float | None, now: float, wall: float) -> float | None:
    """A time on the loop's monotonic clock as unix seconds (for the wire; ``wall`` is ``now``'s)."""
    return None if at is None else wall + (at - now)


def _on_clock(unix: float | None, now: float, wall: float) -> float | None:
    """A journalled unix time on the loop's monotonic clock (``now`` and ``wall`` taken together)."""
    return None if unix is None else now + (float(unix) - wall)


def _bind(sock: zmq.Socket, endpoint: str, setting: str) -> None:
    try:
        sock.bind(endpoint)
    except zmq.ZMQError as exc:
        why = zmq.strerror(exc.errno) if exc.errno else str(exc)  # pyzmq's own text repeats the address
        raise ClusterError(f"cannot bind {setting} = {endpoint!r}: {why}") from None


def _peer(route: bytes, frame) -> str:
    """Who sent a request, for the log: the placement client's key name, or the local uid."""
    if type(route) is ClusterRoute:
        try:
            return str(frame.get("User-Id"))
        except (zmq.ZMQError, AttributeError, TypeError):
            return "cluster"
    creds = procwatch.peer_credentials(frame)
    return "local" if creds is None else f"uid {creds.uid}"
