"""Server-side inference (:class:`Serving`): registered models run in the ctxpool's warm
workers under the device token. It owns the worker pool, the models, each client's serving
sub-session (``<session>:serve``) with its queue, and the requests in flight; the sub-sessions'
token actions come to it as :class:`nodeagent.daemon.bus.DelegatedAction` events.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import itertools
import logging
import re
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Container

import msgspec

from client_lib import protocol as p
from client_lib import tensors
from client_lib.endpoint import ipc_path
from ctxpool import peer_open
from ctxpool.messages import (ModelFailed, ModelReady, ModelSpec, RequestDone, RequestFailed, WorkerReady,
                              WorkerReplaced)
from ctxpool.pool import PoolError
from ctxpool.worker import OUTPUT_PREFIX  # outputs are na-out-<worker pid>-...
from nodeagent import memory, procwatch
from nodeagent.daemon import output_segments, worker_setup
from nodeagent.config import ServeConfig
from nodeagent.daemon.mps import MpsPartitions
from nodeagent.journal import ModelRecord
from nodeagent.daemon.journal_writer import JournalWriter
from nodeagent.daemon.memory_watch import context_allowance_mb
from nodeagent.daemon.sessions import SessionTable
from nodeagent.daemon.authz import Act, is_root, peer_of
from nodeagent.daemon.authz import refusal as authz_refusal
from nodeagent.daemon.bus import DelegatedAction, DeviceFacts, DeviceLost, LoopHandle, Replies
from nodeagent.daemon.tokens import Tokens
from sharing import AskYield, Enforce, Grant, Revoked, Workload

log = logging.getLogger("nodeagent.serving")


FACTORY_PATH = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*(\.[A-Za-z_][A-Za-z0-9_]*)*:[A-Za-z_][A-Za-z0-9_.]*$")
MAX_QUEUED = 256  # infer requests one session may have waiting; more are refused E_UNAVAILABLE
SERVE_SUFFIX = ":serve"
EXAMPLE_PREFIX = "na-example"  # the daemon's copies of example inputs: na-example-<daemon pid>-...
SHUTTING_DOWN = "daemon is shutting down; retry when it is back"


@dataclass
class _Job:
    """One infer request, from arrival to its reply."""

    job_id: int
    route: bytes
    request_id: int
    model: str
    inputs: list
    arrived: float
    deadline: float
    started: float | None = None


@dataclass
class _ServeQueue:
    """A client session's serving sub-session on its device."""

    sid: str  # scheduler session id
    device: int
    name: str
    weight: float
    root: bool  # the client is ROOT (authz.is_root): it may name any segment; a container's root may not
    outputs: output_segments.OutputSegments  # .uid: the client's verified uid, whose segments it may name
    pending: deque = field(default_factory=deque)
    running: _Job | None = None
    grant: int | None = None
    waiting: bool = False
    yield_asked: bool = False
    owner_gone: bool = False


@dataclass
class _Model:
    record: ModelRecord
    segment: object | None  # the daemon's copy of the example input
    example: list  # TensorRefs into ``segment``
    ready: bool = False
    info: p.ModelInfo | None = None
    waiters: list = field(default_factory=list)  # (route, request id) of register calls to answer
    journalled: bool = False


def ctxpool_wanted(setting: str) -> tuple[bool, str]:
    """Whether to start workers for ``ctxpool.enabled`` = auto | on | off, and why."""
    if setting == "off":
        return False, "ctxpool.enabled = off (the default; --ctxpool on starts them)"
    if importlib.util.find_spec("torch") is None:
        return False, "torch is not importable by the daemon's Python"
    return True, "ctxpool.enabled = " + setting


