"""The client side of a nodeagent session (:class:`Client`): connect, take turns at the device
(``slice()``, ``yield_point()``), suspend and resume on request, reattach after a daemon restart.
Over a transport of its own (:mod:`client_lib.transport`). Usage: README.md and docs/protocol.md.
"""

from __future__ import annotations

import functools
import logging
import os
import random
import select
import time
from contextlib import contextmanager, suppress
from typing import Any, Callable, Iterator, Sequence

from client_lib import cuda_probe, device_id, liveness
from client_lib import pace as pace_board
from client_lib import protocol as p
from client_lib import serving
from client_lib.endpoint import client_endpoint
from client_lib.limits import DEFAULT_SUSPEND_DEADLINE_MS, MAX_DEADLINE_MS
from client_lib.errors import (CudaTooEarlyError, DaemonUnavailableError, GrantTimeoutError, NodeAgentError,
                               NoSessionError, RequestTimeoutError, from_reply)
from client_lib.transport import ENV_HANDSHAKE_TIMEOUT, POLL_SLICE_MS, Transport, one_shot

log = logging.getLogger("client_lib.client")

ENV_BORROWER = "NODEAGENT_BORROWER"  # a training session's borrower when none is given (set by a cluster engine)
_UNMANAGED_RETRY_S = 1.0  # fail-open: how often to try reattaching
_UNMANAGED_HANDSHAKE_S = 0.2
# Waiting on a daemon that is away: the wait between attempts doubles from the first to the
# bound, each drawn from its upper half, so a client costs a few connects a second and a
# hundred of them do not arrive at a new daemon in step; the bound is what a restart may wait.
_REATTACH_FIRST_S = 0.02
_REATTACH_MAX_S = 0.25


