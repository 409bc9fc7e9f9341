"""What the policies read from a :class:`~nodeagent_ray.policy.JobView`: throughput at a
worker count, remaining work and time. Jobs that measured nothing are assumed to scale
linearly (Pollux's assumption before it has fitted a model)."""

from __future__ import annotations

import math

from nodeagent_ray.policy import JobView


def _number(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


def check_seconds(owner: str, **values: float) -> None:
    """ValueError unless each value is a finite number >= 0."""
    for name, value in values.items():
        if not (_number(value) and value >= 0):
            raise ValueError(f"{owner}: {name} must be a finite number >= 0, got {value!r}")


def rates(job: JobView, upto: int) -> list[float]:
    """Steps per second on 0..``upto`` workers (index = workers): measured, else interpolated
    between the counts the job measured, else scaled linearly from the nearest one (1 per
    worker when it measured none)."""
    known = sorted((n, float(v)) for n, v in job.steps_per_s.items()
                   if isinstance(n, int) and n >= 1 and _number(v) and v > 0)
    out = [0.0]
    if not known:
        return out + [float(n) for n in range(1, upto + 1)]
    k = 0
    for n in range(1, upto + 1):
        while k < len(known) and known[k][0] < n:
            k += 1
        if k < len(known) and known[k][0] == n:
            out.append(known[k][1])
        elif 0 < k < len(known):
            (n0, v0), (n1, v1) = known[k - 1], known[k]
            out.append(v0 + (v1 - v0) * (n - n0) / (n1 - n0))
        else:
            m, v = known[k - 1] if k else known[0]
            out.append(v * n / m)
    return out


def steps_per_s(job: JobView, workers: int) -> float:
    """The job's steps per second with ``workers`` workers (see :func:`rates`)."""
    return rates(job, workers)[workers] if workers > 0 else 0.0


def remaining_steps(job: JobView) -> float | None:
    if job.expected_steps is None:
        return None
    return float(max(0, job.expected_steps - job.steps_done))


def remaining_s(job: JobView, workers: int, default_s: float, curve: list[float] | None = None) -> float:
    """Seconds the job still needs with ``workers`` workers (inf with none). A job that did not
    say its length is taken to need ``default_s`` more on one worker. ``curve``: its :func:`rates`."""
    curve = curve if curve is not None and len(curve) > max(1, workers) else rates(job, max(1, workers))
    rate = curve[workers] if workers > 0 else 0.0
    if rate <= 0:
        return math.inf
    left = remaining_steps(job)
    if left is None:
        return default_s * curve[1] / rate
    return left / rate


def resized_within(job: JobView, now: float, interval_s: float) -> bool:
    """Its worker count changed less than ``interval_s`` ago."""
    return job.last_resize_at is not None and now - job.last_resize_at < interval_s
