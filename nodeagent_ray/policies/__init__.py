"""The placement policies side by side (``max-workers``, ``fifo``, ``tiresias``,
``knapsack``, ``deadline``), each the rule 5 of :func:`nodeagent_ray.policy.decide`; built by
:func:`make_policy` from ``PolicyConfig.name`` and ``PolicyConfig.options``. Pure. What each does:
docs/internals.md.
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
