"""The worker pool supervisor (:class:`WorkerPool`): warm workers per device, the models on
them, requests routed to them. Driven by the daemon's loop and never blocking it: it reports a
worker's death, replies and replacements as :class:`PoolEvent` lists. Its rules: docs/internals.md.
"""

from __future__ import annotations

import collections
import logging
import multiprocessing
import multiprocessing.connection
import time
import weakref
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence, Union

import msgspec

from client_lib import protocol as p
from client_lib import tensors
from ctxpool import messages as msg
from ctxpool.messages import (DeviceStatus, ModelFailed, ModelReady, ModelSpec, PoolEvent, RequestDone,
                              RequestFailed, WorkerReady, WorkerReplaced, WorkerSnapshot)
from ctxpool.procs import (WEIGHTS_PREFIX, Resources, ShutdownStep, WorkerSetup, WorkerState, describe_exit,
                           escalate, sweep_stale_segments)
from ctxpool.worker import worker_main

__all__ = ["DeviceStatus", "ModelFailed", "ModelReady", "ModelSpec", "PoolError", "PoolEvent", "RequestDone", "RequestFailed",
           "ShutdownStep", "WorkerPool", "WorkerReady", "WorkerReplaced", "WorkerSetup", "WorkerSnapshot",
           "WorkerState", "sweep_stale_segments"]

log = logging.getLogger("ctxpool.pool")

E = p.ErrorCode