class Serving:
    """Model registration and server-side inference (what it owns: the module docstring; docs/internals.md)."""

    def __init__(self, *, config: ServeConfig, devices: DeviceFacts, loop: LoopHandle, sessions: SessionTable,
                 tokens: Tokens, mps: MpsPartitions, journal: JournalWriter, replies: Replies) -> None:
        """``tokens``: the serving sub-sessions take turns at each device's token there (added
        ``delegated``: their actions come back as :class:`DelegatedAction` events)."""
        self._config = config
        self._backend_name = devices.name
        self._sessions = sessions  # read: what sessions declared, when the workers' share is sized
        self._tokens = tokens
        self._devices = devices.info  # the latest device facts (status refreshes them)
        self._lost_devices = devices.lost
        self._mps = mps  # a worker of an MPS device is a client of its control daemon
        self._journal = journal  # models are journalled through it; its .journal is read at start
        self._poller = loop.poller
        self._clock = loop.clock
        self._send = replies.send
        self._error = replies.error
        self._session_for = replies.session_for  # the client session of a connection, or None (answered)
        self._pool = None
        self._models: dict[str, _Model] = {}
        self._queues: dict[str, _ServeQueue] = {}  # serving sub-session id -> its queue
        self._inflight: dict[int, tuple[_ServeQueue, _Job]] = {}
        self._job_ids = itertools.count(1)
        self._why_off = "not started"
        self._poll_fds_of_pool: set[int] = set()
        self._worker_shares: dict[int, memory.WorkerShare] = {}  # device -> what admission holds for its workers

    # ---------------------------------------------------------------- life

    def start(self, suspended: Container[str]) -> None:
        """Start the workers (if ``ctxpool.enabled`` wants them) and register the journalled models again.
        ``suspended``: the restored sessions whose declarations are in host memory (not counted
        in what ``ctxpool.resident_mb = "auto"`` leaves the workers)."""
        wanted, why = ctxpool_wanted(self._config.ctxpool_enabled)
        self._why_off = why
        if not wanted:
            log.info("[ctxpool] off: %s", why)
            return
        from ctxpool.pool import WorkerPool
        from ctxpool.procs import sweep_stale_segments

        sweep_stale_segments(EXAMPLE_PREFIX)  # a daemon killed with SIGKILL could not unlink its own
        sweep_stale_segments(OUTPUT_PREFIX)  # nor the outputs its dead workers made and nobody read
        cfg = self._config
        self._worker_shares = worker_setup.worker_shares(
            self._devices(), workers=cfg.ctxpool_workers_per_device, pool_mb=cfg.ctxpool_pool_mb,
            context_mb=context_allowance_mb(cfg.memory_context_allowance_mb, self._backend_name),
            resident_mb=cfg.ctxpool_resident_mb, reserve_mb=cfg.memory_reserve_mb,
            declared_mb={i: memory.declared_mb(self._sessions.values(), i, suspended)
                         for i in range(self._tokens.device_count)})
        for device, share in self._worker_shares.items():
            log.info("[ctxpool] device=%d %s", device, share.describe())
        self._pool = WorkerPool(
            self._backend_name, list(range(self._tokens.device_count)),
            workers_per_device=cfg.ctxpool_workers_per_device, pool_bytes=cfg.ctxpool_pool_mb << 20,
            restart_budget=(cfg.ctxpool_restart_budget, 60.0), extra_sys_path=tuple(cfg.ctxpool_python_path),
            output_group=tensors.socket_group(ipc_path(cfg.endpoint)), on_fds_changed=self._pool_fds_changed,
            timeout_grace_s=cfg.ctxpool_timeout_grace_ms / 1000.0, hang_budget=(cfg.ctxpool_hang_budget, 600.0),
            device_setup=self._worker_setup,
            clock=self._clock)
        self._pool.start()
        self._pool_fds_changed(added=self._pool.watch_targets(), removed=())
        log.info("[ctxpool] starting workers=%d per device devices=%d backend=%s",
                 cfg.ctxpool_workers_per_device, self._tokens.device_count, self._backend_name)
        if self._journal.journal is not None:
            for rec in self._journal_read(lambda j: j.models(), []):
                why = unrestorable_model(rec)
                if why is not None:
                    log.error("[ctxpool] not restoring model name=%s: %s", rec.name, why)
                    continue
                try:  # its weights are read with the rights of whoever registered it, as then
                    self._begin_registration(rec, journalled=True, reader=rec.registrant)
                except (tensors.TensorTransportError, OSError, ValueError, PoolError) as exc:
                    log.error("[ctxpool] cannot restore model name=%s: %s", rec.name, exc)

    def stop(self) -> None:
        """Answer what is open, stop the workers, free the example inputs (at shutdown)."""
        self._answer_pending_at_shutdown()
        if self._pool is not None:
            steps = self._pool.shutdown(5.0)
            log.info("[shutdown] step=workers %s", steps)
            for pid in steps:  # outputs of requests answered E_SHUTTING_DOWN, made but never reported
                self._sweep_orphan_outputs(pid)
            self._pool_fds_changed(added=(), removed=list(self._poll_fds_of_pool))
            self._pool = None
        for model in self._models.values():
            self._free_example(model)
        self._models.clear()

    def _answer_pending_at_shutdown(self) -> None:
        """Answer E_SHUTTING_DOWN, before the workers stop, every request the pool runs or queues, every
        one waiting for its device's token and every registration waiting for workers, so that no
        requester waits for its own timeout. Their input segments stay the clients' (they unlink them)."""
        running = [job for _, job in self._inflight.values()]
        queued = [job for q in self._queues.values() for job in q.pending]
        registering = [waiter for model in self._models.values() for waiter in model.waiters]
        for route, request_id in [(job.route, job.request_id) for job in running + queued] + registering:
            self._error(route, request_id, p.ErrorCode.SHUTTING_DOWN, SHUTTING_DOWN)
        self._inflight.clear()
        for q in self._queues.values():
            q.pending.clear()
        for model in self._models.values():
            model.waiters.clear()
        log.info("[shutdown] step=serving answered running=%d queued=%d registering=%d", len(running),
                 len(queued), len(registering))

    def _worker_setup(self, device: int):
        """What a worker of ``device`` starts with (asked at every spawn): its GPU by UUID, the
        device's MPS client settings on an MPS device, its resident-model budget."""
        control = self._mps.control(device)
        return worker_setup.setup_for(self._backend_name, self._devices()[device], self._worker_shares[device],
                                      mps_env=control.client_env() if control is not None else None)

    def workers_share(self, device: int) -> memory.WorkerShare | None:
        """What admission holds on ``device`` for its ctxpool workers; None while they do not run."""
        return self._worker_shares.get(device) if self._pool is not None else None

    def _pool_fds_changed(self, added=(), removed=()) -> None:
        for fd in removed:
            if fd in self._poll_fds_of_pool:
                self._poll_fds_of_pool.discard(fd)
                self._poller.unregister(fd)  # one unregistered already is let be
        for fd in added:
            if fd not in self._poll_fds_of_pool:
                self._poll_fds_of_pool.add(fd)
                self._poller.register(fd, on_ready=self._on_pool_readable, where="poll")

    def _journal_read(self, fn, default):
        try:
            return fn(self._journal.journal)
        except Exception:
            log.exception("[journal] read failed")
            return default

    # ----------------------------------------------------------- requests

    def on_register_model(self, route: bytes, msg: p.RegisterModel, frame, now: float) -> None:
        if self._pool is None:
            self._error(route, msg.id, p.ErrorCode.UNAVAILABLE,
                        f"server-side inference is off on this daemon ({self._why_off})")
            return
        creds = procwatch.peer_credentials(frame)
        if creds is None:  # fail closed: the example and the weights are opened as this peer
            self._error(route, msg.id, p.ErrorCode.FORBIDDEN,
                        "registering a model runs its factory in the daemon's workers: only local peers whose "
                        "identity the daemon can verify may do it")
            return
        if not self._operator(route, msg.id, frame, Act.REGISTER):
            return
        problem = self._check_registration(msg)
        if problem is not None:
            self._error(route, msg.id, *problem)
            return
        existing = self._models.get(msg.name)
        if existing is not None:
            rec = existing.record
            same = (rec.factory, rec.weights, rec.device) == (msg.factory, msg.weights, msg.device)
            if same and not msg.replace:
                if existing.ready:
                    self._send(route, p.ModelRegistered(id=msg.id, model=existing.info, changed=False))
                else:
                    existing.waiters.append((route, msg.id))
                return
            if not msg.replace:
                self._error(route, msg.id, p.ErrorCode.INVALID,
                            f"model {msg.name!r} is already registered (factory {rec.factory}, weights {rec.weights}); "
                            "unregister it first or pass replace=True")
                return
            self._unregister(msg.name)
        try:
            # The weights file is opened with the registering peer's rights, never root's; the
            # journal keeps them, so that a restarted daemon reads the file with the same rights.
            registrant = peer_open.identity_of(creds.uid, creds.gid, creds.pid)
            record = ModelRecord(name=msg.name, factory=msg.factory, weights=msg.weights, device=msg.device,
                                 example_refs=[], example_bytes=b"", created_unix=time.time(),
                                 registrant=registrant)
            record = _with_example(record, msg.example_input, owner_uid=None if is_root(creds) else creds.uid)
            self._begin_registration(record, journalled=False, waiter=(route, msg.id), reader=registrant)
        except tensors.SegmentAccessError as exc:
            self._error(route, msg.id, p.ErrorCode.FORBIDDEN, f"example input: {exc}")
        except tensors.TensorTransportError as exc:
            self._error(route, msg.id, p.ErrorCode.MODEL, f"example input: {exc}")
        except PoolError as exc:  # refused at once (no live worker, shutting down): nothing registered
            self._error(route, msg.id, exc.code, exc.message)

    def _operator(self, route, request_id: int, frame, act: Act) -> bool:
        """Whether this peer may register or unregister models (an operator's act: the factory runs
        as the daemon's user in its workers; :mod:`nodeagent.daemon.authz`); else answers E_FORBIDDEN."""
        try:
            group = self._config.ctxpool_register_gid()
        except ValueError as exc:  # the group went away since the start: root only
            log.error("[ctxpool] %s", exc)
            group = None
        why = authz_refusal(act, peer_of(route, frame, register_gid=group))
        if why is not None:
            self._error(route, request_id, p.ErrorCode.FORBIDDEN, f"{why} (a model's code runs as the daemon's "
                        "user in its workers); an administrator may name a group in ctxpool.register_group")
        return why is None

    def _check_registration(self, msg: p.RegisterModel) -> tuple[str, str] | None:
        """Why a registration cannot be carried out (code, message), or None. The name's pattern and
        the example's length are the wire type's (``client_lib/protocol.py``: refused as decoded)."""
        if not FACTORY_PATH.match(msg.factory):
            return p.ErrorCode.MODEL, f"factory must look like 'package.module:callable', got {msg.factory!r}"
        if msg.weights is not None and not msg.weights.startswith("/"):
            return p.ErrorCode.MODEL, f"weights must be an absolute path (the daemon has another cwd), got {msg.weights!r}"
        if msg.device is not None and not 0 <= msg.device < self._tokens.device_count:
            return p.ErrorCode.DEVICE, f"no device {msg.device}; this node has devices 0..{self._tokens.device_count - 1}"
        return None

    def _begin_registration(self, record: ModelRecord, *, journalled: bool, waiter=None,
                            reader: peer_open.PeerIdentity | None = None) -> None:
        segment, example = _example_segment(record)
        model = _Model(record=record, segment=segment, example=example, journalled=journalled)
        devices = [record.device] if record.device is not None else list(range(self._tokens.device_count))
        try:
            self._pool.register_model(ModelSpec(name=record.name, factory=record.factory, weights=record.weights,
                                                devices=devices, example_input=example, reader=reader))
        except PoolError:
            self._free_example(model)
            raise
        if waiter is not None:
            model.waiters.append(waiter)
        self._models[record.name] = model
        log.info("[ctxpool] register name=%s factory=%s weights=%s devices=%s restored=%s",
                 record.name, record.factory, record.weights, devices, journalled)

    def on_unregister_model(self, route: bytes, msg: p.UnregisterModel, frame, now: float) -> None:
        if not self._operator(route, msg.id, frame, Act.UNREGISTER):
            return
        if msg.name not in self._models:
            known = self._journal_read(lambda j: [r.name for r in j.models()], [])
            if msg.name not in known:
                self._error(route, msg.id, p.ErrorCode.NO_MODEL, f"no model {msg.name!r}")
                return
        self._unregister(msg.name)
        self._send(route, p.Ok(id=msg.id))

    def _unregister(self, name: str) -> None:
        model = self._models.pop(name, None)
        if model is not None:
            for route, rid in model.waiters:
                self._error(route, rid, p.ErrorCode.MODEL, f"model {name!r} was unregistered while registering")
            if self._pool is not None:
                try:
                    self._on_pool_events(self._pool.unregister_model(name))  # requests queued for it fail
                except PoolError as exc:  # the pool forgot it already (its registration failed)
                    log.warning("[ctxpool] unregister name=%s: %s", name, exc.message)
            self._free_example(model)
        self._journal.write(lambda j: j.delete_model(name))
        log.info("[ctxpool] unregister name=%s", name)

    def on_models(self, route: bytes, msg: p.ModelsRequest, frame, now: float) -> None:
        resident: dict[str, set[int]] = {}  # model -> the devices where a worker holds it now
        if self._pool is not None:
            for device, workers in self._pool.snapshot().items():
                for w in workers:
                    for name in w.resident:
                        resident.setdefault(name, set()).add(device)
        models = [msgspec.structs.replace(m.info, resident=sorted(resident.get(name, ())))
                  for name, m in sorted(self._models.items()) if m.info is not None]
        self._send(route, p.ModelsReply(id=msg.id, models=models))

    def on_infer(self, route: bytes, msg: p.Infer, frame, now: float) -> None:
        s = self._session_for(route, msg.id, now)
        if s is None:
            return
        lost = self._lost_devices.refusal(s.device)
        if lost is not None:  # its token is granted to nobody until the device answers again
            self._error(route, msg.id, p.ErrorCode.DEVICE, lost)
            return
        if self._pool is None:
            self._error(route, msg.id, p.ErrorCode.UNAVAILABLE,
                        f"server-side inference is off on this daemon ({self._why_off})")
            return
        model = self._models.get(msg.model)
        if model is None or not model.ready:
            state = "is still registering" if model is not None else "is not registered"
            known = ", ".join(sorted(n for n, m in self._models.items() if m.ready)) or "none"
            self._error(route, msg.id, p.ErrorCode.NO_MODEL, f"model {msg.model!r} {state} (ready: {known})")
            return
        if model.record.device is not None and model.record.device != s.device:
            self._error(route, msg.id, p.ErrorCode.DEVICE,
                        f"model {msg.model!r} is registered on device {model.record.device}; "
                        f"this session is on device {s.device}")
            return
        problem = _inputs_problem(msg.inputs, s.uid, any_owner=is_root(s))
        if problem is not None:
            self._error(route, msg.id, *problem)
            return
        q = self._queues.get(s.id + SERVE_SUFFIX)
        if q is not None and q.outputs.unread() >= output_segments.MAX_UNREAD:
            self._error(route, msg.id, p.ErrorCode.INVALID,
                        f"this session left {output_segments.MAX_UNREAD} outputs unread in shared memory; read "
                        "them (Client.infer does, then unlinks them) before asking for more")
            return
        if q is not None and len(q.pending) >= MAX_QUEUED:
            self._error(route, msg.id, p.ErrorCode.UNAVAILABLE,
                        f"this session has {len(q.pending)} infer requests waiting, the most one session may "
                        "queue; wait for their replies before sending more")
            return
        if q is None:
            q = _ServeQueue(sid=s.id + SERVE_SUFFIX, device=s.device, name=s.name, weight=s.weight,
                            root=is_root(s), outputs=output_segments.OutputSegments(s.uid))
            self._tokens.add(s.device, q.sid, Workload.INFERENCE, s.weight, now, delegated=True)
            self._queues[q.sid] = q
        q.pending.append(_Job(job_id=next(self._job_ids), route=route, request_id=msg.id, model=msg.model,
                              inputs=list(msg.inputs), arrived=now, deadline=now + msg.timeout_ms / 1000.0))
        if q.grant is None and not q.waiting:
            q.waiting = True
            self._tokens.request(q.device, q.sid, now)
        elif q.grant is not None and q.running is None and not q.yield_asked:
            self._serve_next(q, now)

    # ------------------------------------------------------- the token

    def on_delegated(self, event: DelegatedAction) -> None:
        """The bus's :class:`DelegatedAction`: a scheduler action for a serving sub-session (added
        ``delegated``: one of :attr:`_queues`)."""
        action, now = event.action, event.now
        q = self._queues[action.session]
        kind = type(action)
        if kind is Grant:
            q.grant = action.grant
            q.waiting = False
            q.yield_asked = False
            self._serve_next(q, now)
        elif kind is AskYield:
            q.yield_asked = True
            if q.running is None:
                self._serve_release(q, now)
        elif kind is Enforce:
            self._tokens.revoke(q.device, q.sid, now, "overrun")
            log.warning("[ctxpool] serving session=%s overran its yield deadline by %.1f ms: token revoked "
                        "(the running request completes)", q.sid, action.overrun_ms)
        elif kind is Revoked:
            q.grant = None
            q.yield_asked = False
            if q.pending and q.running is None:
                q.waiting = True
                self._tokens.request(q.device, q.sid, now)

    def _serve_next(self, q: _ServeQueue, now: float) -> None:
        """Run what waits while the queue holds its grant; give the token back once nothing runs."""
        while q.pending and q.running is None and not (q.yield_asked or q.owner_gone):
            job = q.pending.popleft()
            if now >= job.deadline:
                self._answer_timed_out(job, now)
                continue
            try:
                self._pool.submit(job.job_id, q.device, job.model, job.inputs, owner_uid=q.outputs.uid,
                                  any_inputs=q.root, deadline=job.deadline)
            except PoolError as exc:
                self._error(job.route, job.request_id, exc.code, exc.message)
                continue
            except Exception:  # a bug: it costs this request, never the queue (which holds the token)
                log.exception("[ctxpool] submit failed request=%d model=%s", job.request_id, job.model)
                self._error(job.route, job.request_id, p.ErrorCode.INTERNAL, "internal error; see the daemon log")
                continue
            job.started = now
            q.running = job
            self._inflight[job.job_id] = (q, job)
        if q.running is None:
            self._serve_release(q, now)

    def _serve_release(self, q: _ServeQueue, now: float) -> None:
        """Give back the queue's token, if it holds one; a gone client's queue leaves once nothing runs."""
        if q.grant is not None:
            grant, q.grant = q.grant, None
            q.yield_asked = False
            requeue = bool(q.pending) and not q.owner_gone
            q.waiting = requeue
            self._tokens.release(q.device, q.sid, grant, now, requeue=requeue)
        if q.owner_gone and q.running is None and self._queues.pop(q.sid, None) is not None:
            self._tokens.remove(q.device, q.sid, now)

    def forget(self, session_id: str, now: float) -> None:
        """The client session ended: its queued requests go; a running one finishes first."""
        q = self._queues.get(session_id + SERVE_SUFFIX)
        if q is None:
            return
        q.owner_gone = True
        for job in q.pending:
            _discard_inputs(job.inputs, q.outputs.uid, q.root)  # the client is gone; nobody else will unlink them
        q.pending.clear()
        q.outputs.release()  # outputs it was handed and never read
        if q.running is None:
            self._serve_release(q, now)

    def on_device_lost(self, event: DeviceLost) -> None:
        """The bus's :class:`DeviceLost`: requests waiting for the device's token are answered
        E_DEVICE and their queues leave the line (a running request ends with its worker)."""
        for q in self._queues.values():
            if q.device != event.device:
                continue
            for job in q.pending:  # their input segments stay the clients' (they unlink them)
                self._error(job.route, job.request_id, p.ErrorCode.DEVICE, event.notice)
            q.pending.clear()
            if q.waiting:
                q.waiting = False
                self._tokens.cancel(q.device, q.sid, event.now)

    # ------------------------------------------------------- the workers

    def next_deadline(self, now: float) -> float | None:
        """The earliest of the pool's deadlines (requests it runs or queues, starting workers)
        and those of requests still waiting for their session's token."""
        if self._pool is None:
            return None
        times = [job.deadline for q in self._queues.values() for job in q.pending]
        pool_at = self._pool.next_deadline()
        if pool_at is not None:
            times.append(pool_at)
        return min(times) if times else None

    def on_timers(self, now: float) -> None:
        """Requests past their timeout are answered E_TIMEOUT: by the pool for those it has (it
        replaces a worker still running one after the grace), here for those waiting for the token."""
        if self._pool is None:
            return
        if self._journal.ok and any(m.ready and not m.journalled for m in self._models.values()):
            self._journal_models_again()
        pool_at = self._pool.next_deadline()
        if pool_at is not None and pool_at <= now:
            self._on_pool_events(self._pool.on_deadline())
        for q in list(self._queues.values()):
            expired = [job for job in q.pending if now >= job.deadline]
            for job in expired:
                q.pending.remove(job)
                self._answer_timed_out(job, now)
            if expired and q.grant is not None and q.running is None and not q.pending:
                self._serve_release(q, now)

    def _journal_models_again(self) -> None:
        """Write the ready models whose journal write failed, now that the journal takes writes again."""
        for name, model in sorted(self._models.items()):
            if model.ready and not model.journalled:
                model.journalled = self._journal.write(lambda j, rec=model.record: j.put_model(rec))
                if not model.journalled:
                    return  # failing again: the next successful probe brings us back
                log.warning("[ctxpool] model name=%s journalled now", name)

    def _answer_timed_out(self, job: _Job, now: float) -> None:
        log.warning("[ctxpool] timeout request=%d model=%s waited_ms=%.0f (for the device token)", job.request_id,
                    job.model, 1000.0 * (now - job.arrived))
        self._error(job.route, job.request_id, p.ErrorCode.TIMEOUT,
                    f"request for model {job.model!r} waited {1000.0 * (now - job.arrived):.0f} ms for the device "
                    "and did not start within its timeout (raise the timeout, or the device is busy)")

    def _on_pool_readable(self, fd: int, events: int) -> None:
        if self._pool is None:
            return
        self._on_pool_events(self._pool.on_readable(fd))

    def _on_pool_events(self, events) -> None:
        for event in events:
            try:
                self._on_pool_event(event, self._clock())
            except Exception:
                log.exception("[ctxpool] handling %s failed", type(event).__name__)

    def _on_pool_event(self, event, now: float) -> None:
        kind = type(event)
        if kind is RequestDone or kind is RequestFailed:
            q, job = self._inflight.pop(event.request_id, (None, None))
            done = kind is RequestDone
            if done and (job is None or q.owner_gone):
                tensors.discard(event.outputs)  # made by our worker for a request nobody waits for
            if job is None:
                return
            if q.owner_gone:
                _discard_inputs(job.inputs, q.outputs.uid, q.root)
            elif done:
                q.outputs.handed(event.outputs)
                self._send(job.route, p.InferResult(
                    id=job.request_id, model=job.model, outputs=list(event.outputs), swap=event.swap,
                    queue_ms=1000.0 * (job.started - job.arrived), run_ms=event.run_ms, device=q.device,
                    single=event.single))
            else:
                self._error(job.route, job.request_id, event.code, event.message)
            self._job_finished(q, now)
        elif kind is ModelReady:
            model = self._models.get(event.name)
            if model is None:
                return
            model.ready = True
            model.info = event.info
            if not model.journalled:
                model.journalled = self._journal.write(lambda j, rec=model.record: j.put_model(rec))
                if not model.journalled:
                    log.error("[ctxpool] model name=%s is registered but not journalled (the journal write "
                              "failed): a restarted daemon will not know it; it is written again once the "
                              "journal takes writes", event.name)
            for route, rid in model.waiters:
                self._send(route, p.ModelRegistered(id=rid, model=event.info, changed=True))
            model.waiters.clear()
            log.info("[ctxpool] ready name=%s bytes=%d groups=%d", event.name, event.info.model_bytes,
                     event.info.groups)
        elif kind is ModelFailed:
            model = self._models.pop(event.name, None)
            if model is None:
                return
            for route, rid in model.waiters:
                self._error(route, rid, event.code, event.message)
            self._free_example(model)
            log.error("[ctxpool] registration failed name=%s code=%s: %s%s", event.name, event.code, event.message,
                      " (kept in the journal; retried at the next start)" if model.journalled else "")
        elif kind is WorkerReplaced:
            self._sweep_orphan_outputs(event.old_pid)
            log.warning("[ctxpool] worker replaced device=%d old_pid=%s new_pid=%s lost_requests=%d reason=%s",
                        event.device, event.old_pid, event.new_pid, len(event.lost_request_ids), event.reason)
        elif kind is WorkerReady:
            log.info("[ctxpool] worker ready device=%d pid=%d warm_up_ms=%.0f", event.device, event.pid,
                     event.warm_up_ms)
        else:
            log.debug("[ctxpool] event %s", event)

    def _job_finished(self, q: _ServeQueue, now: float) -> None:
        q.running = None
        if q.grant is not None or q.owner_gone:
            self._serve_next(q, now)
        elif q.pending and not q.waiting:
            q.waiting = True
            self._tokens.request(q.device, q.sid, now)

    def _sweep_orphan_outputs(self, worker_pid: int) -> None:
        """Outputs a dead worker made but never reported (killed between the two)."""
        handed = [q.outputs for q in self._queues.values()]
        for name in output_segments.orphans_of(worker_pid, OUTPUT_PREFIX, handed):
            tensors.unlink_segment(name)
            log.info("[ctxpool] unlinked orphan output segment=%s of dead worker pid=%d", name, worker_pid)

    def _free_example(self, model: _Model) -> None:
        if model.segment is not None:
            model.segment.close()
            model.segment.unlink()
            model.segment = None

    # ------------------------------------------------------------ status

    def session_info(self, view) -> p.SessionInfo | None:
        q = self._queues.get(view.session)
        if q is None:
            return None
        return p.SessionInfo(
            id=q.sid, name=f"{q.name} (server-side)", pid=0, pid_verified=False, workload="inference",
            weight=q.weight, state=view.state.value, gpu_time_s=view.gpu_time_s, grants=view.grants, memory_mb=0)


