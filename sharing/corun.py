"""Co-run sharing: each class has its own token, and a lower class is paced, not stopped.

Measured on an H100 (issue 20): exclusive slices at training-iteration
granularity made an inference service 17-886x worse at p99 than running with
no daemon, while MPS with the trainer at client priority 1 gave 1.25x. A GPU
already runs several processes at once; the daemon's job is to steer that.

So under co-run a device has one *lane* per workload class, each a
:class:`~sharing.scheduler.TokenScheduler` holding only that class's sessions:
inside a lane nothing changes (weighted fair share, quanta, grace, enforcement,
one-hop successors), and between lanes there is no preemption. An inference
request beside a training holder is granted at once and both run. What a
higher class does to a lower one is *pace* it: while a higher lane has a
holder, every lower class is told (through the device's pace board, see
:mod:`client_lib.pace`) to issue GPU work only for ``duty_permille`` of each
period, from 0 (pause at its next pause point) to 1000 (run, slowed only by
MPS client priority). :class:`PaceController` picks the duty from the higher
class's measured slices.

Pure logic like the rest of :mod:`sharing`: no I/O, time passed in.

Grant ids: lane ``k`` issues ``first_grant + k``, ``first_grant + k + 3``, ...,
so a grant id names one session of one lane on the device, and a session's ids
only grow (clients rely on it).
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass

from sharing.scheduler import (Action, SchedulerError, SchedulerPolicy, SchedulerSnapshot, SessionState,
                               TokenScheduler, UnknownSessionError, Workload)

__all__ = ["CoRunScheduler", "PaceController", "PaceSlot", "DUTY_STEPS_PERMILLE"]

_LANES = len(Workload)


@dataclass(frozen=True, slots=True)
class PaceSlot:
    """What one class of a device is told: ``present``: sessions of higher classes on the
    device; ``active``: a higher class holds its token now; ``duty_permille``: the share of
    each ``period_us`` the class may issue GPU work while ``active``."""

    present: int
    active: bool
    duty_permille: int
    period_us: int


class CoRunScheduler:
    """A device's lanes, one :class:`TokenScheduler` per class, behind the
    TokenScheduler interface the daemon speaks (see the module docstring)."""

    __slots__ = ("_device", "_policy", "_lanes", "_lane_of")

    def __init__(self, device: int, policy: SchedulerPolicy | None = None, *, first_grant: int = 1) -> None:
        self._device = device
        self._policy = SchedulerPolicy() if policy is None else policy
        self._lanes = tuple(TokenScheduler(device, self._policy, first_grant=first_grant + w, grant_step=_LANES)
                            for w in range(_LANES))
        self._lane_of: dict[str, TokenScheduler] = {}

    # ---------------------------------------------------------------- shape

    @property
    def device(self) -> int:
        return self._device

    @property
    def policy(self) -> SchedulerPolicy:
        return self._policy

    @property
    def corun(self) -> bool:
        return True

    def lanes(self) -> tuple[TokenScheduler, ...]:
        """The per-class schedulers, highest class first (one-hop hints are given per lane)."""
        return self._lanes

    def lane_of(self, session: str) -> TokenScheduler:
        """The lane ``session`` is on; UnknownSessionError if it is on none."""
        try:
            return self._lane_of[session]
        except KeyError:
            raise UnknownSessionError(f"no session {session!r} on device {self._device}") from None

    def __len__(self) -> int:
        return len(self._lane_of)

    def __contains__(self, session: object) -> bool:
        return session in self._lane_of

    def __repr__(self) -> str:
        return f"CoRunScheduler(device={self._device}, sessions={len(self)}, holders={self.holders()!r})"

    # --------------------------------------------------------------- events

    def add_session(self, session: str, workload: Workload, weight: float, now: float) -> None:
        if not isinstance(workload, Workload):
            raise TypeError(f"workload must be a Workload, got {workload!r}; use Workload.parse()")
        if session in self._lane_of:
            # The lane would say the same; said here so that no lane is touched.
            from sharing.scheduler import DuplicateSessionError
            raise DuplicateSessionError(f"session {session!r} is already on device {self._device}")
        lane = self._lanes[workload]
        lane.add_session(session, workload, weight, now)
        self._lane_of[session] = lane

    def remove_session(self, session: str, now: float) -> list[Action]:
        lane = self.lane_of(session)
        actions = lane.remove_session(session, now)
        del self._lane_of[session]
        return actions

    def request(self, session: str, now: float, waiting_since: float | None = None) -> list[Action]:
        return self.lane_of(session).request(session, now, waiting_since)

    def cancel(self, session: str, now: float) -> list[Action]:
        return self.lane_of(session).cancel(session, now)

    def release(self, session: str, grant: int, now: float, requeue: bool = False) -> list[Action]:
        return self.lane_of(session).release(session, grant, now, requeue)

    def revoke(self, session: str, now: float, reason: str) -> list[Action]:
        return self.lane_of(session).revoke(session, now, reason)

    def extend_yield(self, session: str, now: float, extra_s: float) -> bool:
        return self.lane_of(session).extend_yield(session, now, extra_s)

    def preempt(self, session: str, now: float) -> list[Action]:
        return self.lane_of(session).preempt(session, now)

    def set_weight(self, session: str, weight: float, now: float) -> None:
        self.lane_of(session).set_weight(session, weight, now)

    def set_policy(self, policy: SchedulerPolicy, now: float) -> list[Action]:
        # Check every lane's clock first, so that a refusal changes nothing.
        for lane in self._lanes:
            lane._check_now(now)
        self._policy = policy
        actions: list[Action] = []
        for lane in self._lanes:
            actions += lane.set_policy(policy, now)
        return actions

    def tick(self, now: float) -> list[Action]:
        actions: list[Action] = []
        for lane in self._lanes:
            actions += lane.tick(now)
        return actions

    # --------------------------------------------------------------- queries

    def next_deadline(self) -> float | None:
        deadlines = [d for d in (lane.next_deadline() for lane in self._lanes) if d is not None]
        return min(deadlines) if deadlines else None

    def holder(self) -> str | None:
        """The highest class's holder (the one the others are paced for); None if no lane has one."""
        for lane in self._lanes:
            holder = lane.holder()
            if holder is not None:
                return holder
        return None

    def holders(self) -> tuple[str, ...]:
        """Every lane's holder, highest class first."""
        return tuple(h for h in (lane.holder() for lane in self._lanes) if h is not None)

    def wanted_by(self, workload: Workload) -> bool:
        return self._lanes[workload].wanted_by(workload)

    def waiting_count(self) -> int:
        return sum(lane.waiting_count() for lane in self._lanes)

    def state(self, session: str) -> SessionState:
        return self.lane_of(session).state(session)

    def first_in_line(self) -> str | None:
        for lane in self._lanes:
            first = lane.first_in_line()
            if first is not None:
                return first
        return None

    def snapshot(self, now: float) -> SchedulerSnapshot:
        snaps = [lane.snapshot(now) for lane in self._lanes]
        top = next((snap for snap in snaps if snap.holder is not None), None)
        return SchedulerSnapshot(
            self._device, top.holder if top is not None else None, top.grant if top is not None else None,
            tuple(sid for snap in snaps for sid in snap.queue), tuple(v for snap in snaps for v in snap.sessions))

    def pace(self) -> tuple[tuple[int, bool], ...]:
        """Per class, in class order: (sessions of higher classes on the device, whether one of
        them holds its lane's token now). O(classes)."""
        out = []
        present, active = 0, False
        for lane in self._lanes:
            out.append((present, active))
            present += len(lane)
            active = active or lane.holder() is not None
        return tuple(out)

    # One-hop successors are a lane's business: the daemon asks the lane (see lanes()).
    def successor(self) -> str | None:
        raise SchedulerError("a co-run device has a successor per lane; ask lane_of(session)")

    bind_successor = withdraw_successor = settle_successor = bound_successor = successor  # type: ignore[assignment]
    promised_grant = promise_withdrawing = successor  # type: ignore[assignment]


