"""The discrete-event cluster behind bench.cluster_sim: the controller's real ``decide()``
(:mod:`nodeagent_ray.policy`, the code the Ray controller runs) against a modelled cluster.

What is modelled, and from what:

- Every device follows the daemon's own lifecycle (:class:`sharing.lifecycle.DeviceLifecycle`,
  the daemon's pure state machine): FREE, RUN, PROTECT (``protect_s`` after inference leaves
  or a reclaim; 0 on dedicated training nodes), LENT.
- Inference: a serving layer keeps as many inference devices busy as the demand curve says.
  It takes an idle inference device first (PROTECT, then FREE: no wait); when none is idle it
  asks the controller for devices (``ClusterView.inference_wanted``), and the policy's
  Reclaims free them after ``controller_ms`` + a reclaim (``reclaim_base_ms`` + the job's
  state parked at ``park_gb_per_s``: nodeagent's measured reclaim and park). That time is
  the inference wait.
- Training: a job progresses at its ``steps_per_s`` for the workers it runs on. A Lend
  brings a loan node up after ``loan_node_s``; each change of a job's worker count then
  stops it for a Ray Train resize (``grow_s``, ``shrink_s``, ``start_s`` from nothing:
  measured 11.8-18.6 s and 7.4-15.3 s). A reclaim of a job's last worker parks it: no
  progress, and a Resume continues it in-process after ``resume_ms`` (no resize). A job
  whose last loan is released waits with its state handed off, and starts again (``start_s``)
  when it is lent a device.
- The controller runs ``decide()`` after every event and ``tick_s`` apart, and once more a
  second after a turn that decided something (its ``resync_s``), and carries out what it
  returns at once (a lend's ms are negligible beside a resize).

The JobView fed to ``decide`` carries the signals issue 25 asks the node and the job for,
taken from the simulation: GPU-seconds attained, steps per second per worker count (the
trace's), steps done and expected, deadline, lease expiry, last resize.
"""

from __future__ import annotations

import heapq
import math
from dataclasses import dataclass, field

from bench.cluster_trace import JobSpec, Workload, bucket_of
from nodeagent_ray import policy as pol
from sharing.lifecycle import DeviceLifecycle, DeviceState

NodeKey = tuple[str, int]


@dataclass(frozen=True)
class Costs:
    """What the cluster's moves cost, from nodeagent's measurements (docs/cluster.md, bench/results)."""

    grow_s: float = 15.2  # Ray Train grow: loan node up to the new group's first step (11.8-18.6 s)
    shrink_s: float = 11.35  # Ray Train shrink: reclaim to the smaller group's first step (7.4-15.3 s)
    start_s: float = 15.2  # a job's group started from nothing (taken as a grow)
    loan_node_s: float = 4.25  # lend to the loan node up (2.8-5.7 s)
    reclaim_base_ms: float = 2.4  # a cooperative reclaim beyond the park itself (H100: 10.6 - 8.2 ms)
    park_gb_per_s: float = 39.0  # the park's device-to-host copy (H100: 323 MB in 8.2 ms)
    controller_ms: float = 5.0  # the controller's decision and its reclaim call (a lend took 1.7-5.2 ms)
    resume_ms: float = 6.0  # a parked worker resumed in-process (3.7-8.2 ms)
    protect_s: float = 60.0  # inference nodes' protect window (DeepBoot)

    def reclaim_ms(self, state_mb: float) -> float:
        return self.controller_ms + self.reclaim_base_ms + state_mb / 1000.0 / self.park_gb_per_s * 1000.0


@dataclass(frozen=True)
class Cluster:
    training_nodes: int = 8  # dedicated: no inference there
    inference_nodes: int = 8
    gpus_per_node: int = 4
    lending: bool = True  # False: the controller sees only the training nodes

    @property
    def inference_devices(self) -> int:
        return self.inference_nodes * self.gpus_per_node


@dataclass
class _Loan:
    job: str
    since: float
    up: bool = False
    parked: bool = False
    version: int = 0


@dataclass
class _Job:
    spec: JobSpec
    done: float = 0.0  # steps
    workers: int = 0  # training now on loan nodes that are up (parked ones not counted)
    resizing_until: float | None = None
    rate: float = 0.0
    last_t: float = 0.0
    version: int = 0
    first_up: float | None = None
    finished: float | None = None
    attained_gpu_s: float = 0.0
    held_gpu_s: float = 0.0
    productive_s: float = 0.0
    last_resize_at: float | None = None
    lease_expires: float | None = None
    resizes: int = 0
    preemptions: int = 0
    reclaimed_for_inference: int = 0
    parks: int = 0


