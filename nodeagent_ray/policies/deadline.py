"""Deadline-first admission with leases for SLO jobs (after Chronus, Gao et al., SoCC'21).

A job with a ``deadline`` and an ``expected_steps`` is an SLO job. Each round the SLO jobs
are taken earliest deadline first, those already holding a lease before new ones (an
admitted job is not displaced by a later one): each needs the fewest workers that finish
it ``margin`` ahead of its deadline, resize included, and is admitted while the dedicated
nodes (where inference never takes a device back) can hold what the admitted need; with no
dedicated node every device counts. An admitted job gets its devices under a lease of
``lease_s``: while the lease runs it keeps at least what it holds, and when it runs out
the lease is renewed for what it needs then. An SLO job that cannot be admitted, and
every job without a deadline, is best effort: the devices left go to them shortest
remaining time first, each up to its ``max_workers``, a job resized less than
``min_resize_interval_s`` ago keeping its count. Inference takes best-effort loans first.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from nodeagent_ray.policies.common import capacity, dedicated_capacity, realise, running
from nodeagent_ray.policies.signals import check_seconds, remaining_s, resized_within
from nodeagent_ray.policy import (ClusterView, Decision, JobView, LoanKey, LoanView, Renew, Round,
                                  inference_may_take, reclaim_cost)


@dataclass(frozen=True)
class Deadline:
    lease_s: float = 600.0  # an admitted SLO job's devices are its own this long, then renewed
    margin: float = 0.1  # plan to finish this fraction of the time left before the deadline
    resize_s: float = 15.0  # what a resize costs a job
    min_resize_interval_s: float = 60.0  # a best-effort job resized this recently keeps its count
    default_remaining_s: float = 3600.0  # a best-effort job that did not say its length

    name = "deadline"

    def __post_init__(self) -> None:
        check_seconds("deadline", lease_s=self.lease_s, margin=self.margin, resize_s=self.resize_s,
                      min_resize_interval_s=self.min_resize_interval_s, default_remaining_s=self.default_remaining_s)
        if self.lease_s <= 0 or self.margin >= 1:
            raise ValueError(f"deadline: lease_s must be > 0 and margin < 1, got {self.lease_s!r}, {self.margin!r}")

    @staticmethod
    def is_slo(job: JobView | None) -> bool:
        return job is not None and job.deadline is not None and job.expected_steps is not None

    @staticmethod
    def leased(job: JobView, now: float) -> bool:
        return job.lease_expires is not None and job.lease_expires > now

    def needed(self, job: JobView, now: float, now_workers: int, cap: int) -> int | None:
        """The fewest workers that finish the job ``margin`` before its deadline; None: none do."""
        budget = (job.deadline - now) * (1.0 - self.margin)
        for n in range(1, max(1, min(job.max_workers, cap)) + 1):
            resize = self.resize_s if n != now_workers else 0.0
            if remaining_s(job, n, self.default_remaining_s) + resize <= budget:
                return n
        return None

    def plan(self, r: Round) -> tuple[dict[str, int], list[str], list[str]]:
        """Targets, the admitted SLO jobs (earliest deadline first) and the best-effort order."""
        cap = capacity(r)
        guaranteed = dedicated_capacity(r) if any(n.dedicated for n in r.view.nodes.values()) else cap
        slo = [n for n in r.jobs if self.is_slo(r.jobs[n])]
        slo.sort(key=lambda n: (not self.leased(r.jobs[n], r.now), r.jobs[n].deadline, n))
        targets: dict[str, int] = {}
        admitted: list[str] = []
        for name in slo:
            job, now_workers = r.jobs[name], running(r, name)
            need = self.needed(job, r.now, now_workers, cap)
            if self.leased(job, r.now):
                need = max(need if need is not None else min(job.max_workers, cap), now_workers)
            if need is None or need > guaranteed:
                continue
            targets[name] = need
            admitted.append(name)
            guaranteed -= need
        admitted.sort(key=lambda n: (r.jobs[n].deadline, n))
        left = cap - sum(targets.values())
        rest = [n for n in r.jobs if n not in targets]
        frozen = {n for n in rest if running(r, n) > 0
                  and resized_within(r.jobs[n], r.now, self.min_resize_interval_s)}
        rest.sort(key=lambda n: (n not in frozen,
                                 remaining_s(r.jobs[n], r.jobs[n].max_workers, self.default_remaining_s),
                                 r.jobs[n].submitted_at or 0.0, n))
        for name in rest:
            give = min(running(r, name), left) if name in frozen else min(r.jobs[name].max_workers, left)
            if give >= 1:
                targets[name] = give
                left -= give
        best_effort = sorted((n for n in rest if n in targets),
                             key=lambda n: (remaining_s(r.jobs[n], r.jobs[n].max_workers, self.default_remaining_s),
                                            r.jobs[n].submitted_at or 0.0, n))
        return targets, admitted, best_effort

    def allocate(self, r: Round) -> list[Decision]:
        targets, admitted, best_effort = self.plan(r)
        slo = set(admitted)
        out = realise(r, targets, admitted + best_effort, take_reason="deadline", give_reason="deadline",
                      dedicated_first=lambda job: job in slo, lease_s={n: self.lease_s for n in admitted})
        for name in admitted:  # a lease that ran out (or was never taken) is renewed for what the job keeps
            if not self.leased(r.jobs[name], r.now):
                kept = sorted(r.active[name], key=lambda loan: loan.key)[:targets[name]]
                out += [Renew(loan.node, loan.device, name, self.lease_s) for loan in kept]
        return out

    def inference_victims(self, view: ClusterView, count: int, exclude: frozenset[LoanKey],
                          now: float) -> list[LoanView]:
        jobs = view.jobs or {}

        def rank(loan: LoanView):
            job = jobs.get(loan.job)
            deadline = job.deadline if self.is_slo(job) else -math.inf
            return (self.is_slo(job), -deadline, reclaim_cost(view, loan), loan.node, loan.device)
        loans = sorted((loan for loan in view.loans.values() if inference_may_take(view, loan, exclude)), key=rank)
        return loans[:count]