#: The duties the controller moves between by default, in permille of each period a lower class may
#: issue work while a higher class holds: 0 is a pause, 1000 leaves the pacing to MPS client priority.
#: Two: on an H100 the duties between (a trainer running part of each period) kept the worst of both,
#: the higher class's slices slowed while the lower class ran and the lower class's time lost while it
#: paused (bench/results/h100-80gb-hbm3-2026-11-27). Finer steps can be given to the controller.
DUTY_STEPS_PERMILLE = (0, 1000)


class PaceController:
    """Picks how hard lower classes are paced on one device, from the higher class's slices.

    The feedback is the length of each higher-class slice (grant to release: an
    inference request's time on the device), tagged with the duty that held while
    it ran. The reference is a declared SLO (``slo_ms``), else what the slices
    take with lower classes paused (duty 0) or absent, the closest to "alone" the
    daemon can observe. Every ``window`` slices the controller compares the
    window's median with the reference: within ``tolerance`` it relaxes one
    step (more for the lower class), beyond it tightens one step, beyond twice
    the tolerance it pauses outright. With the default steps (0 and 1000) that
    is: pause the lower class while the higher one holds, unless running beside
    it costs the higher class's slices less than the tolerance. A step up is a
    try: a quarter window far beyond the tolerance ends it early, and after a
    failed try the controller holds that many windows before the next (1, 2,
    4, ... up to 64), so where running beside costs too much it pauses nearly
    always (the first H100 run's controller, without this, alternated window by
    window and kept the worst of both). Every ``probe_every`` slices spent above
    duty 0 it spends one window at duty 0 to measure the reference again (the
    service or the trainer may have changed). TGS (NSDI'23) adapts an
    opportunistic job's rate to the productive job's measured throughput the
    same way; this one steers by latency.

    ``fixed_duty_permille`` pins the duty (benchmarks, operators who want
    "pause" or "priority only"); observations are then only counted.
    """

    def __init__(self, *, tolerance: float = 0.05, window: int = 16, probe_every: int = 256,
                 fixed_duty_permille: int | None = None, period_us: int = 10_000,
                 reference_window: int = 64, steps: tuple[int, ...] = DUTY_STEPS_PERMILLE) -> None:
        if not 0 < tolerance < 10:
            raise ValueError(f"tolerance must be in (0, 10), got {tolerance!r}")
        if window < 1 or probe_every < window or reference_window < 1:
            raise ValueError("window >= 1, probe_every >= window and reference_window >= 1 are needed")
        if fixed_duty_permille is not None and not 0 <= fixed_duty_permille <= 1000:
            raise ValueError(f"fixed_duty_permille must be in 0..1000, got {fixed_duty_permille!r}")
        if not 1000 <= period_us <= 1_000_000:
            raise ValueError(f"period_us must be in 1000..1000000, got {period_us!r}")
        if not steps or steps[0] != 0 or list(steps) != sorted(set(steps)) or steps[-1] > 1000:
            raise ValueError(f"steps must rise from 0 to at most 1000, got {steps!r}")
        self.steps = tuple(int(step) for step in steps)
        self.tolerance = float(tolerance)
        self.window = int(window)
        self.probe_every = int(probe_every)
        self.period_us = int(period_us)
        self.fixed = fixed_duty_permille
        self.slo_s: float | None = None
        self._step = 0  # index into DUTY_STEPS_PERMILLE; starts paused: the safe side for the higher class
        self._reference: deque[float] = deque(maxlen=reference_window)
        self._current: list[float] = []
        self._since_probe = 0
        self._probing = False
        self._resume_step = 0  # where a probe returns to
        # Trying a step up: a window decides; a quarter of one that is far off ends the try early.
        self._trial = False
        self._early = max(4, self.window // 4)
        self._backoff = 1  # windows to hold after the next failed try (doubles per failure)
        self._hold = 0  # windows left before the next try
        self.max_backoff = 64
        self.changes = 0  # duty changes made, for metrics

    @property
    def duty_permille(self) -> int:
        return self.fixed if self.fixed is not None else self.steps[self._step]

    def reference_s(self) -> float | None:
        """The slice length the controller holds the higher class to: the SLO if declared,
        else the median of slices measured with lower classes paused or absent."""
        if self.slo_s is not None:
            return self.slo_s
        if len(self._reference) < max(4, self.window // 2):
            return None
        return _median(self._reference)

    def set_slo(self, slo_s: float | None) -> None:
        self.slo_s = slo_s if slo_s is not None and math.isfinite(slo_s) and slo_s > 0 else None

    def observe(self, held_s: float, duty_permille: int, lower_active: bool) -> bool:
        """A higher-class slice of ``held_s`` ended; it ran under ``duty_permille``, with a
        lower class holding (``lower_active``) or not. True if the duty changed."""
        if not (math.isfinite(held_s) and held_s >= 0):
            return False
        if not lower_active or duty_permille == 0:
            self._reference.append(held_s)  # as good as alone (a pause still costs the drain)
        if self.fixed is not None or not lower_active:
            return False
        if duty_permille != self.duty_permille:
            return False  # ran under an older duty: says nothing about this one
        self._current.append(held_s)
        ref = self.reference_s()
        early = self._trial and len(self._current) >= self._early and ref is not None and \
            _median(self._current) > ref * (1.0 + 2.0 * self.tolerance)
        if len(self._current) < self.window and not early:
            return False
        window, self._current = self._current, []
        before = self._step
        if self._probing:
            self._probing = False
            self._step = self._resume_step
        elif ref is not None:
            measured = _median(window)
            if measured <= ref * (1.0 + self.tolerance):
                if self._trial:  # the step up held: the next try may come soon
                    self._trial, self._backoff = False, 1
                if self._hold > 0:
                    self._hold -= 1  # a failed try is not repeated at once
                elif self._step + 1 < len(self.steps):
                    self._step += 1
                    self._trial = True
            else:
                self._step = 0 if measured > ref * (1.0 + 2.0 * self.tolerance) else max(self._step - 1, 0)
                # A failed try waits twice as long as the last before the next; a step that held
                # and then stopped holding (the load changed) may be tried again after one window.
                self._backoff = min(self._backoff * 2, self.max_backoff) if self._trial else 1
                self._hold = self._backoff
                self._trial = False
        if self._step > 0 and not self._probing:
            self._since_probe += len(window)
            if self.slo_s is None and self._since_probe >= self.probe_every:
                self._since_probe = 0
                self._probing = True
                self._resume_step = self._step
                self._step = 0
        if self._step != before:
            self.changes += 1
            return True
        return False


def _median(values) -> float:
    ordered = sorted(values)
    n = len(ordered)
    mid = n // 2
    return ordered[mid] if n % 2 else 0.5 * (ordered[mid - 1] + ordered[mid])