class Client:
    """One session with the local nodeagent daemon.

    ``reconnect``: when the daemon goes away, wait up to ``reconnect_timeout_s``
    for it to come back (resuming the session) instead of raising
    :class:`DaemonUnavailableError`. ``fail_open``: while it is away and the
    lease is over, run without the token rather than wait.
    """

    def __init__(self, name: str, workload: str = "training", weight: float = 1.0,
                 device: int | None = None, endpoint: str | None = None, *,
                 memory_mb: int = 0, handshake_timeout_s: float | None = None,
                 reconnect: bool = True, reconnect_timeout_s: float = 30.0, fail_open: bool = False,
                 managed_pgid: int | None = None, borrower: str | None = None,
                 slo_ms: float | None = None) -> None:
        if workload not in p.WORKLOADS:
            raise ValueError(f"workload must be one of {', '.join(p.WORKLOADS)}, got {workload!r}")
        self.name = name
        self.workload = workload
        self.slo_ms = None if slo_ms is None else float(slo_ms)
        self.weight = float(weight)
        self.memory_mb = int(memory_mb)
        self.endpoint = endpoint or client_endpoint()
        self.reconnect = reconnect
        self.reconnect_timeout_s = reconnect_timeout_s
        self.fail_open = fail_open
        self.managed_pgid = managed_pgid
        if borrower is None and workload != "inference":  # inference has no borrower
            borrower = os.environ.get(ENV_BORROWER) or None
        self.borrower = borrower  # the training job this session belongs to (a device lent to it)
        self.handshake_timeout_s = (float(os.environ.get(ENV_HANDSHAKE_TIMEOUT, "5")) if handshake_timeout_s is None
                                    else handshake_timeout_s)
        self._wanted_device = device
        # The connection (framing, ids, replies awaited, the I/O lock); this class keeps the
        # session: what the daemon's notices mean.
        self._transport = Transport(self.endpoint)
        self._io = self._transport.io  # held while this client reads or writes; the liveness thread only tries it
        self._async_error: NodeAgentError | None = None  # error reply to a request sent without waiting
        self._grant: int | None = None
        self._yield_requested = False
        self._in_slice = False
        self._closed = False
        self._durable = True  # as last heard (welcome, then heartbeat acks)
        self._next_heartbeat: float | None = None  # unwatched sessions only (welcome.heartbeat_ms > 0)
        self._watch_again = 0.0  # the liveness thread found the owner inside: it looks again no sooner
        self._next_background_retry: float | None = None
        self._generation = 0  # connections made so far; a new one forgets what the old one asked
        self._lost_at: float | None = None  # when the daemon was found gone (None: it is there)
        self._unmanaged = False  # fail-open: running without the daemon
        self._next_retry = 0.0
        self._resume_failures, self._next_resume_try = 0, 0.0  # failed reattaches in a row; next try not before
        self._owner_reattaching = False  # in _reattach_blocking: the liveness thread does not try too
        self._suspend_requested = False
        self._resume_received = False
        self._park: Callable[[], int] | None = None
        self._unpark: Callable[[], None] | None = None
        self._held: Callable[[], tuple[int, bool]] | None = None
        self.last_suspend: tuple[int, float, float] | None = None  # (bytes_parked, suspend_ms, resume_ms)
        self.welcome: p.Welcome | None = None
        self._cuda_ordinal: int | None = None  # found from the welcome's UUID, once
        self.revocations = 0
        # Co-run pacing (client_lib.pace): where this lower-class session makes way for a higher
        # class; None where the device does not co-run (or this is the highest class).
        self._pace: pace_board.PacePoint | None = None
        self._fence: Callable[[], None] | None = None  # run before the token leaves (torch: finish queued work)
        self._connect(claim=None)

    # ------------------------------------------------------------ properties

    @property
    def session_id(self) -> str:
        return self.welcome.session

    @property
    def device(self) -> int:
        """The daemon's index of this session's device (NVML's order on cuda): not a CUDA
        ordinal of this process; use :attr:`cuda_device`."""
        return self.welcome.device

    @property
    def device_uuid(self) -> str:
        """This session's GPU by UUID (``GPU-...``; ``CPU-...`` on a cpu daemon; "" from an older daemon)."""
        return self.welcome.device_uuid

    @property
    def cuda_device(self) -> str:
        """The torch device of this session's GPU in this process: ``"cuda:N"`` (``"cpu"`` on a cpu
        daemon), N from the welcome, else from the UUID (:func:`client_lib.device_id.cuda_ordinal`,
        which may initialise CUDA). DeviceNotVisibleError if this process cannot see the GPU."""
        welcome = self.welcome
        if welcome.backend != "cuda":
            return "cpu"
        if welcome.cuda_ordinal is not None:
            return f"cuda:{welcome.cuda_ordinal}"
        if self._cuda_ordinal is None:
            # An older daemon sends no UUID: its index is all there is (right where CUDA's order is NVML's).
            self._cuda_ordinal = (device_id.cuda_ordinal(welcome.device_uuid) if welcome.device_uuid
                                  else welcome.device)
        return f"cuda:{self._cuda_ordinal}"

    @property
    def slice_ms(self) -> float:
        return self.welcome.slice_ms

    @property
    def durable(self) -> bool:
        """Whether the daemon has journalled this session, so that a daemon restart keeps it (as last heard:
        from the welcome, then each heartbeat ack). False while the daemon's state journal fails (disk full)."""
        self._pump(0)
        return self._durable

    @property
    def holding(self) -> bool:
        """True while this client holds its device's token (as last heard)."""
        self._pump(0)
        return self._grant is not None

    @property
    def grant_id(self) -> int | None:
        """The id of the grant this client holds (as last heard), None when it holds none."""
        self._pump(0)
        return self._grant

    @property
    def yield_requested(self) -> bool:
        self._pump(0)
        return self._yield_requested

    @property
    def suspend_requested(self) -> bool:
        """True once the daemon asked this client to give up the whole device."""
        self._pump(0)
        return self._suspend_requested

    @property
    def pacing(self) -> pace_board.PacePoint | None:
        """The co-run pause point of this session (None where the device does not pace it)."""
        return self._pace

    def set_fence(self, fence: Callable[[], None] | None) -> None:
        """``fence()`` runs before this client gives the token up at a yield or suspend, so that
        work it queued on the device finishes first (client_lib.torch.Pacer sets one)."""
        self._fence = fence

    def pace_point(self) -> float:
        """Co-run: wait while a higher class holds the device and the daemon's pacing says so;
        seconds waited (0 at once otherwise: one memory read). Call between units of work
        finer than a step (client_lib.torch.Pacer calls it between layers)."""
        pace = self._pace
        return pace.wait() if pace is not None else 0.0

    def set_suspend_handlers(self, park: Callable[[], int] | None, unpark: Callable[[], None] | None,
                             held: Callable[[], tuple[int, bool]] | None = None) -> None:
        """What to do when the daemon asks for the whole device: ``park()`` moves the state to host
        memory, frees device memory and returns the bytes parked; ``unpark()`` brings it back;
        ``held()`` gives (host bytes kept for the state, pinned), reported as ``suspended.host_bytes``."""
        self._park = park
        self._unpark = unpark
        self._held = held

    def _host_held(self) -> tuple[int, bool]:
        """(bytes, pinned) of host memory kept for parked state; (0, False) if unknown or it fails."""
        if self._held is None:
            return 0, False
        try:
            nbytes, pinned = self._held()
            return max(0, min(int(nbytes), 2**53)), bool(pinned)
        except Exception as exc:  # a report, never a reason to fail a suspension
            log.debug("[client] held() failed: %s", exc)
            return 0, False

    @property
    def unmanaged(self) -> bool:
        """True while running fail-open without the daemon."""
        return self._unmanaged

    # ---------------------------------------------------------------- token

    def acquire(self, timeout: float | None = None, *, waiting: int | None = None,
                oldest_arrival: float | None = None) -> int:
        """Block until this session holds the token; returns the grant id
        (0 while running unmanaged, fail-open).

        ``GrantTimeoutError`` after ``timeout`` seconds (the request is withdrawn). ``waiting``,
        ``oldest_arrival``: see :meth:`request`."""
        self._check_open()
        self._pump(0)
        self._check_daemon()
        if self._suspend_requested:
            self._suspend_in_place()
        if self._grant is not None:
            return self._grant
        if self._unmanaged:
            return 0
        self.request(waiting=waiting, oldest_arrival=oldest_arrival)
        return self._wait_for_grant(timeout)

    def request(self, *, waiting: int | None = None, oldest_arrival: float | None = None) -> None:
        """Ask for the token without waiting; the grant arrives as a notice (:attr:`holding`).

        Co-run, a higher-class service (2.7): ``waiting``, how many of its requests wait, this
        slice's included; ``oldest_arrival``, when the oldest arrived (``time.monotonic()``), so
        that lower classes pause only while it would miss its target (docs/architecture.md, Co-run)."""
        self._check_open()
        if self._grant is None:
            transport = self._transport
            transport.send_quiet(p.Acquire(id=transport.take_id(), quiet=True,
                                           **_queue_fields(waiting, oldest_arrival)))

    def cancel(self) -> None:
        """Withdraw a request made with :meth:`request` (a no-op when holding or not waiting)."""
        self._check_open()
        if self._grant is None:
            self._transport.send_quiet(p.Cancel(id=self._transport.take_id()))

    def release(self, requeue: bool = False, *, waiting: int | None = None,
                oldest_arrival: float | None = None) -> None:
        """Give the token back (no-op when not holding). Does not wait for the
        daemon. ``requeue`` asks for it again in the same step. ``waiting``,
        ``oldest_arrival``: the requests still waiting once this slice is done (a service
        that said its queue at :meth:`request`; a pause held for them lasts until none waits)."""
        if self._grant is None:
            return
        grant, self._grant = self._grant, None
        self._yield_requested = False
        # The daemon first, before reading anything: the next holder waits on its grant.
        transport = self._transport
        transport.send_quiet(p.Release(id=transport.take_id(), grant=grant, requeue=requeue, quiet=True,
                                       **_queue_fields(waiting, oldest_arrival)))
        self._pump(0)

    @contextmanager
    def slice(self, timeout: float | None = None, *,
              queue: Callable[[], tuple[int, float | None]] | None = None) -> Iterator[int]:
        """Hold the token for the block; yields the grant id.

        ``queue`` (co-run, a higher-class service): returns (requests waiting, when the oldest
        arrived by ``time.monotonic()``, or None); asked when the slice is requested and when it
        is given back. Take the request off your queue inside the block, so that the first
        answer counts it and the second does not::

            with client.slice(queue=lambda: (len(q), q[0].arrived if q else None)):
                serve(q.popleft())
        """
        waiting, oldest = queue() if queue is not None else (None, None)
        grant = self.acquire(timeout, waiting=waiting, oldest_arrival=oldest)
        self._in_slice = True
        try:
            yield grant
        finally:
            self._in_slice = False
            if not self._closed:
                waiting, oldest = queue() if queue is not None else (None, None)
                self.release(waiting=waiting, oldest_arrival=oldest)

    def yield_point(self) -> bool:
        """Call often (every iteration). Returns at once unless the daemon asked
        this client to yield or took its token: then it gives the token back,
        waits for the next grant, and returns True."""
        self._pump(0)
        self._check_daemon()
        if self._suspend_requested:
            self._suspend_in_place()
            return True
        self.pace_point()
        if self._yield_requested and self._grant is not None:
            if self._fence is not None:
                self._fence()  # the next holder gets the device, not a queue of our work
            # requeue: released and waiting again in one step, so no acquire to send.
            self.release(requeue=True)
            self._wait_for_grant(None)
            return True
        if self._in_slice and self._grant is None and not self._unmanaged:
            # Revoked, or back from a daemon restart without the token: wait our turn.
            if self._asked_in != self._generation:  # not asked on this connection yet
                self.request()
            self._wait_for_grant(None)
            return True
        return False

    def wait_event(self, timeout: float | None, fds: Sequence[int] = ()) -> list[int]:
        """Handle daemon messages until one arrives, one of ``fds`` becomes
        readable, or ``timeout`` seconds pass; returns the readable ``fds``.
        For event loops (``nodeagent run``) that watch other things too."""
        self._check_open()
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            poller = select.poll()
            conn_fd = self._watch_fd()
            if conn_fd is not None:
                poller.register(conn_fd, select.POLLIN)
            for fd in fds:
                poller.register(fd, select.POLLIN)
            wait_ms = POLL_SLICE_MS
            if deadline is not None:
                wait_ms = max(0, min(wait_ms, int((deadline - time.monotonic()) * 1000)))
            events = dict(poller.poll(wait_ms))
            if conn_fd is not None and conn_fd in events:
                self._pump(0)
            ready = [fd for fd in fds if fd in events]
            if events or (deadline is not None and time.monotonic() >= deadline):
                return ready
            if not self.daemon_healthy():
                return ready  # let the caller see the daemon is gone

    # --------------------------------------------------------------- others

    def status(self, timeout: float = 5.0) -> p.StatusReply:
        """The daemon's status snapshot."""
        return self._call(p.StatusRequest(id=self._transport.take_id()), timeout)

    # ------------------------------------------------------ server-side models

    def register_model(self, name: str, factory: str, weights: str | os.PathLike | None = None,
                       example_input: Any = None, *, device: int | None = None, replace: bool = False,
                       timeout: float = 600.0) -> p.ModelInfo:
        """Register a model with the daemon's warm workers (fields as docs/protocol.md, register_model,
        says; ``example_input``: one tensor or a tuple). Returns once every worker has it;
        :class:`ModelError` says what was wrong (nothing registered)."""
        self._check_open()
        if weights is not None:
            weights = os.path.abspath(os.fspath(weights))  # the daemon runs elsewhere
        with serving.Packed(serving.as_list(example_input), self.endpoint) as packed:
            req = p.RegisterModel(id=self._transport.take_id(), name=name, factory=factory, weights=weights,
                                  example_input=packed.refs, device=device, replace=replace)
            reply = self._call(req, timeout)
        return reply.model

    def infer(self, name: str, inputs: Any, *, timeout: float = 60.0) -> Any:
        """Run registered model ``name`` on ``inputs`` (a tensor/array or a tuple of them) in the
        daemon, under this session's token; returns one tensor or a list. :class:`InferenceError`,
        :class:`WorkerDeadError`, or :class:`RequestTimeoutError` past ``timeout`` (token wait included)."""
        self._check_open()
        values = serving.as_list(inputs)
        with serving.Packed(values, self.endpoint) as packed:
            req = p.Infer(id=self._transport.take_id(), model=name, inputs=packed.refs, timeout_ms=timeout * 1000.0)
            try:
                # The daemon answers E_TIMEOUT at ``timeout``; the margin lets that answer arrive first.
                reply = self._call(req, timeout + serving.REPLY_MARGIN_S)
            except DaemonUnavailableError as exc:
                if type(exc) is not DaemonUnavailableError or not self.daemon_healthy():
                    raise
                raise RequestTimeoutError(f"{p.ErrorCode.TIMEOUT}: no answer to infer {name!r} within its timeout of "
                                          f"{timeout:g} s (+{serving.REPLY_MARGIN_S:g} s margin) although the daemon "
                                          "is alive", p.ErrorCode.TIMEOUT) from exc
        return serving.take_outputs(reply, serving.kind_of(values), reply.single)

    def models(self, timeout: float = 5.0) -> list[p.ModelInfo]:
        """Models registered with the daemon."""
        return self._call(p.ModelsRequest(id=self._transport.take_id()), timeout).models

    def unregister_model(self, name: str, timeout: float = 30.0) -> None:
        self._call(p.UnregisterModel(id=self._transport.take_id(), name=name), timeout)

    def daemon_healthy(self) -> bool:
        """False once the daemon closed this client's connection (it went away or restarted)."""
        return self._transport.healthy

    def try_resume(self, handshake_timeout_s: float = _UNMANAGED_HANDSHAKE_S) -> bool:
        """One attempt to reattach to the daemon (resuming the session); True on success."""
        try:
            self._reattach("resume requested", handshake_timeout_s)
            return True
        except DaemonUnavailableError:
            return False

    def close(self) -> None:
        """End the session (the token, if held, passes on) and close sockets."""
        if self._closed:
            return
        self._closed = True
        liveness.forget(self)
        self._open_pace("")  # unmap the pace board, if any
        with self._io:
            # Wait for the bye's answer, so the daemon hears it as a goodbye and not as a vanished client.
            self._say_goodbye()
        self._grant = None

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __del__(self) -> None:
        with suppress(Exception):
            self.close()

    # ------------------------------------------------------- whole device

    def _suspend_in_place(self) -> None:
        """Park state, free the device, tell the daemon, wait for resume, restore,
        and (if we were in a slice) wait for the token again."""
        was_in_slice = self._in_slice or self._grant is not None
        if self._resume_received:  # resumed before we got here (the suspend was cancelled): nothing to do
            self._suspend_requested = self._resume_received = False
            return
        started = time.perf_counter()
        if self._fence is not None and self._park is None:
            self._fence()  # a park handler finishes the device's work itself
        bytes_parked = self._park() if self._park is not None else 0
        suspend_ms = (time.perf_counter() - started) * 1000.0
        self.release()
        self._suspend_requested = False  # a resume that already came stays noted: no wait then
        host_bytes, host_pinned = self._host_held()
        report = dict(bytes_parked=bytes_parked, suspend_ms=suspend_ms, host_bytes=host_bytes, host_pinned=host_pinned)
        self._transport.send_quiet(p.Suspended(id=self._transport.take_id(), **report))
        log.info("[client] suspended bytes_parked=%d suspend_ms=%.1f host_bytes=%d", bytes_parked, suspend_ms,
                 host_bytes)
        generation = self._generation
        while not self._resume_received:
            if self._generation != generation or self._suspend_requested:
                # Reattached to a restarted daemon (or asked again). One that kept the suspension
                # (protocol 2.3: welcome.suspended) hears that we are parked, and we wait on; one
                # that knows nothing of it lets us carry on.
                if self._generation != generation and not (self.welcome and self.welcome.suspended):
                    break
                generation = self._generation
                self._suspend_requested = False
                self._transport.send_quiet(p.Suspended(id=self._transport.take_id(), **report))
            if not self._pump(POLL_SLICE_MS):
                self._check_daemon()
        started = time.perf_counter()
        if self._unpark is not None:
            self._unpark()
        resume_ms = (time.perf_counter() - started) * 1000.0
        self._resume_received = False
        self.last_suspend = (bytes_parked, suspend_ms, resume_ms)
        if self._transport.conn is not None:
            self._transport.send_quiet(p.Resumed(id=self._transport.take_id(), resume_ms=resume_ms,
                                                 host_bytes=self._host_held()[0]))
        log.info("[client] resumed resume_ms=%.1f", resume_ms)
        if was_in_slice and not self._unmanaged:
            self.request()
            self._wait_for_grant(None)

    # ------------------------------------------------------- daemon away

    def _check_daemon(self) -> None:
        """React to the daemon going away or restarting (see docs/internals.md)."""
        if self._closed:
            return
        now = time.monotonic()
        if self._unmanaged:
            if now >= self._next_retry:
                self._next_retry = now + _UNMANAGED_RETRY_S
                if self.try_resume():
                    log.warning("[client] daemon at %s is back; managed again", self.endpoint)
            return
        if self._transport.healthy:
            return
        cause = "the daemon closed the connection"
        if not self.reconnect:
            raise DaemonUnavailableError(self.endpoint, cause)
        if self._lost_at is None:
            self._lost_at = now
            log.warning("[client] daemon at %s lost (%s)", self.endpoint, cause)
        if now >= self._next_resume_try:  # a restarted daemon may be there already: reattach, claiming our slice
            if self.try_resume():
                return
            self._resume_failed()  # tried again only after a backoff: a yield point every ms is no busy loop
        lease_end = self._lost_at + self.welcome.slice_ms / 1000.0
        if self._grant is not None and now < lease_end:
            return  # finish the slice we were given
        if self.fail_open:
            log.warning("[client] running unmanaged (fail-open) until the daemon returns")
            self._unmanaged = True
            self._next_retry = now + _UNMANAGED_RETRY_S
            return
        self._reattach_blocking(cause)

    def _reattach_blocking(self, cause: str) -> None:
        """Reattach, retrying until ``reconnect_timeout_s`` with a jittered backoff between
        attempts (:meth:`_resume_failed`), not in a busy loop."""
        deadline = time.monotonic() + self.reconnect_timeout_s
        self._owner_reattaching = True  # the liveness thread leaves it to us meanwhile
        try:
            while True:
                now = time.monotonic()
                if now < self._next_resume_try:
                    time.sleep(max(0.0, min(self._next_resume_try, deadline) - now))
                try:
                    self._reattach(cause, min(self.handshake_timeout_s, 1.0))
                    return
                except DaemonUnavailableError:
                    if time.monotonic() >= deadline:
                        raise DaemonUnavailableError(
                            self.endpoint, f"did not come back within reconnect_timeout_s={self.reconnect_timeout_s}"
                        ) from None
                    self._resume_failed()
        finally:
            self._owner_reattaching = False

    def _resume_failed(self) -> None:
        """A reattach failed: the next attempt, whoever makes it (the owner or the liveness
        thread), waits :func:`reattach_delay_s`, which grows with the failures in a row."""
        self._resume_failures += 1
        self._next_resume_try = time.monotonic() + reattach_delay_s(self._resume_failures)

    def _reattach(self, cause: str, handshake_timeout_s: float) -> None:
        """New sockets and a hello that resumes the session, claiming the slice we hold."""
        with self._io:  # reentrant: the liveness thread calls this holding it
            log.info("[client] reattaching to %s (%s)", self.endpoint, cause)
            claim, self._grant = self._grant, None  # _connect opens a new connection, closing this one
            self._yield_requested = False
            self._async_error = None
            try:
                self._connect(claim=claim, handshake_timeout_s=handshake_timeout_s)
            except DaemonUnavailableError:
                self._grant = claim  # still ours for the rest of the lease
                raise
            self._lost_at = None
            self._unmanaged = False
            self._resume_failures, self._next_resume_try = 0, 0.0
            if claim is not None:
                self._pump(100)  # the daemon answers a claim with a grant right after the welcome

    # ------------------------------------------------------------ internals

    def _connect(self, claim: int | None, handshake_timeout_s: float | None = None) -> None:
        """Open the connection and handshake (resuming the old session if any)."""
        timeout = handshake_timeout_s or self.handshake_timeout_s
        self._transport.open(timeout)
        old = self.welcome
        hello = p.Hello(
            id=self._transport.take_id(), protocol=p.PROTOCOL_VERSION, name=self.name, pid=os.getpid(),
            workload=self.workload, weight=self.weight, device=self._wanted_device,
            memory_mb=self.memory_mb, resume_session=old.session if old else None,
            resume_key=old.key if old else None, managed_pgid=self.managed_pgid, holding_grant=claim,
            borrower=self.borrower, slo_ms=self.slo_ms)
        try:
            welcome = self._call(hello, timeout, handshake=True)
        except BaseException:
            self._transport.close()
            raise
        if not isinstance(welcome, p.Welcome):
            raise NodeAgentError(f"expected welcome from {self.endpoint}, got {type(welcome).__name__}")
        if old is not None and not welcome.resumed:
            log.warning("[client] daemon at %s did not know session %s; now session %s",
                        self.endpoint, old.session, welcome.session)
        if old is None and welcome.env:
            try:
                _apply_env(welcome.env)
            except CudaTooEarlyError:  # close the session the daemon just opened: it cannot be used
                self._say_goodbye()
                self._closed = True
                raise
        self.welcome = welcome
        self._open_pace(welcome.pace)
        self._cuda_ordinal = None  # a new session may be on another GPU
        self._durable = welcome.durable
        self._next_heartbeat = (time.monotonic() + welcome.heartbeat_ms / 1000.0) if welcome.heartbeat_ms > 0 else None
        self._next_background_retry = None
        if not welcome.durable:
            log.warning("[client] session=%s is not durable: the daemon could not journal it (a daemon restart "
                        "would lose it)", welcome.session)
        self._generation += 1
        self._asked_in = None
        liveness.watcher().watch(self)
        log.debug("[client] session=%s device=%d slice_ms=%.0f resumed=%s", welcome.session, welcome.device,
                  welcome.slice_ms, welcome.resumed)

    def _open_pace(self, path: str) -> None:
        """Map the pace board the welcome names (co-run), or drop the one we had."""
        old = self._pace
        if old is not None and old.reader.path == path:
            old.reader.refresh()  # a restarted daemon's board may be another file at the same path
            return
        self._pace = None
        if old is not None:
            old.reader.close()
        if not path:
            return
        try:
            reader = pace_board.PaceBoardReader(path)
        except OSError as exc:  # not fatal: MPS priority and the daemon still make way
            log.warning("[client] cannot read the pace board %s (%s); this session is not paced finer than its "
                        "yield points", path, exc)
            return
        self._pace = pace_board.PacePoint(reader, p.WORKLOADS.index(self.workload), alive=self._daemon_there)

    def _daemon_there(self) -> bool:
        """For a wait on the pace board: False once the daemon hung up (the board may be stale)."""
        conn = self._transport.conn
        if conn is None or conn.closed_by_peer:
            return False
        poller = select.poll()  # not select(): a process may hold descriptors above FD_SETSIZE (1024)
        try:
            poller.register(conn.fileno(), select.POLLIN)
            events = poller.poll(0)
        except (OSError, ValueError):
            return False
        if events and events[0][1] & select.POLLNVAL:
            return False
        if events and self._io.acquire(blocking=False):
            try:
                self._pump(0, raise_async=False)
            except Exception:  # a reattach or an error is the owner's to see at its next call
                pass
            finally:
                self._io.release()
        return self._transport.healthy

    def _say_goodbye(self) -> None:
        """End the session with ``bye`` (if the daemon is there) and close the connection."""
        if self.daemon_healthy():
            with suppress(NodeAgentError, ConnectionError):
                self._call(p.Goodbye(id=self._transport.take_id()), timeout=1.0)
        self._transport.close()

    def _wait_for_grant(self, timeout: float | None) -> int:
        deadline = None if timeout is None else time.monotonic() + timeout
        self._asked_in = self._generation
        while self._grant is None:
            if self._unmanaged:
                return 0
            if self._suspend_requested:  # the daemon dropped our request: suspend, then ask again
                self._suspend_in_place()
                self._asked_in = None
            if self._asked_in != self._generation:  # a new connection: it must be asked again
                self._asked_in = self._generation
                self.request()
            remaining_ms = POLL_SLICE_MS
            if deadline is not None:
                remaining = deadline - time.monotonic()
                if remaining <= 0:
                    self._transport.send_quiet(p.Cancel(id=self._transport.take_id()))
                    raise GrantTimeoutError(f"no grant within {timeout} s on device {self.device}")
                remaining_ms = min(remaining_ms, max(1, int(remaining * 1000)))
            if not self._pump(remaining_ms):
                self._check_daemon()
        return self._grant

    def _check_open(self) -> None:
        if self._closed:
            raise NodeAgentError("client is closed")

    def _call(self, req: p.ClientMessage, timeout: float, handshake: bool = False) -> p.DaemonMessage:
        """Send ``req`` and wait for its reply, handling notices meanwhile."""
        return self._transport.call(req, timeout, functools.partial(self._pump, raise_async=False), handshake)

    def _pump(self, timeout_ms: int, raise_async: bool = True) -> bool:
        """Handle every message that arrives within ``timeout_ms``; True if any did."""
        with self._io:
            messages = self._transport.receive(timeout_ms)
            if messages is None:
                return False  # no connection: _check_daemon decides what follows
            for msg in messages:
                self._handle(msg)
            # The liveness thread leaves a due heartbeat to an owner inside the library (a wait in
            # acquire pumps for as long as the holder holds): a tcp session must not go silent.
            self._heartbeat_if_due(time.monotonic())
            if not messages:
                return False
        if raise_async:
            err, self._async_error = self._async_error, None
            if isinstance(err, NoSessionError) and self.reconnect:
                self._reattach(str(err), self.handshake_timeout_s)  # e.g. a restarted daemon
            elif err is not None:
                raise err
        return True

    def _handle(self, msg: p.DaemonMessage) -> None:
        kind = type(msg)
        if kind is p.Grant:
            self._grant = msg.grant
            self._yield_requested = False
        elif kind is p.YieldRequest:
            if msg.grant == self._grant:
                self._yield_requested = True
        elif kind is p.SuspendNotice:
            self._suspend_requested = True
            self._resume_received = False
        elif kind is p.ResumeNotice:
            self._resume_received = True
        elif kind is p.Revoke:
            if msg.grant == self._grant:
                self._grant = None
                self._yield_requested = False
                self.revocations += 1
                log.warning("[client] token revoked grant=%d reason=%s", msg.grant, msg.reason)
        elif self._transport.deliver(msg):
            pass
        elif kind is p.HeartbeatAck:
            if msg.durable != self._durable:
                self._durable = msg.durable
                if self.welcome is not None:  # before the welcome, the welcome says it
                    (log.info if msg.durable else log.warning)(
                        "[client] session=%s durable=%s (the daemon's state journal %s)", self.welcome.session,
                        msg.durable, "works again" if msg.durable else "cannot record it")
        elif kind is p.Error and msg.code != p.ErrorCode.NOT_HOLDER:
            # Error to a request sent without waiting. A release that raced a
            # revoke (E_NOT_HOLDER) is harmless; anything else is raised.
            self._async_error = from_reply(msg.code, msg.message)  # raised by the next pump


    # -------------------------------------------------- liveness thread hooks

    def _watch_fd(self) -> int | None:
        """The connection the liveness thread watches for a hang-up (None: none open)."""
        conn = self._transport.conn
        if conn is None or conn.closed_by_peer or self._closed:
            return None
        return conn.fileno()

    def _watch_due(self) -> float | None:
        """When the liveness thread must next act for this client without a hang-up."""
        retry = None if self._owner_reattaching else self._next_background_retry
        dues = [due for due in (self._next_heartbeat, retry) if due is not None]
        return max(min(dues), self._watch_again) if dues else None

    def _on_watch(self, now: float, hung_up: bool) -> None:
        """Called by the liveness thread: the daemon hung up, a heartbeat is due, or a
        background reattach is to be retried. Does nothing while the owner is inside
        the library (it handles all of it itself)."""
        if self._closed or not self._io.acquire(blocking=False):
            # The owner sends a due heartbeat as it pumps (_pump); moving the heartbeat on here
            # instead once kept it 50 ms ahead of every pump of a wait in acquire, and the daemon
            # dropped the waiting tcp session as silent. Only this thread's next look moves.
            self._watch_again = now + 0.05
            return
        try:
            conn = self._transport.conn
            if hung_up and conn is not None:
                conn.closed_by_peer = True
            if conn is None or conn.closed_by_peer:
                self._next_heartbeat = None
                if not self.reconnect or self._unmanaged:
                    self._next_background_retry = None
                    return  # the owner raises, or retries on its own schedule (fail-open)
                if self._lost_at is None:
                    self._lost_at = now
                    log.warning("[client] daemon at %s lost (it closed the connection); reattaching in the "
                                "background", self.endpoint)
                if self._owner_reattaching or now < self._next_resume_try:  # the owner's backoff holds here too
                    self._next_background_retry = self._next_resume_try
                    return
                try:
                    self._reattach("the daemon closed the connection", _UNMANAGED_HANDSHAKE_S)
                except DaemonUnavailableError:
                    if now - self._lost_at > self.reconnect_timeout_s:
                        self._next_background_retry = None  # the owner raises when it next calls in
                    else:
                        self._resume_failed()
                        self._next_background_retry = self._next_resume_try
                return
            self._heartbeat_if_due(now)
        finally:
            self._io.release()

    def _heartbeat_if_due(self, now: float) -> None:
        """Under the I/O lock: the heartbeat an unwatched session owes, if it is due."""
        if self._next_heartbeat is not None and self._next_heartbeat <= now and self.welcome is not None:
            self._transport.send_quiet(p.Heartbeat(id=self._transport.take_id(), session=self.welcome.session,
                                                   key=self.welcome.key))
            self._next_heartbeat = now + self.welcome.heartbeat_ms / 1000.0


