"""The daemon's loop (:class:`AgentServer`): it builds the components, each given in its
constructor what it may touch, routes requests and events to them, runs their timers, and
speaks the session handshake (hello, resume, heartbeat, bye). docs/architecture.md draws it.
"""

from __future__ import annotations

import collections
import hmac
import logging
import math
import os
import secrets
import signal
import socket
import threading
import time
from dataclasses import dataclass
from typing import Callable, Generator

import zmq

from client_lib import codec, device_id
from client_lib import protocol as p
from client_lib.endpoint import ipc_path
from nodeagent import enforce, fdlimit, memory, procwatch, runtime
from nodeagent.daemon.cluster import ClusterEndpoint, ClusterRoute
from nodeagent.config import ServeConfig
from nodeagent.daemon.loop import POLLIN, EventLoopPoller, LocalEndpoint, Peer, Timer, Timers
from nodeagent.daemon.mps import MpsPartitions
from nodeagent.daemon.admission import Admission
from nodeagent.daemon.authz import Act, is_root, peer_of, refusal
from nodeagent.daemon.history import AttainedService, job_of
from nodeagent.daemon.bus import (Bus, DelegatedAction, DeviceBack, DeviceFacts, DeviceLost, DurabilityChanged,
                                  Granted, LoopHandle, MakeRoomFinished, MayAsk, MpsFaulted, Published, Replies,
                                  ServerView, SliceEnded, SuspendFinished)
from nodeagent.daemon.gate import LostDevices, TokenGate
from nodeagent.daemon.tokens import Tokens
from nodeagent.devices import DeviceBackend
from nodeagent.journal import Journal
from nodeagent.daemon.journal_writer import JournalWriter
from nodeagent.daemon.memory_watch import MemoryPolicy
from nodeagent.daemon.metrics_http import MetricsEndpoint
from nodeagent.metrics import DeviceRow, Metrics, SessionRow
from nodeagent.daemon.restore import Restorer
from nodeagent.daemon.serving import Serving
from nodeagent.daemon.sessions import Session, SessionTable
from nodeagent.daemon.suspension import MAKE_ROOM, Suspensions
from sharing import NotHolderError, SessionState, Workload
from sharing.partition import ACTIVE_THREAD_PERCENTAGE_ENV as ACTIVE_THREADS_ENV, PartitionError

log = logging.getLogger("nodeagent.server")

# A status lists every session. Its rows are built this many per loop turn, the loop
# serving whatever else is ready between turns, so a status at 1,000 sessions never
# holds a token handoff for more than one chunk (about 0.3 ms here, not 3-6 ms).
STATUS_CHUNK = 128
STATUS_JOBS_MAX = 64  # statuses and inventories under way at once; past it one is answered E_UNAVAILABLE
STATUS_JOBS_PER_PEER = 4  # of those, from one uid (or one cluster peer): a flood cannot crowd out root

ENDED = "exited"  # a session's end reason when its process ended leaving nothing undone: not a lost one
# How long a session whose connection closed with nothing undone waits for its process's pidfd
# before it is called lost: a Python client's socket closes while its interpreter finalizes,
# before the kernel marks the process exiting; on a loaded host that takes seconds.
ENDED_GRACE_S = 3.0