def _inputs_problem(refs: list[p.TensorRef], uid: int | None, any_owner: bool = False) -> tuple[str, str] | None:
    """Why a peer of ``uid`` may not send these inputs (code, message), or None. Each
    segment named must be that uid's own (checked on the opened fd, no symlinks), uid 0's
    too, unless ``any_owner`` (the peer is ROOT: a container's root is uid 0, and not)."""
    if uid is None:
        if any(r.shm for r in refs):
            return p.ErrorCode.FORBIDDEN, ("tensors in shared memory need a local connection whose user the "
                                           "daemon can verify (ipc://); this one cannot be")
        return None
    try:
        tensors.check_owner(refs, None if any_owner else uid)
    except tensors.SegmentAccessError as exc:
        return p.ErrorCode.FORBIDDEN, f"inputs: {exc}"
    except tensors.TensorTransportError as exc:
        return p.ErrorCode.INVALID, f"inputs: {exc}"
    return None


def _discard_inputs(refs: list[p.TensorRef], uid: int | None, any_owner: bool = False) -> None:
    """Unlink a departed client's input segments: only those its own user owns (ROOT: any it named)."""
    if uid is not None:
        tensors.discard(refs, owner_uid=None if any_owner else uid)


def _with_example(record: ModelRecord, refs: list[p.TensorRef], owner_uid: int | None = None) -> ModelRecord:
    """``record`` with the example input's bytes copied out of the client's segments
    (with ``owner_uid``: only segments that uid owns)."""
    segments = tensors.attach_all(refs, owner_uid=owner_uid)
    try:
        blob = bytearray()
        out = []
        for ref in refs:
            if ref.dtype not in tensors.DTYPE_BYTES:
                raise tensors.TensorTransportError(f"unknown dtype {ref.dtype!r}")
            offset = len(blob)
            if ref.nbytes:
                seg = segments[ref.shm]
                if ref.offset < 0 or ref.offset + ref.nbytes > seg.size:
                    raise tensors.TensorTransportError(f"tensor ref lies outside segment {ref.shm!r}")
                blob += seg.buf[ref.offset:ref.offset + ref.nbytes]
            blob += b"\0" * (-len(blob) % tensors.ALIGN_BYTES)
            out.append({"dtype": ref.dtype, "shape": list(ref.shape), "offset": offset, "nbytes": ref.nbytes})
    finally:
        for seg in segments.values():
            seg.close()
    return dataclasses.replace(record, example_refs=out, example_bytes=bytes(blob))