def _queue_fields(waiting: int | None, oldest_arrival: float | None) -> dict:
    """The 2.7 queue fields of an acquire or release (none when the service says nothing)."""
    if waiting is None:
        return {}
    fields: dict = {"waiting": min(max(int(waiting), 0), 2**31 - 1)}
    if oldest_arrival is not None and waiting > 0:
        fields["oldest_wait_ms"] = min(max((time.monotonic() - oldest_arrival) * 1e3, 0.0), MAX_DEADLINE_MS)
    return fields


def reattach_delay_s(failures: int, rng: random.Random | None = None) -> float:
    """How long to wait after ``failures`` failed reattaches in a row: doubling from
    ``_REATTACH_FIRST_S`` to ``_REATTACH_MAX_S``, drawn from the upper half of that."""
    bound = min(_REATTACH_MAX_S, _REATTACH_FIRST_S * 2.0 ** min(max(failures, 1) - 1, 16))
    return bound * (rng or random).uniform(0.5, 1.0)


def _apply_env(env: dict[str, str]) -> None:
    """Put the daemon's settings (MPS pipe dir, SM share, memory limit) in the environment, where
    CUDA reads them at cuInit. :class:`CudaTooEarlyError` (nothing changed) if CUDA started in this
    process already and a setting differs: it would run outside its partition."""
    differing = {key: value for key, value in env.items() if os.environ.get(key) != value}
    if differing:
        detected_by = cuda_probe.cuda_initialised_by()
        if detected_by is not None:
            raise CudaTooEarlyError(differing, detected_by)
    os.environ.update(env)