class AgentServer:
    """One daemon instance. ``bind()``, then ``serve_forever()`` until
    :meth:`request_stop` (thread- and signal-safe) is called."""

    def __init__(self, config: ServeConfig, backend: DeviceBackend, *,
                 metrics: Metrics | None = None, journal: Journal | None = None,
                 open_journal: Callable[[], Journal] | None = None,
                 clock: Callable[[], float] = time.monotonic, context: zmq.Context | None = None) -> None:
        """``journal``: an open journal; or ``open_journal``, which :meth:`bind` calls once every
        address is bound, so a start that cannot bind leaves no journal behind. Either way the
        sessions it holds are restored in :meth:`bind`, before any client is served."""
        config.validate()
        self.config = config
        self.backend = backend
        self.metrics = metrics if metrics is not None else Metrics()
        self.journal = journal
        self._open_journal = open_journal
        self.boot = 0  # incarnation, from the journal; grant ids start at boot << 32
        self._clock = clock
        self._ctx = context if context is not None else zmq.Context()
        self._own_ctx = context is None
        self._unreachable: list[tuple[Peer, str]] = []  # connections gone, handled after the step that saw it
        # Sessions whose connection closed with nothing undone while their process still ran:
        # id -> when they are called lost unless their pidfd says the process ended first.
        self._closing: dict[str, float] = {}
        self._local: LocalEndpoint | None = None
        self._metrics_http: MetricsEndpoint | None = None  # Prometheus scrapes, once serve_metrics() is called
        self._poller = EventLoopPoller()
        self._wake_r, self._wake_w = socket.socketpair()
        self._wake_r.setblocking(False)
        self._wake_w.setblocking(False)
        self._stop_reason: str | None = None
        self._lock: runtime.InstanceLock | None = None
        self._made_socket_dir = False  # the socket's directory is this daemon's to remove at shutdown
        self._started = clock()
        self._next_liveness_check = 0.0
        self._last_bug_log: dict[str, float] = {}  # where -> when an internal error was last logged
        # Statuses and inventories under way: peer key (_read_key) -> its jobs in order; root's
        # go first, the other peers take turns a chunk at a time, so a flood waits behind itself.
        self._status_jobs: dict[object, collections.deque[_ReadJob]] = {}

        # What components are handed: the bus they publish on, the loop, how to answer peers,
        # the devices. Each component below (what it owns: docs/architecture.md, in this order)
        # names in its constructor what it may touch, and every subscription is made here, after
        # all of them exist: no component calls into one built after it.
        bus = self._bus = Bus()
        loop = LoopHandle(self._poller, clock, self._wake)
        replies = Replies(self._send, self._error, self._bad, self._session_for)
        self._lost_devices = LostDevices()  # GPUs NVML reports lost: the gate writes it, the others read it
        devices = self._devices = DeviceFacts(backend, self._lost_devices)
        self._sessions = SessionTable()  # by id, by connection, by pidfd; owns the pidfds
        self._journal_writer = JournalWriter(journal, self.metrics, bus)
        self._tokens = Tokens(config=config, devices=devices, sessions=self._sessions, metrics=self.metrics,
                              journal=self._journal_writer.write, send=self._send, bus=bus, clock=clock)
        self._attained = AttainedService(sessions=self._sessions, tokens=self._tokens, journal=self._journal_writer,
                                         clock=clock)
        self._mps = MpsPartitions(config, devices.info(), self._poller, self._send, self._error,
                                  backend=backend.name)
        self._memory_policy = MemoryPolicy(config=config, devices=devices, loop=loop, sessions=self._sessions,
                                           tokens=self._tokens, metrics=self.metrics, send=self._send, bus=bus)
        self._serving = Serving(config=config, devices=devices, loop=loop, sessions=self._sessions,
                                tokens=self._tokens, mps=self._mps, journal=self._journal_writer, replies=replies)
        self._suspensions = Suspensions(sessions=self._sessions, tokens=self._tokens, metrics=self.metrics,
                                        replies=replies, bus=bus, journal=self._journal_writer)
        self._gate = TokenGate(sessions=self._sessions, tokens=self._tokens, devices=devices,
                               suspensions=self._suspensions)
        self._restorer = Restorer(
            config=config, journal=self._journal_writer, sessions=self._sessions, tokens=self._tokens,
            mps=self._mps, capacities_mb=[memory.capacity_mb(d, config.memory_reserve_mb) for d in devices.info()],
            suspensions=self._suspensions, gate=self._gate)
        self._handlers = {
            p.Hello: self._on_hello,
            p.Heartbeat: self._on_heartbeat,
            p.Acquire: self._on_acquire,
            p.Release: self._on_release,
            p.Cancel: self._on_cancel,
            p.StatusRequest: self._queue_read,
            p.Goodbye: self._on_bye,
            p.SuspendSession: self._suspensions.on_suspend_session,
            p.ResumeSession: self._suspensions.on_resume_session,
            p.Suspended: self._suspensions.on_suspended,
            p.Resumed: self._suspensions.on_resumed,
            p.Partition: self._on_partition,
            p.RegisterModel: self._serving.on_register_model,
            p.UnregisterModel: self._serving.on_unregister_model,
            p.ModelsRequest: self._serving.on_models,
            p.Infer: self._serving.on_infer,
        }
        self.metrics.watch(backend.count(), self._device_rows, self._session_rows,  # read at scrape time
                           memory_policy=config.memory_policy)
        server_view = ServerView(self._ctx, self._handlers, self._dispatch, self.status, lambda: self.boot,
                                 self._started, self.metrics, replies, self._attained.snapshot)
        self._cluster = ClusterEndpoint(config=config, loop=loop, server=server_view, tokens=self._tokens,
                                        sessions=self._sessions, journal=self._journal_writer,
                                        suspensions=self._suspensions, devices=devices)
        self._handlers.update({p.Inventory: self._queue_read, p.Lend: self._cluster.on_lend,
                               p.Reclaim: self._cluster.on_reclaim, p.Drain: self._cluster.on_drain,
                               p.SetPolicy: self._cluster.on_set_policy, p.SetWeight: self._cluster.on_set_weight,
                               p.Renew: self._cluster.on_renew})
        self._admission = Admission(config=config, devices=devices, sessions=self._sessions, tokens=self._tokens,
                                    suspensions=self._suspensions, refusal=self._cluster.admission_refusal,
                                    workers_share=self._serving.workers_share)
        # Who hears what.
        bus.subscribe(Published, self._cluster.on_published)
        # A make-room suspension's end is published first (sessions it blocked ask), then its
        # SuspendFinished (a reclaim waiting on it is answered): the order is the publisher's.
        bus.subscribe(MakeRoomFinished, self._gate.on_make_room_finished)
        bus.subscribe(SuspendFinished, self._cluster.on_suspend_finished)
        bus.subscribe(DeviceLost, self._gate.on_device_lost)  # its waiters held first,
        bus.subscribe(DeviceLost, self._serving.on_device_lost)  # then serving's queues on it fail
        bus.subscribe(DeviceBack, self._gate.on_device_back)
        bus.subscribe(DelegatedAction, self._serving.on_delegated)  # its queues' grants, yields and revokes
        bus.subscribe(DurabilityChanged, lambda e: self._tell_durability(e.session))
        bus.subscribe(MayAsk, self._gate.on_may_ask)
        bus.subscribe(MpsFaulted, self._mps.on_fault)  # its server takes no one until they have left
        bus.subscribe(SliceEnded, self._attained.on_slice_ended)
        bus.subscribe(Granted, self._cluster.on_granted)
        bus.subscribe(Granted, self._attained.on_granted)
        # Whose timers run after every turn, in this order; the poll timeout is their earliest deadline.
        self._timers = Timers()
        for timed in (self._tokens, Timer(lambda now: min(self._closing.values(), default=None), self._drop_closed),
                      Timer(lambda now: self._next_liveness_check, self._check_liveness), self._suspensions,
                      self._cluster, self._gate, self._restorer, self._serving, self._attained):
            self._timers.append(("timers", timed))

    def _restore(self) -> None:
        """Open the journal if it is this daemon's to open, and take back what it holds."""
        if self.journal is None and self._open_journal is not None:
            self.journal = self._open_journal()
            self._journal_writer.attach(self.journal)
        if self.journal is None:
            return
        now = self._clock()
        self.boot = self._restorer.restore(now)  # suspensions under way or in force too
        self._cluster.restore(now)
        self._attained.restore()

    # ------------------------------------------------------------------ life

    def bind(self) -> str:
        """Bind every address, then open and restore the journal (a start that cannot have its addresses
        leaves no socket file and no journal behind); returns the endpoint. Refuses if another daemon serves it."""
        endpoint = self.config.endpoint
        path = ipc_path(endpoint)
        limits = self._connection_limits()
        local = LocalEndpoint(endpoint, self._poller, self._on_frame, self._on_disconnect,
                              max_connections=limits.max_connections,
                              max_connections_per_uid=limits.max_connections_per_uid,
                              max_queued_bytes=self.config.local_max_queued_kb * 1024,
                              on_refused=lambda why: self.metrics.connections_refused.inc())
        try:
            if path is not None:
                self._made_socket_dir = runtime.prepare_socket_dir(path)
                self._lock = runtime.InstanceLock(path + ".lock", "socket")
                self._lock.acquire()
                runtime.remove_stale_socket(path)
            local.bind()
        except BaseException:
            local.close()
            self._leave_socket_dir(path)
            raise
        self._local = local
        self._poller.register(self._wake_r.fileno(), POLLIN, on_ready=self._on_wake, where="memory")
        self._poller.register(self._sessions.fileno(), POLLIN, on_ready=self._reap_exited,  # client processes' pidfds
                              where="pidfd")
        opened_journal = self.journal is None
        try:
            self._cluster.bind()
            self._restore()  # after the last address: a bind that fails has created no journal
            self._tokens.open_pace_boards(path, self.config.state_dir)  # the co-run devices' boards
            self._mps.start(os.path.dirname(path) if path is not None else self.config.state_dir)
            try:
                self._serving.start(self._suspensions.suspended_ids())
            except BaseException:
                self._serving.stop()
                raise
        except BaseException:  # a start that fails here leaves no socket file behind
            self._mps.stop()  # the control daemons it started, if it got so far (none: nothing to do)
            self._cluster.close()
            self._tokens.close_pace_boards()
            local.close()
            self._local = None
            if opened_journal and self.journal is not None:
                self.journal.close()
                self.journal = None
            self._leave_socket_dir(path)
            raise
        self._memory_policy.start()  # its watcher thread, where NVML reads memory per process (cuda)
        log.info("[serve] listening endpoint=%s backend=%s devices=%d pid=%d boot=%d",
                 endpoint, self.backend.name, self._tokens.device_count, os.getpid(), self.boot)
        return endpoint

    def _leave_socket_dir(self, path: str | None) -> None:
        """Remove the socket, its lock file and, if this daemon made it, the emptied directory
        (the lock is held until its file is gone: a daemon starting meanwhile waits for it)."""
        if path is None or self._lock is None or not self._lock.held:
            self._lock = None  # not ours: another daemon's socket stays
            return
        runtime.remove_stale_socket(path)
        self._lock.release(unlink=True)
        self._lock = None
        if self._made_socket_dir:
            runtime.remove_empty_dir(os.path.dirname(path) or ".")

    def _connection_limits(self) -> fdlimit.ConnectionLimits:
        """The local endpoint's connection limits: the configured ones, or, where the
        descriptor limit cannot hold them, what it can (logged)."""
        metrics_fds = self.config.metrics_max_connections + 1 if self.config.metrics_port is not None else 0
        limits = fdlimit.connection_limits(
            self.config.local_max_connections, self.config.local_max_connections_per_uid,
            soft_limit=fdlimit.soft_limit(), in_use=fdlimit.open_descriptors(),
            reserved=fdlimit.SPARE_FDS + metrics_fds)
        if limits.derived:
            log.warning("[local] the descriptor limit (RLIMIT_NOFILE %d) leaves room for %d connections: "
                        "local.max_connections %d -> %d, local.max_connections_per_uid %d -> %d (the same share "
                        "of the whole); raise the hard limit (LimitNOFILE=) to keep the configured ones",
                        fdlimit.soft_limit(), limits.room, self.config.local_max_connections,
                        limits.max_connections, self.config.local_max_connections_per_uid,
                        limits.max_connections_per_uid)
        else:
            log.debug("[local] max_connections=%d max_connections_per_uid=%d (descriptors for %s)",
                      limits.max_connections, limits.max_connections_per_uid,
                      "any number" if limits.room is None else limits.room)
        return limits

    def serve_metrics(self, port: int, addr: str = "127.0.0.1") -> int:
        """Serve /metrics on ``addr:port`` from this loop (before or after :meth:`bind`);
        returns the port. OSError if the address cannot be had."""
        endpoint = MetricsEndpoint(
            self._poller, self.metrics.registry, clock=self._clock,
            max_connections=self.config.metrics_max_connections,
            timeout_s=self.config.metrics_timeout_ms / 1000.0,
            on_drop=lambda reason: self.metrics.metrics_http_closed.labels(reason).inc())
        port = endpoint.bind(addr, port)
        self._metrics_http = endpoint
        self._timers.append(("metrics", endpoint))  # after the turn's handoffs: one step of an exposition at most
        shown = f"[{addr}]" if ":" in addr else addr
        log.info("[metrics] serving http://%s:%d/metrics (in the loop; at most %d connections, %.1f s each)",
                 shown, port, endpoint.max_connections, endpoint.timeout_s)
        return port

    def request_stop(self, reason: str = "requested") -> None:
        """Ask the loop to shut down. Safe from signal handlers and other threads."""
        if self._stop_reason is None:
            self._stop_reason = reason
        self._wake()

    def _wake(self) -> None:
        try:
            self._wake_w.send(b"x")
        except (BlockingIOError, OSError):
            pass  # a wake-up is already pending, or we are closing

    @property
    def wake_fd(self) -> int:
        """Write end of the wake-up socket, for ``signal.set_wakeup_fd``."""
        return self._wake_w.fileno()

    def serve_forever(self) -> str:
        """Run until stopped; returns the stop reason."""
        if self._local is None:
            raise RuntimeError("bind() before serve_forever()")
        poller = self._poller
        try:
            while self._stop_reason is None:
                for target, ready in poller.poll(self._poll_timeout_ms()):
                    reader = poller.reader(target)  # None: unregistered by a step before it this turn
                    if reader is not None:
                        self._contain(reader.where, reader.on_ready, target, ready)
                self._contain("unreachable", self._flush_unreachable)
                self._contain("timers", self._on_timers, self._clock())
                self._contain("pace", self._tokens.write_pace_boards)  # who lower classes make way for
                if self._status_jobs:
                    self._contain("status", self._status_step)
        finally:
            self._shutdown()
        return self._stop_reason or "requested"

    def _contain(self, where: str, step: Callable, *args) -> None:
        """Run one step of the loop; an exception in it is a bug that costs that step, never the
        daemon: counted, and logged at most once a second per place."""
        try:
            step(*args)
        except Exception:
            self._count_bug(where, "[%s] internal error; the daemon carries on", where)

    def _count_bug(self, where: str, message: str, *args) -> None:
        """Count the exception being handled under ``where``; log it at most once a second per place."""
        self.metrics.internal_errors.labels(where).inc()
        now = time.monotonic()
        if now - self._last_bug_log.get(where, -math.inf) >= 1.0:
            self._last_bug_log[where] = now
            log.exception(message, *args)

    def _shutdown(self) -> None:
        reason = self._stop_reason or "error"
        revoked = 0
        for s in list(self._sessions.values()):
            grant = self._tokens.grant_of(s)
            if grant is not None:
                self._send(s.route, p.Revoke(grant=grant, reason="shutdown"))
                revoked += 1
        log.info("[shutdown] reason=%s step=revoke tokens=%d sessions=%d", reason, revoked, len(self._sessions))
        self._suspensions.answer_pending()  # before the sockets close; reclaims are answered in _cluster.close()
        continued = sum(1 for s in self._sessions.values() if self._tokens.stopped(s) and self._tokens.cont(s))
        if continued:
            log.info("[shutdown] step=continue stopped=%d", continued)
        self._tokens.close_pace_boards()  # a board left behind says nobody is paced
        self._memory_policy.stop()
        self._serving.stop()
        self._mps.stop()
        self._cluster.close()
        if self._metrics_http is not None:
            self._metrics_http.close()
        if self._local is not None:
            self._local.close(flush_s=0.2)  # give the revoke notices a moment to leave
            self._local = None
        self._leave_socket_dir(ipc_path(self.config.endpoint))
        if threading.current_thread() is threading.main_thread():
            # A signal during what is left of shutdown must not write to a closed socket.
            old = signal.set_wakeup_fd(-1)
            if old not in (-1, self._wake_w.fileno()):
                signal.set_wakeup_fd(old)
        self._wake_r.close()
        self._wake_w.close()
        self._attained.flush(self._clock())  # before the journal closes: a clean stop loses no service
        self._sessions.close()
        if self.journal is not None:
            self.journal.close()
        if self._own_ctx:
            self._ctx.term()
        log.info("[shutdown] step=done")

    # ---------------------------------------------------------------- input

    def _on_frame(self, peer: Peer, body: bytes) -> None:
        """One frame from a local connection (the local endpoint calls this)."""
        try:
            self._dispatch(peer, body, peer, self._handlers, "serve")
        except Exception:  # _dispatch contains handler bugs; this catches its own
            self.metrics.internal_errors.labels("serve").inc()
            log.exception("[serve] internal error while dispatching a frame")
            self._error(peer, 0, p.ErrorCode.INTERNAL, "internal error; see the daemon log")

    def _on_disconnect(self, peer: Peer, reason: str) -> None:
        """A local connection is gone. Its session, if any, is dropped after the
        current step (a send inside a handler can find a peer gone)."""
        if self._sessions.by_route(peer) is not None:
            self._unreachable.append((peer, reason))

    def _dispatch(self, route, body: bytes, frame, handlers: dict, where: str,
                  unhandled: Callable | None = None) -> None:
        """Decode one request and run its handler; bad frames and handler bugs cost that request an error
        reply, never the loop. ``frame``: what handlers read the sender's identity from (a :class:`Peer`,
        or a ZeroMQ frame on the cluster endpoint)."""
        now = self._clock()
        try:
            msg = codec.decode_request(body)
        except codec.BadFrame as exc:
            self._bad(route, exc.request_id, str(exc), exc.code)
            return
        except Exception as exc:  # the codec promises BadFrame only; a frame must never cost the loop
            self._bad(route, 0, f"undecodable frame ({type(exc).__name__})")
            return
        handler = handlers.get(type(msg))
        if handler is None:
            if unhandled is not None:
                unhandled(route, msg)
            else:
                self._bad(route, msg.id, f"op {type(msg).__name__} is not served on this endpoint")
            return
        try:
            handler(route, msg, frame, now)
        except Exception:  # a bug must cost one request, not the daemon
            log.exception("[%s] handler failed op=%s id=%d", where, type(msg).__name__, msg.id)
            self._error(route, msg.id, p.ErrorCode.INTERNAL, "internal error; see the daemon log")

    def _on_wake(self, fd: int, events: int) -> None:
        """The wake-up socket: a signal, a stop, or the memory watcher's readings to apply."""
        try:
            while self._wake_r.recv(4096):
                pass
        except (BlockingIOError, OSError):
            pass
        self._memory_policy.apply_readings()

    # ------------------------------------------------------------- handlers

    def _on_hello(self, route: bytes, msg: p.Hello, frame, now: float) -> None:
        if msg.protocol[0] != p.PROTOCOL_VERSION[0]:
            ours = "%d.%d" % p.PROTOCOL_VERSION
            theirs = "%d.%d" % tuple(msg.protocol)
            self._error(route, msg.id, p.ErrorCode.PROTOCOL,
                        f"client speaks protocol {theirs}, daemon speaks {ours}; majors must match "
                        "(upgrade the older of client_lib and nodeagent)")
            return
        if self._stop_reason is not None:
            self._error(route, msg.id, p.ErrorCode.SHUTTING_DOWN, "daemon is shutting down")
            return
        existing = self._sessions.by_route(route)
        if existing is not None:
            self._error(route, msg.id, p.ErrorCode.INVALID,
                        f"this connection already has session {existing.id}; send bye first")
            return
        problem = _check_hello(msg)
        if problem:
            self._error(route, msg.id, p.ErrorCode.INVALID, problem)
            return
        creds = procwatch.peer_credentials(frame)
        resumed = self._try_resume(route, msg, creds, now)
        if resumed is not None:
            self._welcome(route, msg.id, resumed, resumed=True, minor=msg.protocol[1])
            self._suspensions.reattached(resumed, now)  # a suspension not yet reported parked is asked again
            self._gate.honour_claim(resumed, msg.holding_grant, now)  # its slice in progress goes first
            return
        workload = Workload.parse(msg.workload)
        device, code, problem = self._admission.pick_device(msg.device, msg.memory_mb, msg.workload, msg.borrower)
        victims: list[Session] = []
        if device is None and code == p.ErrorCode.NO_MEMORY and self.config.memory_make_room == "suspend":
            device, victims = self._admission.make_room_plan(msg.device, workload, msg.memory_mb, msg.borrower)
        if device is None:
            self._error(route, msg.id, code, problem)
            return
        why = self._cluster.borrower_refusal(device, msg.workload, msg.borrower, creds)
        if why is not None:  # a borrower is who the lend names, not whoever says it
            self.metrics.refused_claims.labels("borrower").inc()
            log.info("[session] refused claim=borrower name=%s: %s", msg.name, why)
            self._error(route, msg.id, p.ErrorCode.FORBIDDEN, why)
            return
        verified_pid = creds.pid if creds is not None else None
        managed_pidfd = managed_cgroup = None
        if msg.managed_pgid is not None:
            why = ("the connection's process cannot be verified" if verified_pid is None
                   else enforce.verify_managed_pgid(msg.managed_pgid, verified_pid))
            if why is not None:
                self._error(route, msg.id, p.ErrorCode.INVALID, f"managed_pgid {msg.managed_pgid} refused: {why}")
                return
            managed_pidfd = procwatch.open_pidfd(msg.managed_pgid)
            if managed_pidfd is not None:  # its own cgroup, if the kernel says it has one the launcher made
                managed_cgroup, why = enforce.open_managed_cgroup(msg.managed_pgid, verified_pid, creds.uid)
                if managed_cgroup is None:
                    log.info("[session] launched group %d is held by its process group: %s", msg.managed_pgid, why)
        session_id = "s-" + secrets.token_hex(6)  # public (status lists it); the key is the secret
        try:
            self._mps.join(session_id, device, msg.memory_mb, creds.uid if creds is not None else None)
        except PartitionError as exc:
            self._error(route, msg.id, p.ErrorCode.PARTITION, str(exc))
            return
        session = Session(
            id=session_id, key=secrets.token_urlsafe(18), route=route, name=msg.name,
            claimed_pid=msg.pid, verified_pid=verified_pid,
            start_ticks=procwatch.process_start_ticks(verified_pid) if verified_pid else None,
            uid=creds.uid if creds is not None else None, namespaces=creds.namespaces if creds is not None else None,
            workload=workload, weight=float(msg.weight), device=device, memory_mb=msg.memory_mb,
            last_seen=now, managed_pgid=msg.managed_pgid if managed_pidfd else None,
            managed_pidfd=managed_pidfd, managed_cgroup=managed_cgroup, borrower=msg.borrower, slo_ms=msg.slo_ms)
        self._add_session(session, now)
        if verified_pid is not None and verified_pid != msg.pid:
            log.warning("[session] pid claim mismatch session=%s claimed=%d verified=%d",
                        session.id, msg.pid, verified_pid)
        log.info("[session] open session=%s name=%s pid=%d verified=%s workload=%s weight=%g device=%d "
                 "memory_mb=%d managed_pgid=%s hold=%s", session.id, session.name, session.pid,
                 verified_pid is not None, msg.workload, session.weight, device, session.memory_mb,
                 session.managed_pgid, enforce.describe_hold(session))
        self._journal_writer.put_session(session)
        self._welcome(route, msg.id, session, resumed=False)
        self._bus.event("session_join", device, session.id, name=session.name, workload=msg.workload,
                    borrower=msg.borrower)
        self._gate.block(session, victims)  # it may run once their state has left the device
        for victim in victims:
            self._suspensions.begin(victim, self.config.memory_make_room_deadline_ms, now, reason=MAKE_ROOM)

    def _add_session(self, session: Session, now: float) -> None:
        self._tokens.add(session.device, session.id, session.workload, session.weight, now)
        self._sessions.add(session)

    def _try_resume(self, route: bytes, msg: p.Hello, creds, now: float) -> Session | None:
        """Reattach a live or restored session to a new connection of the same client."""
        if not msg.resume_session or not msg.resume_key:
            return None
        session = self._sessions.get(msg.resume_session)
        if session is None or not hmac.compare_digest(session.key, msg.resume_key):
            return None
        if session.verified_pid is not None and (creds is None or creds.pid != session.verified_pid):
            return None
        if session.verified_pid is not None and session.namespaces is None:
            session.namespaces = creds.namespaces  # its very process: a restored session is not journalled with them
        self._sessions.attach(session, route)
        self._sessions.touch(session, now)
        log.info("[session] resumed session=%s claim=%s", session.id, msg.holding_grant)
        return session

    def _welcome(self, route: bytes, request_id: int, s: Session, *, resumed: bool, minor: int = 0) -> None:
        """``minor``: the client's protocol minor; fields it cannot know (``suspended`` before 2.3) stay unset."""
        policy = self._tokens.policy(s.device)
        slice_ms = policy.quantum_s(s.workload) * 1000.0
        env = self._mps.client_env(s.id, s.device, uncapped=self._tokens.corun(s.device))
        s.mps = bool(env)  # on the device's MPS server: in its fault domain (memory_watch's Xid handling)
        if env and s.workload is not Workload.INFERENCE:
            # Under MPS the server schedules a higher-priority client's work first: a lower
            # class yields the SMs to inference without any of its work being stopped.
            env["CUDA_MPS_CLIENT_PRIORITY"] = "1"
            cap = self.config.corun_lower_sm_percent
            if cap and self._tokens.corun(s.device) and ACTIVE_THREADS_ENV not in env:
                env[ACTIVE_THREADS_ENV] = str(cap)  # SMs left free for the higher class when it comes
        uuid = self._devices.info()[s.device].uuid
        # No heartbeats (0) from a client whose process the daemon watches through a pidfd, and its
        # connection: either going away ends the session at once.
        heartbeat_ms = 0.0 if s.pidfd is not None else self.config.heartbeat_ms
        self._send(route, p.Welcome(
            id=request_id, protocol=p.PROTOCOL_VERSION, session=s.id, key=s.key, device=s.device,
            backend=self.backend.name, slice_ms=slice_ms,
            grace_ms=policy.grace_ms, heartbeat_ms=heartbeat_ms, resumed=resumed, boot=self.boot,
            env=env, durable=self._journal_writer.durable(s.id), device_uuid=uuid,
            cuda_ordinal=welcome_ordinal(self.backend.name, uuid, env),
            pace=self._tokens.pace_board(s.device) if s.workload is not Workload.INFERENCE else "",
            suspended=resumed and self._suspensions.active(s) and minor >= 3))
        grant = self._tokens.grant_of(s) if resumed else None
        if grant is not None:
            self._send(route, p.Grant(grant=grant, device=s.device, slice_ms=slice_ms))

    def _on_heartbeat(self, route: bytes, msg: p.Heartbeat, frame, now: float) -> None:
        session = self._sessions.get(msg.session)
        if session is None:
            self._error(route, msg.id, p.ErrorCode.NO_SESSION,
                        f"no session {msg.session} (it was closed, timed out, or the daemon restarted); "
                        "open a new one with hello")
            return
        # Session ids are public (status lists them): saying this one lives tells nobody anything.
        if not hmac.compare_digest(session.key, msg.key):
            log.info("[session] heartbeat with a wrong key session=%s", session.id)
            self._error(route, msg.id, p.ErrorCode.FORBIDDEN,
                        f"session {msg.session} is alive, but that is not its key; send the key its welcome carried")
            return
        self._sessions.touch(session, now)
        self._send(route, p.HeartbeatAck(id=msg.id, boot=self.boot, durable=self._journal_writer.durable(session.id)))

    def _session_for(self, route: bytes, request_id: int, now: float) -> Session | None:
        session = self._sessions.by_route(route)
        if session is None:
            self._error(route, request_id, p.ErrorCode.NO_SESSION,
                        "this connection has no session; send hello first")
            return None
        self._sessions.touch(session, now)
        return session

    def _on_acquire(self, route: bytes, msg: p.Acquire, frame, now: float) -> None:
        s = self._session_for(route, msg.id, now)
        if s is None:
            return
        if not msg.quiet:
            self._send(route, p.Ok(id=msg.id))
        self._tokens.told_queue(s, now, msg.waiting, msg.oldest_wait_ms)  # before its grant
        if not self._suspensions.active(s):
            self._tokens.time_wait(s, now)
        self._gate.ask(s, now)  # kept (suspended, blocked), parked (restoring), held (lost), or asked

    def _on_release(self, route: bytes, msg: p.Release, frame, now: float) -> None:
        s = self._session_for(route, msg.id, now)
        if s is None:
            return
        # Suspending or suspended: a requeue is kept for the resume, as an acquire would be.
        requeue = msg.requeue and not self._suspensions.active(s)
        try:
            self._tokens.release_session(s, msg.grant, now, requeue=requeue)
        except NotHolderError:  # the scheduler's text is Python's (holder: None); say it in the protocol's
            self._error(route, msg.id, p.ErrorCode.NOT_HOLDER,
                        not_holder_text(s.id, s.device, self._tokens.grant_of(s), msg.grant,
                                        self._tokens.lane_holder(s.device, s.id)))
            return
        self._tokens.told_queue(s, now, msg.waiting, msg.oldest_wait_ms, released=True)
        if msg.requeue and not requeue:
            self._gate.ask(s, now)  # kept for the resume
        if not msg.quiet:
            self._send(route, p.Ok(id=msg.id))

    def _on_cancel(self, route: bytes, msg: p.Cancel, frame, now: float) -> None:
        s = self._session_for(route, msg.id, now)
        if s is None:
            return
        self._gate.withdraw(s)  # a request kept for an unblock or a resume, or held on a lost device, goes too
        self._send(route, p.Ok(id=msg.id))
        self._tokens.cancel_session(s, now)

    def _on_bye(self, route: bytes, msg: p.Goodbye, frame, now: float) -> None:
        s = self._session_for(route, msg.id, now)
        if s is None:
            return
        self._send(route, p.Ok(id=msg.id))
        self._drop(s, "bye", now)

    def _on_partition(self, route, msg: p.Partition, frame, now: float) -> None:
        why = refusal(Act.PARTITION, peer_of(route, frame))
        if why is not None:
            self._error(route, msg.id, p.ErrorCode.FORBIDDEN, why)
            return
        self._mps.on_partition(route, msg)

    def _queue_read(self, route, msg: p.StatusRequest | p.Inventory, frame, now: float) -> None:
        """Answer a status or an inventory (a status with lifecycle states), bounded in total and per
        peer: at once when it is small, else built a chunk per loop turn."""
        key = _read_key(route, frame)
        under_way = sum(map(len, self._status_jobs.values()))
        if under_way >= STATUS_JOBS_MAX:
            self._error(route, msg.id, p.ErrorCode.UNAVAILABLE,
                        f"{under_way} status requests are being answered; retry in a moment")
            return
        mine = self._status_jobs.get(key)
        if mine is not None and len(mine) >= STATUS_JOBS_PER_PEER:
            self._error(route, msg.id, p.ErrorCode.UNAVAILABLE,
                        f"this peer has {STATUS_JOBS_PER_PEER} status requests being answered; "
                        "wait for their replies before asking again")
            return
        job = _ReadJob(route, msg.id, key, "inventory" if type(msg) is p.Inventory else "status")
        if mine:
            mine.append(job)
            return
        # A peer with nothing under way takes its first chunk at once (a small status is
        # answered now), then its turns behind the peers already in line.
        self._status_jobs[key] = collections.deque([job])
        self._status_step(job)

    def _status_step(self, job: _ReadJob | None = None) -> None:
        """Build the next chunk of ``job``, else of the peer whose turn it is, and send the reply when whole. Its
        time is read when it starts, not when queued: the schedulers refuse a time older than one they have seen,
        and the reply is as of that one moment. A bug costs that status (``E_INTERNAL``), never the ones behind it."""
        if job is None:  # root's (an operator's, the device plugin's) first, then the peers in turn
            mine = self._status_jobs.get(_ROOT_KEY) or next(iter(self._status_jobs.values()))
            job = mine[0]
        try:
            if job.steps is None:
                now = self._clock()
                job.steps = (self._status_steps(now, job.request_id) if job.kind == "status"
                             else self._inventory_steps(now, job.request_id))
            next(job.steps)
            self._status_jobs[job.key] = self._status_jobs.pop(job.key)  # its peer to the back of the line
        except StopIteration as done:
            self._end_read(job)
            self._send(job.route, done.value)
        except Exception:
            self._end_read(job)
            self._count_bug("status", "[status] building a %s failed id=%d", job.kind, job.request_id)
            self._error(job.route, job.request_id, p.ErrorCode.INTERNAL, "internal error; see the daemon log")

    def _end_read(self, job: _ReadJob) -> None:
        """``job`` is answered: its peer's turn passes to the next peer in line."""
        mine = self._status_jobs.pop(job.key)
        mine.popleft()
        if mine:
            self._status_jobs[job.key] = mine  # to the back of the line

    # ------------------------------------------------------------ scheduler

    def _on_timers(self, now: float) -> None:
        """Every timed component's timers, in the list's order; a bug costs that component's step."""
        for where, timed in self._timers:
            self._contain(where, timed.on_timers, now)

    def _poll_timeout_ms(self) -> int:
        if self._status_jobs:
            return 0  # a status is being built: take the next chunk after what is ready now
        now = self._clock()
        wake_at = self._timers.next_deadline(now)
        if wake_at is None or wake_at == math.inf:
            return -1  # nothing timed is pending (the liveness check always is, in practice)
        # Round up: waking early would spin until the deadline.
        return max(0, math.ceil((wake_at - now) * 1000.0))

    def _tell_durability(self, session_id: str | None) -> None:
        """Whether a session (None: every session) is journalled changed: tell its client with an unasked
        ``heartbeat_ack`` (id 0), since watched sessions send no heartbeats to be told in the answer to."""
        for s in list(self._sessions.values()) if session_id is None else [self._sessions.get(session_id)]:
            if s is not None:  # _send skips one with no connection (not reattached yet)
                self._send(s.route, p.HeartbeatAck(id=0, boot=self.boot, durable=self._journal_writer.durable(s.id)))

    def _check_liveness(self, now: float) -> None:
        """Every quarter heartbeat interval: drop the sessions whose heartbeats stopped."""
        if now < self._next_liveness_check:
            return
        limit = self.config.heartbeat_timeout_s
        # Watched sessions (pidfd and a connection) need no heartbeat; a stopped
        # process cannot heartbeat: its pidfd says whether it lives. A restored
        # session that has not reattached (no connection) gets the timeout to do so.
        for s in [s for s in self._sessions.values()
                  if now - s.last_seen > limit and (s.pidfd is None or s.route is None) and not self._tokens.stopped(s)
                  and s.id not in self._closing]:
            # Told, in case it still reads: a notice (id 0), as for a lost device.
            self._send(s.route, p.Error(id=0, code=p.ErrorCode.NO_SESSION, message=(
                f"session {s.id} ended: nothing came from it for {limit * 1000:.0f} ms (heartbeat.misses x "
                "heartbeat.interval_ms); send heartbeats every welcome.heartbeat_ms and open a new session "
                "with hello")))
            self._drop(s, "heartbeat", now)
        self._next_liveness_check = now + self.config.heartbeat_ms / 4000.0

    # ------------------------------------------------------------- sessions

    def _drop(self, s: Session, reason: str, now: float) -> None:
        """End a session; a token it held passes on at once."""
        if not self._sessions.remove(s):
            return
        self._closing.pop(s.id, None)
        exited = reason in ("process_exited", ENDED)  # its process is gone, not only its connection
        if s.managed_pidfd is not None and reason != "bye" and (
                exited or procwatch.exiting(s.pidfd, s.verified_pid)):
            # Its launcher died (the launcher ends its program itself whenever it exits
            # alive; its connection may close before its pidfd says it exited): nothing
            # may run unmanaged, so the program goes with it.
            enforce.end_launched(s)
        elif s.managed_pidfd is not None:
            # The launcher lives (bye, a lost connection): undo any stop of ours whatever the
            # reason (harmless if none); its own stop is its to undo (nodeagent.enforce).
            self._tokens.cont(s, anyway=True)
        elif not exited and self._tokens.stopped(s):
            self._tokens.cont(s)
        self._sessions.close_pidfds(s)
        self._tokens.end_slice(s, now)
        self._serving.forget(s.id, now)
        self._suspensions.forget(s, now)
        self._mps.leave(s.id, s.device)
        self._journal_writer.write(lambda j: j.delete_session(s.id), session=s.id)
        self._gate.forget(s, now)
        if reason == "bye":
            log.info("[session] close session=%s name=%s", s.id, s.name)
        elif reason == ENDED:  # not lost: nothing was left undone
            log.info("[session] end session=%s name=%s pid=%d reason=%s (its process ended without closing "
                     "its client, holding no token)", s.id, s.name, s.pid, reason)
        else:
            self.metrics.sessions_lost.labels(reason).inc()
            log.warning("[session] lost session=%s name=%s pid=%d reason=%s", s.id, s.name, s.pid, reason)
        job = job_of(s)
        self._bus.event("session_leave", s.device, s.id, name=s.name, reason=reason,
                        **({} if job is None else {"borrower": job, "attained_gpu_s": self._attained.of(job, now)}))
        self._tokens.remove(s.device, s.id, now)  # a token it held passes on now

    def _reap_exited(self, fd: int, events: int) -> None:
        """Sessions whose process exited (the pidfd set became readable)."""
        for session in self._sessions.exited():
            self._drop(session, self._exit_reason(session), self._clock())

    def _flush_unreachable(self) -> None:
        while self._unreachable:
            peer, reason = self._unreachable.pop()
            s = self._sessions.by_route(peer)
            if s is None:
                continue
            now = self._clock()
            if reason == "closed":  # say why, when it is known: its process is gone, or only the connection
                if procwatch.exiting(s.pidfd, s.verified_pid):
                    reason = self._exit_reason(s)
                elif self._nothing_undone(s):
                    # Its process may be ending (a client closed at interpreter exit): its pidfd
                    # decides within ENDED_GRACE_S (_reap_exited), else it is lost then.
                    self._sessions.detach(s)
                    self._closing[s.id] = now + ENDED_GRACE_S
                    continue
                else:
                    reason = "disconnected"
            self._drop(s, reason, now)

    def _nothing_undone(self, s: Session) -> bool:
        """Whether ``s`` left nothing undone (:meth:`_exit_reason`'s ENDED) before its process has ended."""
        return (s.pidfd is not None and s.managed_pidfd is None and not self._tokens.stopped(s)
                and not self._suspensions.active(s) and self._tokens.grant_of(s) is None and not self._gate.kept(s)
                and self._tokens.state(s.device, s.id) is SessionState.IDLE
                and self._exit_reason(s) == ENDED)

    def _drop_closed(self, now: float) -> None:
        """Sessions whose connection closed and whose process lived on past ENDED_GRACE_S: lost."""
        for sid, deadline in list(self._closing.items()):
            if now >= deadline:
                del self._closing[sid]
                s = self._sessions.get(sid)
                if s is not None and s.route is None:
                    self._drop(s, "disconnected", now)

    def _exit_reason(self, s: Session) -> str:
        """Why the session of a process that exited (or is exiting) ends: ``ENDED`` when nothing
        was left undone, as a script that never closed its Client leaves it: the process is the
        kernel's word (pidfd), it held no token, and its connection holds no frame half-sent;
        else ``process_exited``, a lost session (it died mid-slice or mid-frame)."""
        peer = s.route
        half_sent = isinstance(peer, Peer) and len(peer.frames) > 0
        if s.pidfd is None or half_sent or s.id in self._tokens.holders(s.device):
            return "process_exited"
        return ENDED

    def _send(self, route: bytes | None, msg) -> None:
        if route is None:  # a restored session that has not reattached yet
            return
        if type(route) is ClusterRoute:  # a placement peer on the cluster endpoint
            self._cluster.send(route, msg)
            return
        local = self._local
        if local is not None:
            local.send(route, codec.encode(msg))

    def _error(self, route: bytes, request_id: int, code: str, message: str) -> None:
        self._send(route, p.Error(id=request_id, code=code, message=message))

    def _bad(self, route: bytes, request_id: int, message: str, code: str = p.ErrorCode.BAD_REQUEST) -> None:
        self.metrics.bad_requests.inc()
        log.debug("[serve] bad request: %s", message)
        self._error(route, request_id, code, message)

    def request_reload(self) -> None:
        """Re-read the cluster's allowed client keys (SIGHUP; nodeagent/cli.py). Safe from signal handlers."""
        self._cluster.request_reload()

    # -------------------------------------------------------------- status

    def status(self, now: float | None = None, request_id: int = 0) -> p.StatusReply:
        """The whole status at once (the cluster endpoint, tests); local peers get it in chunks."""
        steps = self._status_steps(self._clock() if now is None else now, request_id)
        while True:
            try:
                next(steps)
            except StopIteration as done:
                return done.value

    def _inventory_steps(self, now: float, request_id: int):
        """A generator like :meth:`_status_steps` whose return value is the inventory reply:
        the lifecycle states are read at ``now``, as the schedulers' are."""
        lifecycles = self._cluster.lifecycle_facts(now)
        status = yield from self._status_steps(now, request_id)
        return self._cluster.inventory_of(status, lifecycles, now, request_id)

    def _status_steps(self, now: float, request_id: int):
        """A generator that builds a status reply, yielding after every ``STATUS_CHUNK``
        session rows; its return value is the reply. The schedulers' state (holder,
        queue, each session's state and GPU time) and the attained service are taken
        for every device at the start, at one moment (``now``); the rest of a session's
        row is read when its turn comes, and a session that left meanwhile is left out."""
        devices = []
        built = 0
        infos = list(self._devices.refresh())
        snaps = [self._tokens.snapshot(i, now) for i in range(self._tokens.device_count)]
        activity = self._tokens.activity(now)
        attained = self._attained.snapshot(now)
        for info, snap, recent in zip(infos, snaps, activity):
            recent.suspensions = self._suspensions.asked_on(info.index)  # counted where they are asked
            sessions = []
            for view in snap.sessions:
                built += 1
                if built % STATUS_CHUNK == 0:
                    yield
                s = self._sessions.get(view.session)
                if s is None:
                    served = self._serving.session_info(view)
                    if served is not None:
                        sessions.append(served)
                    continue
                host_bytes, host_pinned = self._suspensions.host_kept(s)
                sessions.append(p.SessionInfo(
                    id=s.id, name=s.name, pid=s.pid, pid_verified=s.verified_pid is not None,
                    workload=s.workload.wire, weight=s.weight, state=view.state.value,
                    gpu_time_s=view.gpu_time_s, grants=view.grants, memory_mb=s.memory_mb, stopped=self._tokens.stopped(s),
                    memory_used_bytes=s.memory_used_bytes, managed_pgid=s.managed_pgid,
                    managed_cgroup=s.managed_cgroup.name if s.managed_cgroup is not None else None,
                    attached=s.route is not None, suspended=self._suspensions.state(s).wire,
                    bytes_parked=self._suspensions.parked_bytes(s), borrower=s.borrower, host_bytes=host_bytes,
                    host_pinned=host_pinned))
            devices.append(p.DeviceInfo(
                index=info.index, backend=info.backend, uuid=info.uuid, name=info.name,
                memory_total_bytes=info.memory_total_bytes, memory_used_bytes=info.memory_used_bytes,
                utilization_percent=info.utilization_percent, holder=snap.holder,
                queue=list(snap.queue), sessions=sessions,
                memory_declared_mb=memory.declared_mb(self._sessions.values(), info.index,
                                                      self._suspensions.suspended_ids()),
                memory_capacity_mb=memory.capacity_mb(info, self.config.memory_reserve_mb),
                mps=self._mps.runs_on(info.index),
                memory_workers_mb=memory.held_mb(self._serving.workers_share(info.index)),
                partition=self._mps.shares(info.index), activity=recent))
        return p.StatusReply(id=request_id, protocol=p.PROTOCOL_VERSION, daemon_pid=os.getpid(),
                             backend=self.backend.name, uptime_s=now - self._started, devices=devices,
                             boot=self.boot, attained_gpu_s=attained)

    def _session_rows(self) -> list[SessionRow]:
        rows = []
        for s in list(self._sessions.values()):
            try:
                state = self._tokens.state(s.device, s.id).value
            except KeyError:
                continue  # not in its device's scheduler: left out rather than failing the scrape
            used = s.memory_used_bytes if s.memory_used_bytes is not None else s.memory_mb * memory.MiB
            rows.append(SessionRow(str(s.device), s.workload.wire, "stopped" if self._tokens.stopped(s) else state, used,
                                   *self._suspensions.host_kept(s)))
        return rows

    def _device_rows(self) -> list[DeviceRow]:
        tokens = self._tokens
        return [DeviceRow(str(i), self._cluster.device_state(i), self._lost_devices.is_lost(i),
                          bool(tokens.holders(i)), tokens.waiting_count(i))
                for i in range(tokens.device_count)]


