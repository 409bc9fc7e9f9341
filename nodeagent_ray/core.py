"""The controller's loop (:class:`ControllerCore`): read every node, decide
(:mod:`nodeagent_ray.policy`), carry it out through ``loans`` (:class:`LoanNodes`) and ``jobs``
(:class:`Jobs`), record what it did. No Ray here: :mod:`nodeagent_ray.actors` gives the Ray hands.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, replace
from typing import Protocol

from client_lib import protocol as p
from client_lib.placement import PlacementClient, PlacementError
from nodeagent_ray import policy as pol

log = logging.getLogger("nodeagent_ray.core")

__all__ = ["ControllerCore", "CoreConfig", "Jobs", "LoanNodes", "LoanRecord", "LoanNodeError", "Pending",
           "StopResult", "device_views"]


_CHANGES = frozenset({"device_state", "lend", "reclaim", "session_join", "session_leave", "suspend", "resume"})
"""Event kinds after which a node's inventory is read again (grants and health change nothing we decide on)."""


class LoanNodeError(RuntimeError):
    """A loan node could not be started, stopped or listed; the message says why."""


@dataclass(frozen=True)
class LoanRecord:
    """A loan node that exists on a node: for ``job``, since ``since`` (unix time)."""

    job: str
    since: float


@dataclass(frozen=True)
class StopResult:
    stop_ms: float  # until the loan node's process was told to stop
    ray_caught_up_ms: float | None  # until Ray showed the node gone (None: not measured)


class Pending(Protocol):
    """A loan node being started: ``result()`` is the ms it took, or raises LoanNodeError."""

    def done(self) -> bool: ...

    def result(self) -> float: ...


class LoanNodes(Protocol):
    def list(self, node: str) -> dict[int, LoanRecord]:
        """The loan nodes running on ``node``, by device; LoanNodeError when that cannot be read."""

    def start(self, node: str, device: int, job: str, uuid: str) -> Pending:
        """Start a loan node for ``device`` of ``node``, lent to ``job`` (idempotent)."""

    def stop(self, node: str, device: int) -> StopResult:
        """Stop that loan node, and say when Ray saw it go (idempotent)."""


class Jobs(Protocol):
    def list(self) -> dict[str, pol.JobView]:
        """The registered training jobs; raises when they cannot be read."""

    def loan_started(self, job: str) -> None:
        """A loan node for ``job`` is up: the job may grow (it hands its state off first)."""

    def loan_stopped(self, job: str) -> None:
        """A loan node of ``job`` is gone: the job shrinks."""


@dataclass(frozen=True)
class CoreConfig:
    tick_ms: float = 200.0  # longest wait for events in one turn
    resync_s: float = 1.0  # read everything again this often
    dead_after: int = 3  # inventories failed in a row before a node is dead
    dead_probe_s: float = 5.0  # how often a dead node is asked again (with dead_probe_ms to answer)
    dead_probe_ms: float = 200.0
    reclaim_deadline_ms: float = 3000.0  # a borrower's sessions not off the device by then are stopped
    lend_max_s: float | None = None  # each lend's max_s (the daemon reclaims on its own past it)
    # A lend under a lease (the deadline policy's) is made, and renewed, for the lease plus this: the
    # daemon takes the device back on its own only when the controller has not renewed it that long.
    lease_grace_s: float = 30.0
    retry_failed_lend_s: float = 30.0  # a device whose loan node failed to start is not lent again for this long
    policy: pol.PolicyConfig = pol.PolicyConfig()  # its name picks the policy (nodeagent_ray.policies)
    dedicated_nodes: tuple[str, ...] = ()  # training nodes: no inference there, their loans never reclaimed for it
    # The users whose sessions may join a lent device as its borrower: the loan nodes' Ray workers,
    # started by this controller's user (None: this process's uid). The daemon refuses anyone else.
    borrower_uids: tuple[int, ...] | None = None


class _Failed:
    """A loan node start that failed before it began: a Pending that raises."""

    def __init__(self, exc: Exception) -> None:
        self._exc = exc

    def done(self) -> bool:
        return True

    def result(self) -> float:
        raise LoanNodeError(str(self._exc))


def device_views(node: str, reply: p.InventoryReply) -> tuple[pol.DeviceView, ...]:
    """The policy's view of one node's inventory."""
    out = []
    for d in reply.devices:
        inference = 0
        training: dict[str, list[int]] = {}
        for s in d.sessions:
            if s.workload == "inference":
                inference += 1
            elif s.borrower is not None:
                counts = training.setdefault(s.borrower, [0, 0])
                counts[1 if s.suspended in ("suspended", "stopped") else 0] += 1
        out.append(pol.DeviceView(node=node, index=d.index, state=d.state, borrower=d.borrower,
                                  inference_sessions=inference, uuid=d.uuid,
                                  training={job: pol.SessionCount(r, s) for job, (r, s) in training.items()}))
    return tuple(out)


