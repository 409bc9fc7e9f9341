"""The placement policies of issue 25, side by side, each the rule 5 of
:func:`nodeagent_ray.policy.decide` (who gets free devices, which loans move between
training jobs, which loans inference takes first); rules 1-4 are the same for all.

========== ===========================================================================
name        what it does
========== ===========================================================================
max-workers today's rule: each free device to the job furthest below ``max_workers``
fifo        gang, first come first served: a job gets all of ``max_workers`` or waits;
            nothing is taken back for another job (YARN-CS, the papers' baseline)
tiresias    gang, 2D attained service (GPUs x time): discretised priority queues, FIFO
            inside a queue, preemption by priority, promotion of starving jobs
knapsack    elastic (DeepBoot, Aryl): every job is admitted with one worker first, then
            the devices are spread by a multiple-choice knapsack over each job's
            throughput at each worker count (value: 1 / its remaining time there,
            resize cost included); a job is resized at most once per
            ``min_resize_interval_s``; inference takes the loans whose loss costs least
deadline    Chronus-like: SLO jobs (a deadline) are admitted earliest deadline first
            while the dedicated nodes can guarantee the fewest workers that meet the
            deadline, and hold them under a lease; best-effort jobs get the rest,
            shortest remaining time first
========== ===========================================================================

Every policy is a frozen dataclass whose fields are its settings; :func:`make_policy`
builds one from ``PolicyConfig.name`` and ``PolicyConfig.options``. Pure: no I/O, no clock.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any

from nodeagent_ray.policies.deadline import Deadline
from nodeagent_ray.policies.gang import Fifo, Tiresias
from nodeagent_ray.policies.knapsack import Knapsack
from nodeagent_ray.policy import Allocator, MaxWorkers

__all__ = ["POLICIES", "Deadline", "Fifo", "Knapsack", "MaxWorkers", "Tiresias", "make_policy"]

POLICIES: dict[str, type] = {cls.name: cls for cls in (MaxWorkers, Fifo, Tiresias, Knapsack, Deadline)}


def make_policy(name: str, options: Mapping[str, Any] | None = None) -> Allocator:
    """The policy ``name`` with ``options`` (its dataclass fields); ValueError naming what is wrong."""
    cls = POLICIES.get(name)
    if cls is None:
        raise ValueError(f"unknown policy {name!r}; one of {', '.join(POLICIES)}")
    options = dict(options or {})
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(options) - known)
    if unknown:
        raise ValueError(f"policy {name!r} has no setting {', '.join(map(repr, unknown))}; "
                         f"its settings: {', '.join(sorted(known)) or 'none'}")
    return cls(**options)