class PoolError(Exception):
    """A request the pool refuses at once; ``code`` is a protocol ErrorCode."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message


@dataclass
class _Request:
    request_id: int
    device: int
    model: str
    inputs: list[p.TensorRef]
    cancelled: bool = False  # answered or withdrawn already: no event follows for it
    owner_uid: Optional[int] = None  # the requester's verified uid: its inputs must be its own
    any_inputs: bool = False  # the requester is the daemon's ROOT: its inputs may be anyone's
    deadline: Optional[float] = None  # on the pool's clock: answered E_TIMEOUT then if not done
    kill_at: Optional[float] = None  # timed out while running: its worker is killed then if still at it


@dataclass(eq=False)
class _Worker:
    """One worker process and what the pool knows of it (identity-hashed: kept in sets)."""

    device: int
    process: multiprocessing.process.BaseProcess
    conn: Optional[multiprocessing.connection.Connection]
    started_at: float
    state: WorkerState = WorkerState.STARTING
    ready: bool = False  # Ready received
    warm_up_ms: float = 0.0
    attached: set[str] = field(default_factory=set)
    resident: list[str] = field(default_factory=list)
    ops: collections.deque = field(default_factory=collections.deque)  # control messages not yet sent
    inflight: Optional[msg.ToWorker] = None
    request: Optional[_Request] = None  # the Run in flight
    last_used: float = 0.0
    dying_reason: str = ""
    killed_for: str = ""  # why the pool killed it (a cancelled request, a missed start deadline)
    counts: bool = True  # whether its death counts against the restart budget

    def __post_init__(self) -> None:
        self.pid: int = self.process.pid  # type: ignore[assignment]
        self.sentinel: int = self.process.sentinel

    def fds(self) -> list[int]:
        return ([self.conn.fileno()] if self.conn is not None else []) + [self.sentinel]


@dataclass(eq=False)
class _Model:
    """A registration: preparing (one worker builds the weight segment) -> probing (that worker
    attaches it and runs its example) -> attaching (every other worker) -> ready."""

    spec: msg.ModelSpec
    devices: list[int]
    segment: str
    state: str = "preparing"  # preparing -> probing -> attaching -> ready
    manifest: Optional[msg.WeightManifest] = None
    pending: set = field(default_factory=set)  # workers whose Attach this registration waits for
    model_bytes: int = 0
    layers: int = 0
    groups: int = 0
    hangs: collections.deque = field(default_factory=collections.deque)  # when its requests' workers were killed

    def info(self, resident: list[int]) -> p.ModelInfo:
        return p.ModelInfo(name=self.spec.name, factory=self.spec.factory, weights=self.spec.weights,
                           model_bytes=self.model_bytes, layers=self.layers, groups=self.groups,
                           devices=list(self.devices), resident=resident)


class WorkerPool:
    """Warm worker processes per device, the models registered on them, and request routing."""

    def __init__(self, backend: str, devices: Sequence[int], *, workers_per_device: int = 2, pool_bytes: int = 0,
                 restart_budget: tuple[int, float] = (5, 60.0), extra_sys_path: Sequence[str] = (),
                 output_group: Optional[int] = None, start_timeout_s: float = 120.0, timeout_grace_s: float = 2.0,
                 hang_budget: tuple[int, float] = (3, 600.0),
                 on_fds_changed: Optional[Callable[[list[int], list[int]], None]] = None,
                 device_setup: Optional[Callable[[int], WorkerSetup]] = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """``device_setup(device)``: what a worker of ``device`` starts with, asked at every spawn
        (replacements included); by default no environment of its own, the device's index as its
        CUDA ordinal and no memory budget. The daemon's settings bound the counts and times given."""
        if not devices:
            raise ValueError("a worker pool needs at least one device")
        self._resources = Resources()
        self._finalizer = weakref.finalize(self, self._resources.cleanup)
        self.backend = backend
        self.devices = list(dict.fromkeys(devices))
        self.workers_per_device = workers_per_device
        self.pool_bytes = pool_bytes
        self.restart_budget = restart_budget
        self.extra_sys_path = tuple(extra_sys_path)
        self.output_group = output_group
        self.start_timeout_s = start_timeout_s
        self.timeout_grace_s = timeout_grace_s
        self.hang_budget = hang_budget
        self._on_fds_changed = on_fds_changed
        self._device_setup = device_setup
        self._clock = clock
        self._ctx = multiprocessing.get_context("spawn")  # never fork: the daemon holds a ZeroMQ context
        self._workers: dict[int, list[_Worker]] = {d: [] for d in self.devices}
        self._by_fd: dict[int, _Worker] = {}
        self._models: dict[str, _Model] = {}
        self._queues: dict[int, collections.deque[_Request]] = {d: collections.deque() for d in self.devices}
        self._requests: dict[int, _Request] = {}  # queued or running
        self._deaths: dict[int, collections.deque[float]] = {d: collections.deque() for d in self.devices}
        self._restarts = {d: 0 for d in self.devices}
        self._given_up: dict[int, str] = {}
        self._closed = False

    # ------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Spawn every worker; returns at once (each says Ready when warm: a WorkerReady event)."""
        sweep_stale_segments()
        try:
            for device in self.devices:
                for _ in range(self.workers_per_device):
                    self._spawn(device)
        except BaseException:
            self._finalizer()  # a half-started pool leaves no process behind
            raise
        log.info("[ctxpool] start backend=%s devices=%s workers_per_device=%d", self.backend, self.devices,
                 self.workers_per_device)

    def _spawn(self, device: int) -> _Worker:
        setup = WorkerSetup(ordinal=device) if self._device_setup is None else self._device_setup(device)
        parent, child = self._ctx.Pipe(duplex=True)
        try:
            proc = self._ctx.Process(target=worker_main, name=f"ctxpool-worker-{device}",
                                     args=(child, self.backend, device, self.pool_bytes, setup.memory_budget_bytes,
                                           self.extra_sys_path, self.output_group, dict(setup.env), setup.ordinal))
            proc.start()
        except BaseException:
            parent.close()
            raise
        finally:
            child.close()  # our copy: the worker's end must close with the worker, so that we see EOF
        worker = _Worker(device=device, process=proc, conn=parent, started_at=self._clock())
        self._resources.processes[proc.pid] = proc
        self._resources.conns[proc.pid] = parent
        self._workers[device].append(worker)
        for fd in worker.fds():
            self._by_fd[fd] = worker
        self._fds_changed(worker.fds(), [])
        log.info("[ctxpool] spawn device=%d pid=%d ordinal=%d budget_bytes=%s env=%s", device, proc.pid,
                 setup.ordinal, setup.memory_budget_bytes, sorted(setup.env))
        return worker

    def _fds_changed(self, added: list[int], removed: list[int]) -> None:
        if self._on_fds_changed is not None and (added or removed):
            self._on_fds_changed(added, removed)

    def watch_targets(self) -> list[int]:
        """Fds to poll for reading: each live worker's pipe and process sentinel."""
        return list(self._by_fd)

    def next_deadline(self) -> Optional[float]:
        """When (on the pool's clock) :meth:`on_deadline` has something to do (a start, a request's timeout,
        a timed-out request's grace ends); None if nothing waits for a deadline."""
        times = [w.started_at + self.start_timeout_s for ws in self._workers.values() for w in ws
                 if w.state is WorkerState.STARTING and not w.ready and not w.killed_for]
        times += [r.deadline for r in self._requests.values() if r.deadline is not None]
        times += [w.request.kill_at for w in self._live()
                  if w.request is not None and w.request.kill_at is not None and not w.killed_for]
        return min(times) if times else None

    def on_deadline(self) -> list[PoolEvent]:
        """Act on every deadline passed: a request past its timeout is answered ``E_TIMEOUT``; a worker
        still running it past ``timeout_grace_s`` is killed (its death not counted against the restart
        budget), and so is one not ready within ``start_timeout_s``. Deaths follow as events of their own."""
        now = self._clock()
        events: list[PoolEvent] = []
        for request in [r for r in self._requests.values() if r.deadline is not None and now >= r.deadline]:
            self._time_out(request, now, events)
        for worker in self._live():
            request = worker.request
            if request is not None and request.kill_at is not None and now >= request.kill_at:
                self._kill(worker, f"still running request {request.request_id} {self.timeout_grace_s:g} s after "
                                   "its timeout (the model hangs or is too slow for the timeout given)", counts=False)
                model = self._models.get(request.model)
                if model is not None:
                    model.hangs.append(now)
            elif (worker.state is WorkerState.STARTING and not worker.ready and not worker.killed_for
                    and now - worker.started_at >= self.start_timeout_s):
                self._kill(worker, f"not ready within start_timeout_s={self.start_timeout_s:g} s "
                                   "(raise it for a slow device or a large memory pool)", counts=True)
        return events

    def _time_out(self, request: _Request, now: float, events: list[PoolEvent]) -> None:
        """Answer ``request`` E_TIMEOUT; a running one's worker gets ``timeout_grace_s`` to finish it."""
        self._requests.pop(request.request_id, None)
        request.cancelled = True
        queue = self._queues[request.device]
        running = request not in queue
        if running:
            request.kill_at = now + self.timeout_grace_s
            where = (f"the model was still running; its worker is replaced unless it finishes within "
                     f"{self.timeout_grace_s:g} s")
        else:
            queue.remove(request)
            where = "it was still waiting for a worker (every worker of the device was busy)"
        log.warning("[ctxpool] timeout request=%d model=%s device=%d running=%s", request.request_id, request.model,
                    request.device, running)
        events.append(RequestFailed(request.request_id, E.TIMEOUT,
                                    f"model {request.model!r} did not answer within the request's timeout: {where}"))

    # ------------------------------------------------------------ models

    def register_model(self, spec: msg.ModelSpec) -> None:
        """Prepare the model on one worker, then attach it on every worker of its devices.
        The outcome comes as ModelReady or ModelFailed; PoolError when refused at once."""
        self._check_open()
        if not spec.name:
            raise PoolError(E.INVALID, "a model needs a non-empty name")
        if spec.name in self._models:
            raise PoolError(E.INVALID, f"model {spec.name!r} is already registered; unregister it first")
        devices = list(dict.fromkeys(spec.devices)) if spec.devices is not None else list(self.devices)
        unknown = [d for d in devices if d not in self._workers]
        if unknown or not devices:
            raise PoolError(E.DEVICE, f"model {spec.name!r} asks for devices {unknown or devices}; "
                                      f"this pool has workers on {self.devices}")
        candidates = [w for d in devices for w in self._live(d)]
        if not candidates:
            raise PoolError(E.UNAVAILABLE, f"no live worker on devices {devices}: {self._unavailable(devices[0])}")
        preparer = min(candidates, key=lambda w: (w.state is not WorkerState.IDLE, not w.ready,
                                                  len(w.ops) + (w.inflight is not None)))
        model = _Model(spec=spec, devices=devices, segment=tensors.segment_name(WEIGHTS_PREFIX))
        self._models[spec.name] = model
        self._resources.segments.add(model.segment)
        preparer.ops.append(msg.Prepare(model=spec.name, factory=spec.factory, weights=spec.weights,
                                        segment=model.segment, reader=spec.reader))
        log.info("[ctxpool] register model=%s factory=%s weights=%s devices=%s prepare_on=%d", spec.name,
                 spec.factory, spec.weights, devices, preparer.pid)
        self._pump(preparer, [])

    def unregister_model(self, name: str) -> list[PoolEvent]:
        """Forget a model: queued requests for it fail, workers drop it after what they run now."""
        model = self._models.get(name)
        if model is None:
            raise PoolError(E.NO_MODEL, f"no model {name!r} is registered")
        events: list[PoolEvent] = []
        if model.state != "ready":
            events.append(ModelFailed(name, E.NO_MODEL, f"model {name!r} was unregistered before it was ready"))
        self._forget(model, E.NO_MODEL, f"model {name!r} was unregistered while the request waited", events)
        log.info("[ctxpool] unregister model=%s", name)
        return events

    def models(self) -> list[p.ModelInfo]:
        """Registered models that are ready, with the devices where they are resident now."""
        return [m.info(self._resident_devices(m.spec.name)) for m in self._models.values() if m.state == "ready"]

    def weight_segment(self, name: str) -> str:
        """The shared-memory segment holding a registered model's weights (every worker maps it)."""
        model = self._models.get(name)
        if model is None:
            raise PoolError(E.NO_MODEL, f"no model {name!r} is registered")
        return model.segment

    def _resident_devices(self, name: str) -> list[int]:
        return sorted({w.device for ws in self._workers.values() for w in ws if name in w.resident})

    def _forget(self, model: _Model, code: str, message: str, events: list[PoolEvent]) -> None:
        """Remove a model everywhere: fail its queued requests, drop it from workers, unlink its segment."""
        name = model.spec.name
        self._models.pop(name, None)
        for device in model.devices:
            for request in [r for r in self._queues[device] if r.model == name]:
                self._queues[device].remove(request)
                self._requests.pop(request.request_id, None)
                events.append(RequestFailed(request.request_id, code, message))
        for worker in self._live():
            worker.ops = collections.deque(op for op in worker.ops if getattr(op, "model", None) != name)
            inflight_attach = isinstance(worker.inflight, msg.Attach) and worker.inflight.model == name
            if name in worker.attached or inflight_attach:
                worker.ops.append(msg.Drop(model=name))
                self._pump(worker, events)
        # A Prepare still in flight may yet create it: unlinked again when its reply or death comes.
        tensors.unlink_segment(model.segment)
        if not any(isinstance(w.inflight, msg.Prepare) and w.inflight.segment == model.segment for w in self._live()):
            self._resources.segments.discard(model.segment)

    def _fail_model(self, model: _Model, code: str, message: str, events: list[PoolEvent]) -> None:
        log.warning("[ctxpool] model-failed model=%s code=%s %s", model.spec.name, code, message)
        self._forget(model, E.NO_MODEL, f"model {model.spec.name!r} failed: {message}", events)
        events.append(ModelFailed(model.spec.name, code, message))

    # ------------------------------------------------------------ requests

    def submit(self, request_id: int, device: int, model: str, input_refs: list[p.TensorRef],
               owner_uid: Optional[int] = None, deadline: Optional[float] = None, any_inputs: bool = False) -> None:
        """Run ``model`` on ``input_refs`` (segments the caller keeps until the answer) on ``device``;
        with ``owner_uid``, inputs must be that uid's or uid 0's (anyone's with ``any_inputs``: the
        daemon's ROOT asks) and outputs are made its; past ``deadline`` (the pool's clock) it is answered
        E_TIMEOUT. The answer comes as RequestDone or RequestFailed; PoolError when refused at once."""
        self._check_open()
        if device not in self._workers:
            raise PoolError(E.DEVICE, f"device {device} has no workers (the pool has {self.devices})")
        if request_id in self._requests:
            raise PoolError(E.INVALID, f"request {request_id} is already queued or running")
        registered = self._models.get(model)
        if registered is None or registered.state != "ready":
            raise PoolError(E.NO_MODEL, f"no model {model!r} is registered" if registered is None
                            else f"model {model!r} is still being registered")
        if device not in registered.devices:
            raise PoolError(E.NO_MODEL, f"model {model!r} is registered on devices {registered.devices}, "
                                        f"not on {device}")
        hangs, window_s = self.hang_budget
        now = self._clock()
        while registered.hangs and now - registered.hangs[0] >= window_s:
            registered.hangs.popleft()
        if len(registered.hangs) >= hangs:
            again_s = registered.hangs[0] + window_s - now
            raise PoolError(E.MODEL, f"model {model!r} hung {len(registered.hangs)} times in the last "
                                     f"{window_s:g} s (its requests ran past their timeout and their workers were "
                                     f"replaced); it is refused for {again_s:.0f} s more, or until registered again")
        if not any(self._can_serve(w, model) for w in self._live(device)):
            raise PoolError(E.UNAVAILABLE, f"no worker on device {device} can run {model!r}: "
                                           f"{self._unavailable(device)}")
        request = _Request(request_id, device, model, list(input_refs), owner_uid=owner_uid, any_inputs=any_inputs,
                           deadline=deadline)
        self._requests[request_id] = request
        self._queues[device].append(request)
        idle = [w for w in self._live(device) if w.state is WorkerState.IDLE and model in w.attached]
        if idle:
            # The active worker if the model is resident there, else the standby (idle longest).
            worker = max(idle, key=lambda w: (model in w.resident, -w.last_used))
            self._pump(worker, [])

    def cancel(self, request_id: int, reason: str = "cancelled") -> bool:
        """Withdraw a request (its deadline passed): a queued one is dropped; a running one's worker
        is killed and replaced (not counted against the restart budget). No event follows for it."""
        request = self._requests.pop(request_id, None)
        if request is None:
            return False
        request.cancelled = True
        if request in self._queues[request.device]:
            self._queues[request.device].remove(request)
            return True
        for worker in self._live(request.device):
            if worker.request is request:
                self._kill(worker, f"request {request_id} {reason}", counts=False)
        return True

    def _can_serve(self, worker: _Worker, model: str) -> bool:
        if model in worker.attached:
            return True
        return worker.state is WorkerState.STARTING and (
            any(getattr(op, "model", None) == model for op in worker.ops)
            or getattr(worker.inflight, "model", None) == model or not worker.ready)

    def _unavailable(self, device: int) -> str:
        return self._given_up.get(device, "its workers are starting or lack the model")

    # ------------------------------------------------------------ events

    def on_readable(self, fd: int) -> list[PoolEvent]:
        """Handle a readable fd from :meth:`watch_targets`; never blocks. Stale fds are ignored."""
        worker = self._by_fd.get(fd)
        events: list[PoolEvent] = []
        if worker is None:
            return events
        exited = worker.process.exitcode is not None
        if worker.conn is not None and (exited or fd == worker.conn.fileno()):
            self._drain(worker, events)  # a dead worker's last frames (a Done, its Dying) come first
        if worker.state is not WorkerState.DEAD and exited:
            self._on_death(worker, events)
        return events

    def _drain(self, worker: _Worker, events: list[PoolEvent]) -> None:
        while worker.conn is not None and worker.state is not WorkerState.DEAD:
            try:
                if not worker.conn.poll(0):
                    return
                frame = worker.conn.recv_bytes()
            except (EOFError, OSError):
                # Its end closed: it exited or is exiting. Stop polling the pipe (EOF stays
                # readable); the sentinel says when it is gone.
                self._close_conn(worker)
                return
            try:
                reply = msg.decode_from_worker(frame)
            except (msgspec.DecodeError, msgspec.ValidationError) as exc:
                self._kill(worker, f"sent a malformed frame ({exc})", counts=True, stop_reading=True)
                return
            self._handle(worker, reply, events)

    def _close_conn(self, worker: _Worker) -> None:
        if worker.conn is None:
            return
        fd = worker.conn.fileno()
        self._by_fd.pop(fd, None)
        self._fds_changed([], [fd])  # unregistered before the fd number can be reused
        worker.conn.close()
        self._resources.conns.pop(worker.pid, None)
        worker.conn = None

    def _handle(self, worker: _Worker, reply: msg.FromWorkerMessage, events: list[PoolEvent]) -> None:
        if isinstance(reply, msg.Dying):
            worker.dying_reason = reply.reason
            log.error("[ctxpool] dying device=%d pid=%d reason=%s", worker.device, worker.pid, reply.reason)
            return
        if isinstance(reply, msg.Ready):
            if worker.ready:
                self._kill(worker, "sent Ready twice", counts=True, stop_reading=True)
                return
            self._on_ready(worker, reply, events)
            return
        sent = worker.inflight
        expected = {msg.Prepared: msg.Prepare, msg.Attached: msg.Attach, msg.Dropped: msg.Drop,
                    msg.Rejected: (msg.Prepare, msg.Attach), msg.Done: msg.Run, msg.Failed: msg.Run}[type(reply)]
        if not isinstance(sent, expected) or (
                reply.request_id != sent.request_id if isinstance(sent, msg.Run)  # type: ignore[union-attr]
                else reply.model != sent.model):  # type: ignore[union-attr]
            self._kill(worker, f"answered {reply!r} to {sent!r}", counts=True, stop_reading=True)
            return
        worker.inflight = None
        worker.last_used = self._clock()
        if isinstance(reply, (msg.Done, msg.Failed)):
            self._on_request_reply(worker, reply, events)
        else:
            self._on_model_reply(worker, reply, events)
        self._pump(worker, events)

    def _on_ready(self, worker: _Worker, reply: msg.Ready, events: list[PoolEvent]) -> None:
        worker.ready, worker.warm_up_ms = True, reply.warm_up_ms
        log.info("[ctxpool] ready device=%d pid=%d warm_up_ms=%.1f", worker.device, worker.pid, reply.warm_up_ms)
        for model in self._models.values():
            if model.manifest is not None and worker.device in model.devices:
                worker.ops.append(self._attach_message(model))
        self._pump(worker, events)

    def _attach_message(self, model: _Model) -> msg.Attach:
        return msg.Attach(model=model.spec.name, factory=model.spec.factory, manifest=model.manifest,
                          example_input=list(model.spec.example_input))

    def _on_request_reply(self, worker: _Worker, reply: Union[msg.Done, msg.Failed], events: list[PoolEvent]) -> None:
        request, worker.request = worker.request, None
        if isinstance(reply, msg.Done):
            worker.resident = list(reply.resident)
        if request is not None and not request.cancelled:
            self._requests.pop(request.request_id, None)
            if isinstance(reply, msg.Done):
                events.append(RequestDone(reply.request_id, worker.device, list(reply.outputs), reply.swap,
                                          reply.run_ms, reply.single))
            else:
                events.append(RequestFailed(reply.request_id, reply.code, reply.message))
        elif isinstance(reply, msg.Done):
            tensors.discard(reply.outputs)  # nobody waits for them any more

    def _on_model_reply(self, worker: _Worker, reply: msg.FromWorkerMessage, events: list[PoolEvent]) -> None:
        name = reply.model  # type: ignore[union-attr]
        model = self._models.get(name)
        if isinstance(reply, msg.Dropped):
            worker.attached.discard(name)
            return
        if isinstance(reply, msg.Attached):
            worker.attached.add(name)  # until a Drop queued meanwhile (if the model was forgotten) lands
            worker.resident = list(reply.resident)
            if model is not None and model.state != "ready":
                model.model_bytes, model.layers, model.groups = reply.model_bytes, reply.layers, reply.groups
                model.pending.discard(worker)
                if model.state == "probing":
                    self._attach_everywhere(model, events)
                self._maybe_ready(model, events)
            return
        if isinstance(reply, msg.Prepared):
            if model is None or model.segment != reply.manifest.segment:
                tensors.unlink_segment(reply.manifest.segment)  # forgotten while it was being prepared
                self._resources.segments.discard(reply.manifest.segment)
                return
            model.manifest, model.model_bytes, model.layers = reply.manifest, reply.model_bytes, reply.layers
            # The preparer attaches it first (its example input runs there): a model that kills
            # its worker then kills one worker, not every worker of the device at once.
            model.state = "probing"
            worker.ops.append(self._attach_message(model))
            model.pending.add(worker)
            log.info("[ctxpool] prepared model=%s bytes=%d probe_on=%d", name, reply.model_bytes, worker.pid)
            return
        if isinstance(reply, msg.Rejected):
            if model is not None and model.state != "ready":
                self._fail_model(model, reply.code, reply.message, events)
            elif model is not None:  # a replacement could not attach a model the others serve
                log.error("[ctxpool] attach-failed model=%s device=%d pid=%d: %s", name, worker.device,
                          worker.pid, reply.message)

    def _attach_everywhere(self, model: _Model, events: list[PoolEvent]) -> None:
        """The probe attached the model: every other ready worker of its devices attaches it now."""
        model.state = "attaching"
        name = model.spec.name
        for other in self._live():
            if other.device in model.devices and other.ready and not self._has_attach(other, name):
                other.ops.append(self._attach_message(model))
                model.pending.add(other)
                self._pump(other, events)
        log.info("[ctxpool] probed model=%s attach_on=%s", name, sorted(w.pid for w in model.pending))

    @staticmethod
    def _has_attach(worker: _Worker, name: str) -> bool:
        """Whether ``worker`` will hold model ``name`` once what it was sent lands: the latest Attach
        or Drop of it queued or in flight says (a Drop of a model since registered again), else
        whether it holds it now."""
        for op in (*reversed(worker.ops), worker.inflight):
            if isinstance(op, (msg.Attach, msg.Drop)) and op.model == name:
                return isinstance(op, msg.Attach)
        return name in worker.attached

    def _maybe_ready(self, model: _Model, events: list[PoolEvent]) -> None:
        if model.state == "attaching" and not model.pending:
            model.state = "ready"
            log.info("[ctxpool] model-ready model=%s bytes=%d layers=%d groups=%d", model.spec.name,
                     model.model_bytes, model.layers, model.groups)
            events.append(ModelReady(model.spec.name, model.info(self._resident_devices(model.spec.name))))

    def _pump(self, worker: _Worker, events: list[PoolEvent]) -> None:
        """Give a free worker its next message: control first, then the oldest request it can run."""
        if worker.inflight is not None or not worker.ready or worker.state in (WorkerState.DEAD, WorkerState.STOPPING):
            return
        if worker.ops:
            self._send(worker, worker.ops.popleft())
            return
        if worker.state is WorkerState.STARTING:
            worker.state = WorkerState.IDLE
            log.info("[ctxpool] serving device=%d pid=%d models=%s", worker.device, worker.pid,
                     sorted(worker.attached))
            events.append(WorkerReady(worker.device, worker.pid, worker.warm_up_ms))
        queue = self._queues[worker.device]
        request = next((r for r in queue if r.model in worker.attached), None)
        if request is None:
            worker.state = WorkerState.IDLE
            return
        queue.remove(request)
        worker.request = request
        self._send(worker, msg.Run(request_id=request.request_id, model=request.model, inputs=request.inputs,
                                   owner_uid=request.owner_uid, any_inputs=request.any_inputs))

    def _send(self, worker: _Worker, message: msg.ToWorker) -> None:
        worker.inflight = message
        if worker.state is not WorkerState.STARTING:
            worker.state = WorkerState.BUSY
        try:
            if worker.conn is None:
                raise BrokenPipeError("pipe closed")
            worker.conn.send_bytes(msg.encode(message))
        except OSError as exc:  # it died: its sentinel will say so, and the message counts as lost with it
            log.warning("[ctxpool] send to pid=%d failed: %s", worker.pid, exc)

    # ------------------------------------------------------------ deaths

    def _live(self, device: Optional[int] = None) -> list[_Worker]:
        devices = self.devices if device is None else [device]
        return [w for d in devices for w in self._workers[d]
                if w.state not in (WorkerState.DEAD, WorkerState.STOPPING)]

    def _kill(self, worker: _Worker, why: str, *, counts: bool, stop_reading: bool = False) -> None:
        """SIGKILL a worker the pool gives up on; its death is handled when its sentinel fires.
        ``stop_reading``: it broke the protocol, so nothing more it sent is believed."""
        if stop_reading:
            self._close_conn(worker)
        if worker.killed_for:
            return
        worker.killed_for, worker.counts = why, counts
        log.warning("[ctxpool] kill device=%d pid=%d: %s", worker.device, worker.pid, why)
        worker.process.kill()

    def _on_death(self, worker: _Worker, events: list[PoolEvent]) -> None:
        how = describe_exit(worker.process.exitcode)
        reason = how + "".join(f"; {r}" for r in (worker.killed_for, worker.dying_reason) if r)
        stopping = worker.state is WorkerState.STOPPING
        worker.state = WorkerState.DEAD
        self._close_conn(worker)
        self._by_fd.pop(worker.sentinel, None)
        self._fds_changed([], [worker.sentinel])
        worker.process.join(0)
        worker.process.close()  # releases the sentinel fd, unregistered above
        self._resources.processes.pop(worker.pid, None)
        self._workers[worker.device].remove(worker)
        log.warning("[ctxpool] worker-dead device=%d pid=%d %s", worker.device, worker.pid, reason)
        lost: list[int] = []
        if worker.request is not None:
            request, worker.request = worker.request, None
            lost.append(request.request_id)
            if not request.cancelled:
                self._requests.pop(request.request_id, None)
                events.append(RequestFailed(request.request_id, E.WORKER_DEAD,
                                            f"worker pid {worker.pid} on device {worker.device} died ({reason}) "
                                            f"while running request {request.request_id}; a replacement serves "
                                            "the next request"))
        sent = worker.inflight
        if isinstance(sent, (msg.Prepare, msg.Attach)):
            model = self._models.get(sent.model)
            if isinstance(sent, msg.Prepare):
                tensors.unlink_segment(sent.segment)
            if model is not None and model.state != "ready":
                if worker.killed_for:  # the pool's doing (a missed deadline, a broken protocol)
                    step = "preparing" if isinstance(sent, msg.Prepare) else "attaching"
                    self._fail_model(model, E.WORKER_DEAD, f"worker pid {worker.pid} died ({reason}) while "
                                                           f"{step} model {sent.model!r}", events)
                else:
                    # The registration's own code (factory, weights, example input) ended the worker:
                    # the registration fails, and the death spends none of the restart budget that
                    # keeps the device serving (registering is an operator's act, see the daemon).
                    worker.counts = False
                    self._fail_model(model, E.MODEL, _killed_by_registration(sent, worker.pid, reason), events)
        for model in list(self._models.values()):
            if worker in model.pending:
                model.pending.discard(worker)
                if model.state == "probing" and not model.pending:  # the probe died doing something else
                    self._attach_everywhere(model, events)
                self._maybe_ready(model, events)
        if stopping or self._closed:
            return
        new_pid = self._replace(worker, reason)
        events.append(WorkerReplaced(worker.device, worker.pid, new_pid, lost, reason))
        if not self._live(worker.device):
            self._fail_device(worker.device, events)

    def _replace(self, worker: _Worker, reason: str) -> Optional[int]:
        device = worker.device
        now = self._clock()
        deaths = self._deaths[device]
        if worker.counts:
            deaths.append(now)
        while deaths and now - deaths[0] > self.restart_budget[1]:
            deaths.popleft()
        limit, window_s = self.restart_budget
        if device in self._given_up:  # for good: a device that crashed its workers needs an operator
            log.error("[ctxpool] not replacing pid=%d: %s", worker.pid, self._given_up[device])
            return None
        if len(deaths) > limit:
            self._given_up[device] = (f"device {device}: {len(deaths)} worker deaths in {window_s:g} s exceed the "
                                      f"restart budget of {limit}; not replacing (last: pid {worker.pid}, {reason})")
            log.error("[ctxpool] give-up %s", self._given_up[device])
            return None
        self._restarts[device] += 1
        return self._spawn(device).pid

    def _fail_device(self, device: int, events: list[PoolEvent]) -> None:
        """No worker is left on ``device``: its queued requests and registrations cannot proceed."""
        message = self._unavailable(device)
        for request in list(self._queues[device]):
            self._requests.pop(request.request_id, None)
            events.append(RequestFailed(request.request_id, E.UNAVAILABLE, message))
        self._queues[device].clear()
        for model in list(self._models.values()):
            if model.state != "ready" and device in model.devices \
                    and not any(self._live(d) for d in model.devices):
                self._fail_model(model, E.UNAVAILABLE, message, events)

    # ------------------------------------------------------------ inspection

    def snapshot(self) -> dict[int, list[WorkerSnapshot]]:
        """Device -> its workers: pid, state, models attached, models resident, request running."""
        return {device: [WorkerSnapshot(pid=w.pid, state=w.state.value, models=sorted(w.attached),
                                        resident=list(w.resident),
                                        request_id=w.request.request_id if w.request else None)
                         for w in self._workers[device]]
                for device in self.devices}

    def device_status(self) -> dict[int, DeviceStatus]:
        """Device -> whether it can serve, requests waiting, replacements so far, why it gave up."""
        return {device: DeviceStatus(available=bool(self._live(device)) or device not in self._given_up,
                                     queued=len(self._queues[device]), restarts=self._restarts[device],
                                     gave_up=self._given_up.get(device, ""))
                for device in self.devices}

    @staticmethod
    def _ask_to_stop(worker: _Worker) -> bool:
        if not worker.ready or worker.conn is None:
            return False  # still starting: it reads no message before Ready
        try:
            worker.conn.send_bytes(msg.encode(msg.Shutdown()))
        except OSError:
            return False
        return True

    def _check_open(self) -> None:
        if self._closed:
            raise PoolError(E.SHUTTING_DOWN, "the worker pool is shutting down")

    # ------------------------------------------------------------ shutdown

    def shutdown(self, timeout_s: float = 5.0) -> dict[int, ShutdownStep]:
        """Stop every worker in steps (:func:`ctxpool.procs.escalate`; one still starting cannot read the
        Shutdown message); unlink every segment the pool made. Blocks. The step that stopped each, by pid."""
        self._closed = True
        started = time.monotonic()
        workers = [w for ws in self._workers.values() for w in ws]
        for worker in workers:
            worker.state = WorkerState.STOPPING
        steps = escalate({w.pid: (w.process, lambda w=w: self._ask_to_stop(w)) for w in workers}, timeout_s)
        lost = [r.request_id for r in self._requests.values()]
        if lost:
            log.warning("[ctxpool] shutdown: requests unanswered %s", lost)
        for worker in workers:
            worker.state = WorkerState.DEAD
            self._close_conn(worker)
            if self._by_fd.pop(worker.sentinel, None) is not None:
                self._fds_changed([], [worker.sentinel])
        self._resources.segments.update(model.segment for model in self._models.values())
        self._finalizer()  # reaps, closes, unlinks every segment
        self._workers = {d: [] for d in self.devices}
        self._models.clear(), self._requests.clear()
        log.info("[ctxpool] shutdown steps=%s in %.2f s", {pid: s.value for pid, s in steps.items()},
                 time.monotonic() - started)
        return steps


def _killed_by_registration(sent: Union[msg.Prepare, msg.Attach], pid: int, reason: str) -> str:
    """What a client is told when its registration's code ended the worker running it."""
    if isinstance(sent, msg.Prepare):
        culprit = f"the factory {sent.factory}" + (" (or loading its weights)" if sent.weights else "")
        doing = f"building model {sent.model!r}"
    else:
        culprit = f"the model of factory {sent.factory}"
        doing = f"attaching model {sent.model!r} and running its example input"
    return f"{culprit} killed its worker (pid {pid}, {reason}) while {doing}; nothing was registered"
