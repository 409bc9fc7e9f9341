"""Gang policies: a job runs on all of its ``max_workers`` or waits (the papers' model of a
training job that is not elastic). ``fifo`` is the baseline they compare against (YARN-CS:
first come first served, nothing taken back); ``tiresias`` is Tiresias' 2D attained service.

Tiresias (Gu et al., NSDI'19) orders jobs by the GPU time they attained (GPUs x seconds),
discretised into queues so that jobs of one queue run first come first served: a new job
starts in the first queue and sinks as it attains service, so short jobs finish first
without anyone saying how long a job is. A job of a higher queue preempts jobs of lower
ones; a job that waited ``starve_factor`` times as long as it has run is promoted to the
first queue. Here the queue is computed from ``JobView.attained_gpu_s`` each round (the
daemon's journalled service), so the policy keeps nothing of its own: the promotion lasts
while the job waits, and a job started or resized less than ``min_run_s`` ago is not
preempted, which is what keeps a promoted job running once it starts.
"""

from __future__ import annotations

import bisect
import math
from dataclasses import dataclass

from nodeagent_ray.policies.common import capacity, realise, running
from nodeagent_ray.policies.signals import check_seconds, resized_within
from nodeagent_ray.policy import (ClusterView, Decision, JobView, LoanKey, LoanView, Round, inference_may_take,
                                  reclaim_cost)


def _arrival(job: JobView | None) -> float:
    return job.submitted_at if job is not None and job.submitted_at is not None else 0.0


def _gang_targets(r: Round, order: list[str], keeps: set[str]) -> dict[str, int]:
    """Walk ``order``: a job whose whole gang fits in what is left runs; one that does not waits
    (those behind it may still fit). Jobs in ``keeps`` go first and keep at least what they hold.
    Devices no gang can use are left to running jobs that are short (in ``order``), not emptied."""
    left = capacity(r)
    everything = sum(len(node.devices) for node in r.view.nodes.values() if node.alive)
    targets: dict[str, int] = {}
    for name in [n for n in order if n in keeps] + [n for n in order if n not in keeps]:
        gang = min(r.jobs[name].max_workers, everything)  # a gang larger than the cluster runs on all of it
        if gang <= left:
            targets[name] = gang
        elif name in keeps:
            targets[name] = min(running(r, name), left)
        else:
            continue
        left -= targets[name]
    for name in order:  # a running gang short of devices (inference took some) keeps what is left over
        if name not in targets and running(r, name) > 0 and left > 0:
            targets[name] = min(running(r, name), left)
            left -= targets[name]
    return targets


@dataclass(frozen=True)
class Fifo:
    """First come first served, gang, no preemption for another job; a job that does not fit
    waits while later ones that fit run (backfill)."""

    name = "fifo"

    def inference_victims(self, view: ClusterView, count: int, exclude: frozenset[LoanKey],
                          now: float) -> list[LoanView]:
        jobs = view.jobs or {}
        loans = [loan for loan in view.loans.values() if inference_may_take(view, loan, exclude)]
        loans.sort(key=lambda loan: (-_arrival(jobs.get(loan.job)), reclaim_cost(view, loan), loan.node, loan.device))
        return loans[:count]

    def allocate(self, r: Round) -> list[Decision]:
        order = sorted(r.jobs, key=lambda name: (_arrival(r.jobs[name]), name))
        keeps = {name for name in order if running(r, name) > 0}
        targets = _gang_targets(r, order, keeps)
        return realise(r, targets, order, take_reason="fifo", give_reason="fifo")


@dataclass(frozen=True)
class Tiresias:
    queue_limits_gpu_s: tuple[float, ...] = (3600.0, 36000.0)  # attained service where each queue ends
    starve_factor: float = 3.0  # promote a job that waited this many times its run time (0: never)
    min_run_s: float = 120.0  # a job started or resized this recently is not preempted

    name = "tiresias"

    def __post_init__(self) -> None:
        limits = tuple(self.queue_limits_gpu_s)
        check_seconds("tiresias", starve_factor=self.starve_factor, min_run_s=self.min_run_s,
                      **{f"queue_limits_gpu_s[{i}]": v for i, v in enumerate(limits)})
        if list(limits) != sorted(limits):
            raise ValueError(f"tiresias: queue_limits_gpu_s must be increasing, got {limits!r}")
        object.__setattr__(self, "queue_limits_gpu_s", limits)

    def starving(self, job: JobView, now: float, running_now: int) -> bool:
        """Waiting (no device) for ``starve_factor`` times as long as it has run."""
        if self.starve_factor <= 0 or running_now > 0 or job.attained_gpu_s <= 0 or job.last_resize_at is None:
            return False
        ran_s = job.attained_gpu_s / max(1, job.max_workers)
        return now - job.last_resize_at >= self.starve_factor * ran_s

    def queue(self, job: JobView, now: float, running_now: int) -> int:
        if self.starving(job, now, running_now):
            return 0
        return bisect.bisect_right(self.queue_limits_gpu_s, job.attained_gpu_s)

    def inference_victims(self, view: ClusterView, count: int, exclude: frozenset[LoanKey],
                          now: float) -> list[LoanView]:
        """The lowest priority first: the last queue, the latest arrival in it."""
        jobs = view.jobs or {}

        def rank(loan: LoanView):
            job = jobs.get(loan.job)
            queue = math.inf if job is None else self.queue(job, now, 1)
            return (-queue, -_arrival(job), reclaim_cost(view, loan), loan.node, loan.device)
        loans = sorted((loan for loan in view.loans.values() if inference_may_take(view, loan, exclude)), key=rank)
        return loans[:count]

    def allocate(self, r: Round) -> list[Decision]:
        order = sorted(r.jobs, key=lambda name: (self.queue(r.jobs[name], r.now, running(r, name)),
                                                 _arrival(r.jobs[name]), name))
        keeps = {name for name in order
                 if running(r, name) > 0 and resized_within(r.jobs[name], r.now, self.min_run_s)}
        targets = _gang_targets(r, order, keeps)
        return realise(r, targets, order, take_reason="tiresias: a higher queue", give_reason="tiresias")