def unrestorable_model(rec: ModelRecord) -> str | None:
    """Why a journalled model is not registered again at start, or None: a row journalled before the
    registrant was (schema < 4) names a weights file only root's rights could read, and its path may
    have been repointed since (a symlink to a root-only file passes any owner or mode check)."""
    if rec.registrant is None and rec.weights is not None:
        return (f"it was journalled before the daemon recorded who registered models, so its weights file "
                f"{rec.weights} could only be read with the daemon's own rights; register it again (or "
                "unregister it to forget it)")
    return None


def _example_segment(record: ModelRecord):
    """A daemon-owned segment holding the example input, and refs into it."""
    if not record.example_bytes:
        return None, [p.TensorRef(dtype=r["dtype"], shape=r["shape"]) for r in record.example_refs]
    # Reserved: on a full /dev/shm the copy below would be a SIGBUS that kills the daemon;
    # this is SharedMemoryFull (E_MODEL naming the size) instead.
    seg = tensors.create_segment(len(record.example_bytes), prefix=EXAMPLE_PREFIX, reserve=True)
    seg.buf[:len(record.example_bytes)] = record.example_bytes
    refs = [p.TensorRef(dtype=r["dtype"], shape=r["shape"], shm=seg.name if r["nbytes"] else "",
                        offset=r["offset"], nbytes=r["nbytes"]) for r in record.example_refs]
    return seg, refs
