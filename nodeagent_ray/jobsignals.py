"""What a training job's tracker learns from its own step reports, kept the way the policies
read it (:class:`~nodeagent_ray.policy.JobView`): steps per second at each worker count,
steps done, and when its worker count last changed; with what the job said when it was
created (its length in steps, its deadline). Pure: the caller passes the time in.

A rate is measured between two step reports of one worker group: the first report after a
group starts, or after the job was parked, is not paired with the one before it, so neither a
restart nor a park counts as slow training. Each worker count keeps an exponentially
smoothed rate (``smoothing`` the weight of a new sample).
"""

from __future__ import annotations

import math

__all__ = ["JobSignals"]


def _finite(value: object) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)


class JobSignals:
    def __init__(self, *, created_at: float, expected_steps: int | None = None, deadline: float | None = None,
                 smoothing: float = 0.2) -> None:
        if expected_steps is not None and not (isinstance(expected_steps, int) and expected_steps >= 1):
            raise ValueError(f"expected_steps must be an int >= 1 (or None), got {expected_steps!r}")
        if deadline is not None and not _finite(deadline):
            raise ValueError(f"deadline must be a unix time (or None), got {deadline!r}")
        if not (_finite(smoothing) and 0 < smoothing <= 1):
            raise ValueError(f"smoothing must be in (0, 1], got {smoothing!r}")
        self.created_at = float(created_at)
        self.expected_steps = expected_steps
        self.deadline = None if deadline is None else float(deadline)
        self.smoothing = float(smoothing)
        self.steps_done = 0
        self.world_size = 0
        self.last_resize_at: float | None = None
        self._rates: dict[int, float] = {}
        self._last: tuple[int, float] | None = None  # the last report of the current group: (step, time)

    @property
    def steps_per_s(self) -> dict[int, float]:
        return dict(sorted(self._rates.items()))

    def _resized(self, world_size: int, now: float) -> None:
        if world_size != self.world_size:
            self.world_size = world_size
            self.last_resize_at = now
        self._last = None

    def group_started(self, world_size: int, step: int, now: float) -> None:
        """A worker group of ``world_size`` began from ``step`` (the state it resumed from)."""
        self._resized(world_size, now)
        self.steps_done = step

    def step_done(self, step: int, world_size: int, now: float) -> None:
        if world_size != self.world_size:
            self._resized(world_size, now)
        if self._last is not None and step > self._last[0] and now > self._last[1]:
            rate = (step - self._last[0]) / (now - self._last[1])
            old = self._rates.get(world_size)
            self._rates[world_size] = rate if old is None else old + self.smoothing * (rate - old)
        if self._last is None or step > self._last[0]:
            self._last = (step, now)
        self.steps_done = max(self.steps_done, step)

    def paused(self) -> None:
        """The job stopped training for a while (parked, or waiting to be resized): the next
        report starts a new measurement."""
        self._last = None

    def stopped(self, now: float) -> None:
        """The job has no worker left (its last loan went)."""
        self._resized(0, now)

    def view_fields(self) -> dict:
        """The :class:`~nodeagent_ray.policy.JobView` fields this tracker knows (the daemon's
        attained service and the lease are the node's, not the job's)."""
        return {"submitted_at": self.created_at, "steps_per_s": self.steps_per_s, "steps_done": self.steps_done,
                "expected_steps": self.expected_steps, "deadline": self.deadline,
                "last_resize_at": self.last_resize_at}