@dataclass(slots=True, eq=False)
class _ReadJob:
    """A status or inventory under way: who asked, and its steps once it has started."""

    route: object
    request_id: int
    key: object  # whose share of the queue it takes (_read_key)
    kind: str  # "status" or "inventory"
    steps: Generator | None = None  # made when the job reaches the front


_ROOT_KEY = ("root",)  # the ROOT role's (authz.is_root): a container's root is ("uid", 0)


def _read_key(route, frame):
    """Whose status requests these are, for the per-peer cap: a local peer's verified uid
    (however many connections it opens), a cluster peer's routing id, else the connection."""
    if type(route) is ClusterRoute:
        return ("cluster", bytes(route))
    creds = procwatch.peer_credentials(frame)
    if creds is not None:
        return _ROOT_KEY if is_root(creds) else ("uid", creds.uid)
    return ("route", route)


def not_holder_text(session: str, device: int, current: int | None, released: int, holder: str | None) -> str:
    """Why a release was refused (E_NOT_HOLDER), in the protocol's words."""
    if current is not None and current != released:  # it holds the token, under another grant
        return (f"grant {released} is not current: session {session} holds grant {current} of device {device}; "
                "release with the id of the latest grant notice")
    held = "no session holds it" if holder is None else f"session {holder} holds it"
    return (f"session {session} does not hold the token of device {device} ({held}); a release answers a grant "
            "(a revoke or a restart may have taken it)")


def welcome_ordinal(backend: str, uuid: str, env: dict[str, str]) -> int | None:
    """The CUDA ordinal a client welcomed with ``env`` uses for its GPU ``uuid``, where the
    daemon can tell: when ``env`` sets ``CUDA_VISIBLE_DEVICES`` naming it (an MPS session sees
    only its GPU, as device 0). None otherwise: the client finds it from the UUID."""
    if backend != "cuda" or "CUDA_VISIBLE_DEVICES" not in env:
        return None
    try:
        return device_id.ordinal_in_visible(uuid, env["CUDA_VISIBLE_DEVICES"])
    except device_id.DeviceNotVisibleError:
        return None


def _check_hello(msg: p.Hello) -> str | None:
    """Why a hello's values are unacceptable, or None. Lengths and ranges are the wire type's
    (``client_lib/protocol.py``: a frame outside them is refused as it is decoded)."""
    # Names reach logs and terminals (status, top): a control character could forge a log line
    # or drive another user's terminal.
    for field_name, text in (("name", msg.name), ("borrower", msg.borrower or "")):
        if not text.isprintable():
            return f"{field_name} must be printable (no control characters)"
    return None