@dataclass
class Result:
    """What one run measured; :meth:`summary` is its JSON."""

    policy: str
    lending: bool
    jobs: list[dict] = field(default_factory=list)
    inference_waits_ms: list[float] = field(default_factory=list)
    inference_unserved_s: float = 0.0
    harvested_gpu_s: float = 0.0
    lent_inference_gpu_s: float = 0.0
    inference_busy_gpu_s: float = 0.0
    span_s: float = 0.0
    decisions: dict[str, int] = field(default_factory=dict)
    decide_calls: int = 0
    decide_s: float = 0.0
    training_devices: int = 0
    inference_devices: int = 0

    def summary(self) -> dict:
        done = [j for j in self.jobs if j["jct_s"] is not None]
        jct = sorted(j["jct_s"] for j in done)
        queue = sorted(j["queue_s"] for j in self.jobs if j["queue_s"] is not None)
        slo = [j for j in self.jobs if j["deadline_s"] is not None]
        slo_met = [j for j in slo if j["finished_s"] is not None and j["finished_s"] <= j["deadline_s"]]
        best_effort = sorted(j["jct_s"] for j in done if j["deadline_s"] is None)
        buckets: dict[str, list[float]] = {}
        for j in done:
            buckets.setdefault(j["bucket"], []).append(j["jct_s"])
        waits = sorted(self.inference_waits_ms)
        span = self.span_s or 1.0
        return {
            "policy": self.policy, "lending": self.lending,
            "jobs": len(self.jobs), "finished": len(done),
            "jct_avg_s": _mean(jct), "jct_p50_s": _pct(jct, 50), "jct_p99_s": _pct(jct, 99),
            "queue_avg_s": _mean(queue), "queue_p99_s": _pct(queue, 99),
            "jct_by_bucket_avg_s": {b: _mean(sorted(v)) for b, v in sorted(buckets.items(), key=lambda kv: _ORDER[kv[0]])},
            "jobs_by_bucket": {b: len(v) for b, v in sorted(buckets.items(), key=lambda kv: _ORDER[kv[0]])},
            "best_effort_jct_avg_s": _mean(best_effort),
            "slo_jobs": len(slo), "deadlines_met": len(slo_met),
            "deadlines_met_share": round(len(slo_met) / len(slo), 4) if slo else None,
            "inference_placements": len(waits),
            "inference_reclaims": sum(1 for w in waits if w > 0),
            "inference_wait_p50_ms": _pct(waits, 50), "inference_wait_p99_ms": _pct(waits, 99),
            "inference_wait_max_ms": round(waits[-1], 3) if waits else None,
            "inference_unserved_s": round(self.inference_unserved_s, 3),
            "inference_utilisation": round(self.inference_busy_gpu_s / (self.inference_devices * span), 4)
            if self.inference_devices else None,
            "harvested_gpu_h": round(self.harvested_gpu_s / 3600.0, 2),
            "lent_inference_gpu_h": round(self.lent_inference_gpu_s / 3600.0, 2),
            "resizes": sum(j["resizes"] for j in self.jobs), "preemptions": sum(j["preemptions"] for j in self.jobs),
            "parks": sum(j["parks"] for j in self.jobs),
            "decisions": dict(sorted(self.decisions.items())), "decide_calls": self.decide_calls,
            "decide_ms_avg": round(self.decide_s / self.decide_calls * 1000.0, 3) if self.decide_calls else None,
            "span_h": round(self.span_s / 3600.0, 2),
        }


_ORDER = {"small": 0, "medium": 1, "large": 2, "xlarge": 3}


def _mean(values: list[float]) -> float | None:
    return round(sum(values) / len(values), 1) if values else None


def _pct(values: list[float], p: float) -> float | None:
    """Nearest-rank percentile of sorted ``values``."""
    if not values:
        return None
    k = max(0, min(len(values) - 1, math.ceil(p / 100.0 * len(values)) - 1))
    return round(values[k], 3)