def query_status(endpoint: str | None = None, timeout: float = 5.0) -> p.StatusReply:
    """One status request without opening a session (what ``nodeagent status`` does)."""
    return one_shot(p.StatusRequest(id=1), p.StatusReply, endpoint, timeout, "status")


def suspend_session(session: str, deadline_ms: float = DEFAULT_SUSPEND_DEADLINE_MS, endpoint: str | None = None,
                    timeout: float | None = None) -> p.SuspendResult:
    """Ask ``session`` to give up its whole device; returns once the device is free."""
    timeout = timeout if timeout is not None else deadline_ms / 1000.0 + 5.0
    return one_shot(p.SuspendSession(id=1, session=session, deadline_ms=deadline_ms), p.SuspendResult,
                     endpoint, timeout, "suspend")


def resume_session(session: str, endpoint: str | None = None, timeout: float = 5.0) -> None:
    """Let a suspended session come back."""
    one_shot(p.ResumeSession(id=1, session=session), p.Ok, endpoint, timeout, "resume")


def set_partition(device: int, shares: dict[str, float | None], memory_mb: dict[str, int] | None = None,
                  endpoint: str | None = None, timeout: float = 5.0) -> p.PartitionReply:
    """Set the MPS partition of ``device`` (root only): SM percent per session, None for an equal share."""
    return one_shot(p.Partition(id=1, device=device, shares=shares, memory_mb=memory_mb), p.PartitionReply,
                     endpoint, timeout, "partition")
