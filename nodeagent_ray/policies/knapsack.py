"""Elastic lending by knapsack (DeepBoot, Aryl; Pollux's speedup model): every job keeps or gets
one worker, then the devices are spread by a multiple-choice knapsack over each job's
throughput at each worker count. The objective: docs/internals.md.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

from nodeagent_ray.policies.common import capacity, realise, running
from nodeagent_ray.policies.signals import check_seconds, rates, remaining_s, resized_within
from nodeagent_ray.policy import (ClusterView, Decision, JobView, LoanKey, LoanStatus, LoanView, Round,
                                  inference_may_take, loan_status)


def multiple_choice_knapsack(items: Sequence[Sequence[tuple[int, float]]], capacity: int) -> list[int] | None:
    """Pick one (weight, value) option of every item, total weight at most ``capacity``, the
    largest total value. Returns the index picked per item, or None when no choice fits.
    Ties go to the earlier option, so listing an item's cheaper options first keeps it small."""
    neg = -math.inf
    best = [0.0] + [neg] * capacity  # best[w]: the most value with total weight exactly w
    picks: list[list[int]] = []
    for options in items:
        nxt = [neg] * (capacity + 1)
        pick = [-1] * (capacity + 1)
        for w, have in enumerate(best):
            if have == neg:
                continue
            for i, (weight, value) in enumerate(options):
                total = w + weight
                if total <= capacity and have + value > nxt[total]:
                    nxt[total] = have + value
                    pick[total] = i
        best = nxt
        picks.append(pick)
    top = max(range(capacity + 1), key=lambda w: (best[w], -w))
    if best[top] == neg:
        return None
    chosen = [0] * len(items)
    w = top
    for k in range(len(items) - 1, -1, -1):
        i = picks[k][w]
        chosen[k] = i
        w -= items[k][i][0]
    return chosen


@dataclass(frozen=True)
class Knapsack:
    min_resize_interval_s: float = 60.0  # a job resized this recently keeps its worker count
    resize_s: float = 15.0  # what a resize costs a job (its whole group restarts)
    default_remaining_s: float = 3600.0  # a job that did not say its length: this much more on one worker

    name = "knapsack"

    def __post_init__(self) -> None:
        check_seconds("knapsack", min_resize_interval_s=self.min_resize_interval_s, resize_s=self.resize_s,
                      default_remaining_s=self.default_remaining_s)

    def completion_s(self, job: JobView, workers: int, now_workers: int, curve: list[float] | None = None) -> float:
        """T(n): the seconds until the job would finish on ``workers``, a resize included."""
        resize = self.resize_s if workers != now_workers else 0.0
        return remaining_s(job, workers, self.default_remaining_s, curve) + resize

    def options(self, job: JobView, now_workers: int, frozen: bool, cap: int) -> list[tuple[int, float]]:
        """(workers, 1 / T(workers)), fewest workers first."""
        counts = [now_workers] if frozen else list(range(1, max(1, min(job.max_workers, cap)) + 1))
        curve = rates(job, max(counts))
        return [(n, 1.0 / self.completion_s(job, n, now_workers, curve)) for n in counts]

    def targets(self, r: Round) -> tuple[dict[str, int], list[str]]:
        """Each job's worker count, and the order its devices are given in (admission order)."""
        cap = capacity(r)
        fifo = sorted(r.jobs, key=lambda n: (r.jobs[n].submitted_at or 0.0, n))
        frozen = {n for n in fifo if running(r, n) > 0
                  and resized_within(r.jobs[n], r.now, self.min_resize_interval_s)}
        base = {n: (running(r, n) if n in frozen else 1) for n in fifo if running(r, n) > 0}
        left = cap - sum(base.values())
        for n in fifo:  # admission: waiting jobs get one worker each, first come first served
            if n not in base and left >= 1:
                base[n] = 1
                left -= 1
        admitted = [n for n in fifo if n in base]
        items = [self.options(r.jobs[n], running(r, n), n in frozen, cap) for n in admitted]
        chosen = multiple_choice_knapsack(items, cap)
        if chosen is None:  # cannot happen while base fits; keep the admission alone
            return dict(base), admitted
        return {n: items[k][chosen[k]][0] for k, n in enumerate(admitted)}, admitted

    def allocate(self, r: Round) -> list[Decision]:
        targets, order = self.targets(r)
        return realise(r, targets, order, take_reason="knapsack", give_reason="knapsack")

    def inference_victims(self, view: ClusterView, count: int, exclude: frozenset[LoanKey],
                          now: float) -> list[LoanView]:
        """Greedy by marginal loss: each pick is the loan whose job's completion time grows least
        by losing one more worker; a job's last worker goes last."""
        jobs = view.jobs or {}
        workers: dict[str, int] = {}
        for loan in view.loans.values():
            if loan_status(view, loan) is LoanStatus.ACTIVE and loan.key not in exclude:
                workers[loan.job] = workers.get(loan.job, 0) + 1
        pool = sorted((loan for loan in view.loans.values() if inference_may_take(view, loan, exclude)),
                      key=lambda loan: loan.key)
        chosen: list[LoanView] = []
        while pool and len(chosen) < count:
            def loss(loan: LoanView):
                n = workers.get(loan.job, 1)
                job = jobs.get(loan.job)
                if job is None:
                    return (False, 0.0)
                if n <= 1:
                    return (True, remaining_s(job, 1, self.default_remaining_s))
                grows = self.completion_s(job, n - 1, n) - self.completion_s(job, n, n)
                return (False, grows)
            pick = min(pool, key=lambda loan: (loss(loan), loan.key))
            pool.remove(pick)
            chosen.append(pick)
            workers[pick.job] = workers.get(pick.job, 1) - 1
        return chosen