class Simulation:
    """One policy on one workload. ``run()`` returns its :class:`Result`."""

    def __init__(self, workload: Workload, policy: pol.PolicyConfig, *, cluster: Cluster = Cluster(),
                 costs: Costs = Costs(), tick_s: float = 60.0, max_s: float = 30 * 86400.0,
                 clock=None) -> None:
        if workload.inference_devices != cluster.inference_devices:
            raise ValueError(f"the workload's demand is over {workload.inference_devices} inference devices, "
                             f"the cluster has {cluster.inference_devices}")
        self.workload, self.config, self.cluster, self.costs = workload, policy, cluster, costs
        self.tick_s, self.max_s = tick_s, max_s
        self._clock = clock
        self.now = 0.0
        self.devices: dict[NodeKey, DeviceLifecycle] = {}
        self.dedicated: dict[str, bool] = {}
        for i in range(cluster.training_nodes):
            self._add_node(f"train-{i:02d}", True, 0.0)
        for i in range(cluster.inference_nodes):
            self._add_node(f"infer-{i:02d}", False, costs.protect_s)
        self.serving: dict[NodeKey, float] = {}  # inference replicas: device -> since
        self.loans: dict[NodeKey, _Loan] = {}
        self.jobs: dict[str, _Job] = {}  # arrived, not finished
        self.finished: list[_Job] = []
        self.unserved: list[float] = []  # inference placements waiting for a device: since when
        self.result = Result(policy.name, cluster.lending, training_devices=cluster.training_nodes *
                             cluster.gpus_per_node, inference_devices=cluster.inference_devices)
        self._events: list = []
        self._seq = 0
        self._decide_pending = False
        self._next_tick = 0.0
        self._last_t = 0.0

    def _add_node(self, name: str, dedicated: bool, protect_s: float) -> None:
        self.dedicated[name] = dedicated
        for d in range(self.cluster.gpus_per_node):
            self.devices[(name, d)] = DeviceLifecycle(d, protect_s=protect_s)

    # ------------------------------------------------------------ events

    def _push(self, t: float, kind: str, *payload) -> None:
        self._seq += 1
        heapq.heappush(self._events, (t, self._seq, kind, payload))

    def run(self) -> Result:
        for spec in self.workload.jobs:
            self._push(spec.submit_s, "arrive", spec)
        for t, _ in self.workload.demand:
            self._push(t, "demand")
        self._push(0.0, "tick")
        pending_jobs = len(self.workload.jobs)
        while self._events:
            t = self._events[0][0]
            if t > self.max_s:
                break
            self._advance(t)
            while self._events and self._events[0][0] == t:
                _, _, kind, payload = heapq.heappop(self._events)
                getattr(self, f"_on_{kind}")(*payload)
            self._serve_inference()
            self._decide()
            if len(self.finished) == pending_jobs and not self.jobs:
                break
        self._advance(min(self.now, self.max_s))
        self.result.span_s = self.now
        self.result.jobs = [self._job_record(j) for j in self.finished + list(self.jobs.values())]
        self.result.jobs += [self._job_record(_Job(spec)) for spec in self.workload.jobs
                             if spec.name not in {j["name"] for j in self.result.jobs}]
        self.result.inference_unserved_s += sum(self.now - since for since in self.unserved)
        return self.result

    def _job_record(self, j: _Job) -> dict:
        s = j.spec
        return {"name": s.name, "application": s.application, "bucket": bucket_of(s.gpu_s), "submit_s": s.submit_s,
                "max_workers": s.max_workers, "deadline_s": s.deadline_s, "finished_s": j.finished,
                "jct_s": None if j.finished is None else j.finished - s.submit_s,
                "queue_s": None if j.first_up is None else j.first_up - s.submit_s,
                "attained_gpu_s": round(j.attained_gpu_s, 1), "resizes": j.resizes, "preemptions": j.preemptions,
                "parks": j.parks}

    def _advance(self, t: float) -> None:
        """Integrate progress and accounting from the last event to ``t`` (rates are constant between)."""
        dt = t - self._last_t
        if dt > 0:
            inference_held: dict[str, int] = {}
            held: dict[str, int] = {}
            for key, loan in self.loans.items():
                if loan.parked:
                    continue
                held[loan.job] = held.get(loan.job, 0) + 1
                if not self.dedicated[key[0]]:
                    self.result.lent_inference_gpu_s += dt
                    if loan.up:
                        inference_held[loan.job] = inference_held.get(loan.job, 0) + 1
            for j in self.jobs.values():
                j.attained_gpu_s += held.get(j.spec.name, 0) * dt
                if j.rate > 0:
                    j.done += j.rate * dt
                    j.productive_s += dt
                    self.result.harvested_gpu_s += inference_held.get(j.spec.name, 0) * dt
            self.result.inference_busy_gpu_s += len(self.serving) * dt
        self._last_t = self.now = t

    def _on_arrive(self, spec: JobSpec) -> None:
        self.jobs[spec.name] = _Job(spec, last_t=self.now)

    def _on_tick(self) -> None:
        self._push(self.now + self.tick_s, "tick")

    def _on_decide(self) -> None:
        self._decide_pending = False

    def _on_demand(self) -> None:
        pass  # _serve_inference reads the curve after every event

    def _on_lifecycle(self, key: NodeKey) -> None:
        self.devices[key].tick(self.now)

    def _on_lease(self, job: str) -> None:
        pass  # a decide follows every event: the policy sees the lease run out

    def _on_loan_up(self, key: NodeKey, version: int) -> None:
        loan = self.loans.get(key)
        if loan is None or loan.version != version or loan.up:
            return
        loan.up = True
        job = self.jobs.get(loan.job)
        if job is not None:
            self._set_workers(job, job.workers + 1, grow=True)

    def _on_resized(self, name: str, version: int) -> None:
        job = self.jobs.get(name)
        if job is None or job.version != version:
            return
        job.resizing_until = None
        self._set_rate(job)

    def _on_complete(self, name: str, version: int) -> None:
        job = self.jobs.get(name)
        if job is None or job.version != version:
            return
        job.done = float(job.spec.steps)
        job.finished = self.now
        job.rate = 0.0
        del self.jobs[name]
        self.finished.append(job)

    # ------------------------------------------------------------ a job's worker count

    def _set_workers(self, job: _Job, workers: int, *, grow: bool = False, in_process: bool = False) -> None:
        before, job.workers = job.workers, workers
        if workers == before:
            return
        if workers > 0 and job.first_up is None:
            job.first_up = self.now
        if workers == 0:
            job.resizing_until = None
        elif in_process and before == 0:  # a parked worker resumed: no new group
            job.resizing_until = self.now + self.costs.resume_ms / 1000.0
        else:
            cost = self.costs.start_s if before == 0 else self.costs.grow_s if grow else self.costs.shrink_s
            job.resizing_until = self.now + cost
            job.resizes += 1
        self._set_rate(job)

    def _set_rate(self, job: _Job) -> None:
        job.version += 1
        if job.workers > 0 and job.resizing_until is not None and job.resizing_until > self.now:
            job.rate = 0.0
            self._push(job.resizing_until, "resized", job.spec.name, job.version)
            return
        job.resizing_until = None
        job.rate = job.spec.steps_per_s[min(job.workers, job.spec.max_workers) - 1] if job.workers > 0 else 0.0
        if job.rate > 0:
            left = max(0.0, job.spec.steps - job.done)
            self._push(self.now + left / job.rate, "complete", job.spec.name, job.version)

    # ------------------------------------------------------------ inference

    def _idle_inference(self) -> list[NodeKey]:
        """Inference devices a replica may take at once: PROTECT first (its model is warm), then FREE."""
        idle = [k for k, life in self.devices.items() if not self.dedicated[k[0]] and k not in self.serving
                and life.state in (DeviceState.PROTECT, DeviceState.FREE)]
        return sorted(idle, key=lambda k: (self.devices[k].state is not DeviceState.PROTECT, k))

    def _place(self, key: NodeKey) -> None:
        self.serving[key] = self.now
        self._lifecycle(key, self.devices[key].observe(True, self.now))

    def _serve_inference(self) -> None:
        want = self.workload.demand_at(self.now)
        while len(self.serving) > want:  # the newest replicas go first
            key = max(self.serving, key=lambda k: (self.serving[k], k))
            del self.serving[key]
            self._lifecycle(key, self.devices[key].observe(False, self.now))
        self.unserved = self.unserved[:max(0, want - len(self.serving))]
        short = want - len(self.serving) - len(self.unserved)
        self.unserved += [self.now] * max(0, short)
        for key in self._idle_inference():
            if not self.unserved:
                break
            since = self.unserved.pop(0)
            self._place(key)
            self.result.inference_waits_ms.append((self.now - since) * 1000.0)
            self.result.inference_unserved_s += self.now - since if since < self.now else 0.0

    def _lifecycle(self, key: NodeKey, changes) -> None:
        deadline = self.devices[key].next_deadline()
        if deadline is not None:
            self._push(deadline, "lifecycle", key)

    # ------------------------------------------------------------ the controller

    def view(self) -> pol.ClusterView:
        nodes: dict[str, list[pol.DeviceView]] = {}
        for key, life in sorted(self.devices.items()):
            if not self.cluster.lending and not self.dedicated[key[0]]:
                continue
            life.tick(self.now)
            training = {}
            loan = self.loans.get(key)
            if loan is not None and loan.up:
                training[loan.job] = pol.SessionCount(0 if loan.parked else 1, 1 if loan.parked else 0)
            nodes.setdefault(key[0], []).append(pol.DeviceView(
                key[0], key[1], life.state.value, life.borrower, 1 if key in self.serving else 0, training))
        loans = {key: pol.LoanView(key[0], key[1], loan.job, loan.since) for key, loan in self.loans.items()
                 if self.cluster.lending or self.dedicated[key[0]]}
        jobs = {}
        for name, j in self.jobs.items():
            s = j.spec
            jobs[name] = pol.JobView(
                name, s.max_workers, submitted_at=s.submit_s, attained_gpu_s=j.attained_gpu_s,
                steps_per_s={n + 1: v for n, v in enumerate(s.steps_per_s)}, steps_done=int(j.done),
                expected_steps=s.steps, deadline=s.deadline_s, lease_expires=j.lease_expires,
                last_resize_at=j.last_resize_at)
        wanted = len(self.unserved) if self.cluster.lending else 0
        return pol.ClusterView({n: pol.NodeView(n, True, tuple(ds), dedicated=self.dedicated[n])
                                for n, ds in nodes.items()}, loans, jobs, inference_wanted=wanted)

    def _decide(self) -> None:
        started = self._clock() if self._clock else 0.0
        decisions = pol.decide(self.view(), self.now, self.config)
        if self._clock:
            self.result.decide_s += self._clock() - started
        self.result.decide_calls += 1
        for d in decisions:
            kind = type(d).__name__.lower() + (f":{d.reason}" if isinstance(d, pol.Reclaim) else "")
            self.result.decisions[kind] = self.result.decisions.get(kind, 0) + 1
            getattr(self, f"_do_{type(d).__name__.lower()}")(d)
        if decisions and not self._decide_pending:  # the controller's next turn reads what changed
            self._decide_pending = True
            self._push(self.now + 1.0, "decide")
        if decisions:
            self._serve_inference()

    def _touch(self, job: str) -> None:
        j = self.jobs.get(job)
        if j is not None:
            j.last_resize_at = self.now

    def _do_lend(self, d: pol.Lend) -> None:
        key = (d.node, d.device)
        self._lifecycle(key, self.devices[key].lend(d.job, self.now))
        loan = self.loans.get(key)
        if loan is None:
            loan = self.loans[key] = _Loan(d.job, self.now)
            loan.version += 1
            self._push(self.now + self.costs.loan_node_s, "loan_up", key, loan.version)
        self._touch(d.job)
        j = self.jobs.get(d.job)
        if j is not None and d.lease_s is not None and not (j.lease_expires and j.lease_expires > self.now):
            j.lease_expires = self.now + d.lease_s
            self._push(j.lease_expires, "lease", d.job)

    def _do_renew(self, d: pol.Renew) -> None:
        j = self.jobs.get(d.job)
        if j is not None and not (j.lease_expires and j.lease_expires > self.now):
            j.lease_expires = self.now + d.lease_s
            self._push(j.lease_expires, "lease", d.job)

    def _do_reclaim(self, d: pol.Reclaim) -> None:
        key = (d.node, d.device)
        loan = self.loans.get(key)
        job = self.jobs.get(d.job)
        self._lifecycle(key, self.devices[key].reclaim(self.now))
        if d.reason == "inference demand" and self.unserved:
            since = self.unserved.pop(0)
            ms = self.costs.reclaim_ms(job.spec.state_mb if job else 200.0)
            self.result.inference_waits_ms.append((self.now - since) * 1000.0 + ms)
            self._place(key)
        if loan is None:
            return
        was_up = loan.up and not loan.parked
        if job is not None and d.reason.startswith("inference"):
            job.reclaimed_for_inference += 1
        elif job is not None and d.reason != "job gone":
            job.preemptions += 1
        if d.then is pol.Then.PARK and was_up:
            loan.parked = True
            if job is not None:
                job.parks += 1
                self._touch(d.job)
                self._set_workers(job, job.workers - 1)
            return
        del self.loans[key]
        if job is not None:
            self._touch(d.job)
            if was_up:
                self._set_workers(job, job.workers - 1)

    def _do_release(self, d: pol.Release) -> None:
        loan = self.loans.pop((d.node, d.device), None)
        job = self.jobs.get(d.job)
        if loan is not None and job is not None and loan.up and not loan.parked:
            self._set_workers(job, job.workers - 1)
        self._touch(d.job)

    def _do_resume(self, d: pol.Resume) -> None:
        key = (d.node, d.device)
        self._lifecycle(key, self.devices[key].lend(d.job, self.now))
        loan = self.loans.get(key)
        job = self.jobs.get(d.job)
        if loan is not None and loan.parked:
            loan.parked = False
            if job is not None:
                self._touch(d.job)
                self._set_workers(job, job.workers + 1, grow=True, in_process=True)

    def _do_writeoff(self, d: pol.WriteOff) -> None:
        raise AssertionError("no node dies in this simulation")