class ControllerCore:
    """The loop. ``record`` receives one dict per thing done (lend, reclaim, release, ...),
    with the measured times; the caller keeps them (a restarted controller appends)."""

    def __init__(self, placement: PlacementClient, loans: LoanNodes, jobs: Jobs, *,
                 config: CoreConfig = CoreConfig(), record: Callable[[dict], None] = lambda r: None,
                 clock: Callable[[], float] = time.monotonic, wall: Callable[[], float] = time.time) -> None:
        self._placement = placement
        self._loans = loans
        self._jobs = jobs
        self.config = config
        self._record = record
        self._clock = clock
        self._wall = wall
        self._inventory: dict[str, p.InventoryReply] = {}
        self._failures: dict[str, int] = {name: 0 for name in placement.nodes}
        self._dead: set[str] = set()
        self._loan_records: dict[str, dict[int, LoanRecord]] = {name: {} for name in placement.nodes}
        self._loans_unknown: set[str] = set(placement.nodes)  # not listed yet, or its agent did not answer
        self._job_views: dict[str, pol.JobView] | None = None
        self._starting: dict[tuple[str, int], tuple[Pending, str, float]] = {}  # key -> (pending, job, t0)
        self._joined_at: dict[tuple[str, int], float] = {}  # inference join seen on a lent device
        self._failed_at: dict[tuple[str, int], float] = {}  # when a loan node for the device failed to start
        self._next_resync = 0.0
        self._next_dead_probe = 0.0
        self._gaps_seen = dict(placement.event_gaps)
        self._lock = threading.Lock()
        self._inference_requests: list[tuple[int, Future]] = []

    # ------------------------------------------------------------ the loop

    def run(self, stop: threading.Event) -> None:
        """Turn until ``stop`` is set. Never raises for a node's fault; a bug in a turn is
        logged and the next turn starts from a fresh read of everything."""
        while not stop.is_set():
            try:
                self.turn()
            except Exception:  # a bug: log it, read everything again next turn
                log.exception("[controller] turn failed; reading every node again")
                self._next_resync = 0.0
                stop.wait(self.config.tick_ms / 1000.0)

    def turn(self) -> list[pol.Decision]:
        """Wait for events (up to ``tick_ms``), read what changed, decide, act. Returns the decisions."""
        dirty = self._pump_events(self.config.tick_ms)
        now = self._clock()
        if now >= self._next_resync or self._placement.event_gaps != self._gaps_seen:
            self._gaps_seen = dict(self._placement.event_gaps)
            self.refresh()
            self._next_resync = now + self.config.resync_s
        elif dirty:
            self.refresh_inventory(sorted(dirty))
        self._collect_started()
        decisions = self.act()
        return decisions

    def refresh(self) -> None:
        """Read every node's inventory, every node's loan nodes and the jobs."""
        self.refresh_inventory(self._placement.nodes)
        for name in self._placement.nodes:
            if name in self._dead:
                continue
            try:
                self._loan_records[name] = self._loans.list(name)
                self._loans_unknown.discard(name)
            except Exception as exc:  # an agent that cannot answer: what it last said stands, marked unknown
                log.warning("[controller] loan nodes of node=%s unknown: %s", name, exc)
                self._loans_unknown.add(name)
        try:
            self._job_views = self._jobs.list()
        except Exception as exc:
            log.warning("[controller] jobs unknown this round: %s", exc)
            self._job_views = None

    def refresh_inventory(self, nodes) -> None:
        """Read these nodes' inventories. A dead node is asked only every ``dead_probe_s``, with a short
        timeout, so that it does not slow every turn of the loop by the client's timeout."""
        now = self._clock()
        live = [n for n in nodes if n not in self._dead]
        results = self._placement.inventory(live) if live else {}
        dead = [n for n in nodes if n in self._dead]
        if dead and now >= self._next_dead_probe:
            self._next_dead_probe = now + self.config.dead_probe_s
            results.update(self._placement.call(p.Inventory, dead, timeout_ms=self.config.dead_probe_ms))
        for name, result in results.items():
            if result.ok and isinstance(result.reply, p.InventoryReply):
                self._inventory[name] = result.reply
                self._failures[name] = 0
                if name in self._dead:
                    self._dead.discard(name)
                    log.info("[controller] node=%s answers again", name)
                    self._record({"kind": "node_back", "node": name})
                continue
            self._failures[name] += 1
            if self._failures[name] >= self.config.dead_after and name not in self._dead:
                self._dead.add(name)
                log.warning("[controller] node=%s dead after %d failed inventories: %s", name,
                            self._failures[name], result.error)
                self._record({"kind": "node_dead", "node": name, "error": str(result.error)})

    def view(self) -> pol.ClusterView:
        """The policy's view of what was last read. A node not read yet (and not dead) shows no
        devices and unknown loans, so nothing is decided there until it answers."""
        nodes: dict[str, pol.NodeView] = {}
        loans: dict[tuple[str, int], pol.LoanView] = {}
        for name in self._placement.nodes:
            reply = self._inventory.get(name)
            nodes[name] = pol.NodeView(name, alive=name not in self._dead,
                                       devices=device_views(name, reply) if reply is not None else (),
                                       loans_known=name not in self._loans_unknown and reply is not None,
                                       dedicated=name in self.config.dedicated_nodes)
            for device, rec in self._loan_records[name].items():
                loans[(name, device)] = pol.LoanView(name, device, rec.job, rec.since)
        for (name, device), (_, job, _) in self._starting.items():
            loans.setdefault((name, device), pol.LoanView(name, device, job, self._wall()))
        with self._lock:
            wanted = sum(k for k, _ in self._inference_requests)
        return pol.ClusterView(nodes=nodes, loans=loans, jobs=self._with_node_signals(self._job_views),
                               inference_wanted=wanted)

    def _with_node_signals(self, jobs: dict[str, pol.JobView] | None) -> dict[str, pol.JobView] | None:
        """The jobs with what the nodes know of them and the jobs do not report themselves: the
        GPU-seconds each attained (summed over the nodes, each kept across its daemon's restarts)
        and its lease (the latest end of its leased lends, less ``lease_grace_s``), so that a
        restarted controller reads both back."""
        if not jobs:
            return jobs
        attained: dict[str, float] = {}
        leases: dict[str, float] = {}
        for name, reply in self._inventory.items():
            if name in self._dead:
                continue
            for job, gpu_s in reply.attained_gpu_s.items():
                attained[job] = attained.get(job, 0.0) + gpu_s
            for d in reply.devices:
                if d.state == "LENT" and d.borrower is not None and d.lent_until is not None:
                    until = d.lent_until - self.config.lease_grace_s
                    leases[d.borrower] = max(leases.get(d.borrower, until), until)
        out = {}
        for name, v in jobs.items():
            if v.attained_gpu_s == 0.0 and attained.get(name):
                v = replace(v, attained_gpu_s=attained[name])
            if v.lease_expires is None and name in leases:
                v = replace(v, lease_expires=leases[name])
            out[name] = v
        return out

    def act(self) -> list[pol.Decision]:
        view = self.view()
        decisions = pol.decide(view, self._wall(), self.config.policy)
        self._answer_inference_requests(view, decisions)
        touched: set[str] = set()
        for decision in decisions:
            handler = getattr(self, f"_do_{type(decision).__name__.lower()}")
            try:
                handler(decision, view)
            except (PlacementError, LoanNodeError) as exc:  # the next turn reads the state again and decides
                log.warning("[controller] %s failed: %s", decision, exc)
                self._record({"kind": "failed", "decision": type(decision).__name__.lower(),
                              "node": decision.node, "error": str(exc)})
            touched.add(decision.node)
        if touched:
            self.refresh_inventory(sorted(touched - self._dead))
        # A join seen on a device that is no longer lent (reclaimed, or lent to someone we do not lend for).
        self._joined_at = {key: t for key, t in self._joined_at.items() if self._lent(*key)}
        return decisions

    # ------------------------------------------------------------ a serving layer's demand

    def request_inference_devices(self, count: int) -> Future:
        """Thread-safe: take back the ``count`` cheapest loans for inference. The future's result is
        the (node, device) pairs reclaimed (fewer when fewer loans exist), once the loop chose them."""
        if count < 1:
            raise ValueError(f"count must be >= 1, got {count!r}")
        future: Future = Future()
        with self._lock:
            self._inference_requests.append((count, future))
        return future

    def _answer_inference_requests(self, view: pol.ClusterView, decisions: list[pol.Decision]) -> None:
        with self._lock:
            requests, self._inference_requests = self._inference_requests, []
        chosen = [(d.node, d.device) for d in decisions
                  if isinstance(d, pol.Reclaim) and d.reason == "inference demand"]
        for count, future in requests:
            future.set_result(chosen[:count])
            chosen = chosen[count:]

    # ------------------------------------------------------------ events

    def _pump_events(self, wait_ms: float) -> set[str]:
        """Read events for up to ``wait_ms``; returns the nodes to read again. Returns at once on an
        inference session joining a lent device: the turn goes on to reclaim it."""
        dirty: set[str] = set()
        deadline = self._clock() + wait_ms / 1000.0
        for node, event in self._placement.events(timeout_ms=max(1.0, wait_ms)):
            if event.kind == "session_join" and event.data.get("workload") == "inference" \
                    and self._lent(node, event.device):
                self._joined_at.setdefault((node, event.device), self._clock())
                log.info("[controller] inference joined lent device node=%s device=%s", node, event.device)
                dirty.add(node)
                return dirty
            if event.kind in _CHANGES or node in self._dead:  # any event from a dead node: it is back
                dirty.add(node)
            if self._clock() >= deadline:
                break
        return dirty

    def _lent(self, node: str, device: int | None) -> bool:
        reply = self._inventory.get(node)
        if reply is None or device is None:
            return False
        return any(d.index == device and d.state == "LENT" for d in reply.devices)

    # ------------------------------------------------------------ carrying out

    def _do_writeoff(self, d: pol.WriteOff, view: pol.ClusterView) -> None:
        for device, job in d.loans:
            try:  # best effort: on a dead machine there is nothing left to stop
                self._loans.stop(d.node, device)
            except Exception as exc:
                log.info("[controller] write-off node=%s device=%d: loan node not stopped (%s)", d.node, device, exc)
            self._forget(d.node, device)
            self._jobs_call("loan_stopped", job)
        log.warning("[controller] wrote off node=%s loans=%s", d.node, list(d.loans))
        self._record({"kind": "write_off", "node": d.node, "loans": [list(x) for x in d.loans]})

    def _do_reclaim(self, d: pol.Reclaim, view: pol.ClusterView) -> None:
        reply = self._placement.reclaim(d.node, d.device, deadline_ms=self.config.reclaim_deadline_ms)
        freed_at = self._clock()
        joined = self._joined_at.pop((d.node, d.device), None)
        rec = {"kind": "reclaim", "node": d.node, "device": d.device, "job": d.job, "then": d.then.value,
               "reason": d.reason, "free_ms": round(reply.free_ms, 3), "outcomes": dict(reply.outcomes),
               "join_to_free_ms": None if joined is None else round((freed_at - joined) * 1000.0, 3),
               "ray_caught_up_ms": None}
        log.info("[controller] reclaimed node=%s device=%d job=%s free_ms=%.1f then=%s outcomes=%s", d.node,
                 d.device, d.job, reply.free_ms, d.then.value, dict(reply.outcomes))
        if d.then is pol.Then.RELEASE:
            since_free_ms = (self._clock() - freed_at) * 1000.0
            stopped = self._stop_loan(d.node, d.device, d.job)
            if stopped is not None:  # Ray's catch-up counted from the device being free
                rec["ray_caught_up_ms"] = (None if stopped.ray_caught_up_ms is None
                                           else round(since_free_ms + stopped.ray_caught_up_ms, 3))
                rec["stop_ms"] = round(stopped.stop_ms, 3)
        self._record(rec)

    def _do_release(self, d: pol.Release, view: pol.ClusterView) -> None:
        stopped = self._stop_loan(d.node, d.device, d.job)
        self._record({"kind": "release", "node": d.node, "device": d.device, "job": d.job, "reason": d.reason,
                      "ray_caught_up_ms": stopped.ray_caught_up_ms if stopped else None})

    def _do_resume(self, d: pol.Resume, view: pol.ClusterView) -> None:
        started = self._clock()
        self._placement.lend(d.node, d.device, d.job, max_s=self.config.lend_max_s, borrower_uids=self._borrowers())
        reply = self._inventory.get(d.node)
        sessions = [s.id for dev in (reply.devices if reply else ()) if dev.index == d.device
                    for s in dev.sessions if s.borrower == d.job and s.suspended is not None]
        for session in sessions:
            self._placement.resume(d.node, session)
        ms = (self._clock() - started) * 1000.0
        log.info("[controller] resumed node=%s device=%d job=%s sessions=%s in %.1f ms", d.node, d.device, d.job,
                 sessions, ms)
        self._record({"kind": "resume", "node": d.node, "device": d.device, "job": d.job, "sessions": sessions,
                      "resume_ms": round(ms, 3)})

    def _borrowers(self) -> tuple[int, ...]:
        uids = self.config.borrower_uids
        return uids if uids is not None else (os.getuid(),)

    def _do_renew(self, d: pol.Renew, view: pol.ClusterView) -> None:
        # The lease is the daemon's: a new term for the lend (renew), which the next inventory reports
        # back (lent_until). A daemon whose controller stopped renewing takes the device back itself.
        reply = self._placement.renew(d.node, d.device, d.job, d.lease_s + self.config.lease_grace_s)
        log.info("[controller] lease renewed node=%s device=%d job=%s lease_s=%g lent_until=%s", d.node, d.device,
                 d.job, d.lease_s, reply.lent_until)
        self._record({"kind": "renew", "node": d.node, "device": d.device, "job": d.job, "lease_s": d.lease_s})

    def _do_lend(self, d: pol.Lend, view: pol.ClusterView) -> None:
        if (d.node, d.device) in self._starting:
            return
        started = self._clock()
        failed = self._failed_at.get((d.node, d.device))
        if failed is not None and started - failed < self.config.retry_failed_lend_s:
            return  # its loan node failed to start a moment ago: not again yet
        max_s = self.config.lend_max_s if d.lease_s is None else d.lease_s + self.config.lease_grace_s
        reply = self._placement.lend(d.node, d.device, d.job, max_s=max_s, borrower_uids=self._borrowers())
        lend_ms = (self._clock() - started) * 1000.0
        device = view.device((d.node, d.device))
        try:
            pending = self._loans.start(d.node, d.device, d.job, device.uuid if device else "")
        except Exception as exc:
            pending = _Failed(exc)  # handled with the others that fail: the device is taken back
        self._starting[(d.node, d.device)] = (pending, d.job, started)
        log.info("[controller] lent node=%s device=%d job=%s lend_ms=%.1f changed=%s (%s)", d.node, d.device, d.job,
                 lend_ms, reply.changed, d.reason)
        self._record({"kind": "lend", "node": d.node, "device": d.device, "job": d.job, "reason": d.reason,
                      "lend_ms": round(lend_ms, 3), **({} if d.lease_s is None else {"lease_s": d.lease_s})})

    def _collect_started(self) -> None:
        for key, (pending, job, started) in list(self._starting.items()):
            if not pending.done():
                continue
            del self._starting[key]
            try:
                ray_node_ms = pending.result()
            except Exception as exc:
                # The device is lent but no worker can reach it: give it back rather than keep it idle.
                log.warning("[controller] loan node for node=%s device=%d job=%s failed: %s; reclaiming", key[0],
                            key[1], job, exc)
                self._record({"kind": "loan_node_failed", "node": key[0], "device": key[1], "job": job,
                              "error": str(exc)})
                self._failed_at[key] = self._clock()
                try:
                    self._placement.reclaim(key[0], key[1], deadline_ms=self.config.reclaim_deadline_ms)
                except PlacementError as err:
                    log.warning("[controller] reclaim after a failed loan node: %s", err)
                continue
            self._loan_records[key[0]][key[1]] = LoanRecord(job, self._wall())
            log.info("[controller] loan node up node=%s device=%d job=%s in %.0f ms", key[0], key[1], job,
                     ray_node_ms)
            self._record({"kind": "loan_node", "node": key[0], "device": key[1], "job": job,
                          "ray_node_ms": round(ray_node_ms, 3),
                          "lend_to_node_ms": round((self._clock() - started) * 1000.0, 3)})
            self._jobs_call("loan_started", job)

    def _stop_loan(self, node: str, device: int, job: str) -> StopResult | None:
        key = (node, device)
        exists = key in self._starting or device in self._loan_records[node]
        if not exists:
            return None
        self._starting.pop(key, None)
        try:
            result = self._loans.stop(node, device)
        except Exception as exc:
            log.warning("[controller] loan node node=%s device=%d not stopped: %s", node, device, exc)
            return None
        self._forget(node, device)
        log.info("[controller] loan node stopped node=%s device=%d job=%s ray_caught_up_ms=%s", node, device, job,
                 result.ray_caught_up_ms)
        self._jobs_call("loan_stopped", job)
        return result

    def _forget(self, node: str, device: int) -> None:
        self._loan_records[node].pop(device, None)
        self._starting.pop((node, device), None)

    def _jobs_call(self, what: str, job: str) -> None:
        try:
            getattr(self._jobs, what)(job)
        except Exception as exc:  # a job that cannot be told still shrinks or grows when Ray sees the node
            log.warning("[controller] telling job=%s %s failed: %s", job, what, exc)
