"""Co-run sharing, pure: each workload class has its own token (a lane, one
:class:`~sharing.scheduler.TokenScheduler` each), and a lower class is paced, not stopped
(:class:`CoRunScheduler`, :class:`PaceController`). Why, and how grant ids are spread over lanes:
docs/internals.md.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass
from statistics import median as _median

from sharing.scheduler import (Action, DuplicateSessionError, SchedulerPolicy, SchedulerSnapshot, SessionState,
                               TokenScheduler, UnknownSessionError, Workload)

__all__ = ["CoRunScheduler", "PaceController", "PaceSlot", "PaceWant", "board_slot", "DUTY_STEPS_PERMILLE"]

_LANES = len(Workload)


@dataclass(frozen=True, slots=True)
class PaceSlot:
    """What one class of a device is told: ``present``: sessions of higher classes on the
    device; ``active``: a higher class holds its token now; ``duty_permille``: the share of
    each ``period_us`` the class may issue GPU work while ``active``; ``armed``: a pause may come
    (see :func:`board_slot`)."""

    present: int
    active: bool
    duty_permille: int
    period_us: int
    armed: bool = False  # a pause may come: bound the run-ahead (see PaceController)


class CoRunScheduler:
    """A device's lanes, one :class:`TokenScheduler` per class, behind the
    TokenScheduler interface the daemon speaks (see docs/internals.md)."""

    __slots__ = ("_device", "_lanes")

    def __init__(self, device: int, policy: SchedulerPolicy | None = None, *, first_grant: int = 1,
                 grant_stride: int = 1) -> None:
        if isinstance(grant_stride, bool) or not isinstance(grant_stride, int) or grant_stride < 1:
            raise ValueError(f"grant_stride must be an int >= 1, got {grant_stride!r}")
        self._device = device
        step = _LANES * grant_stride
        self._lanes = tuple(TokenScheduler(device, policy, first_grant=first_grant + w, grant_step=step)
                            for w in range(_LANES))

    # ---------------------------------------------------------------- shape

    @property
    def device(self) -> int:
        return self._device

    @property
    def policy(self) -> SchedulerPolicy:
        return self._lanes[0].policy  # every lane's

    corun = True  # the shape TokenScheduler has too (False there)

    def lane_of(self, session: str) -> TokenScheduler:
        """The lane ``session`` is on; UnknownSessionError if it is on none."""
        for lane in self._lanes:
            if session in lane:
                return lane
        raise UnknownSessionError(f"no session {session!r} on device {self._device}")

    def __len__(self) -> int:
        return sum(len(lane) for lane in self._lanes)

    def __contains__(self, session: object) -> bool:
        return any(session in lane for lane in self._lanes)

    def __repr__(self) -> str:
        return f"CoRunScheduler(device={self._device}, sessions={len(self)}, holders={self.holders()!r})"

    # --------------------------------------------------------------- events

    def add_session(self, session: str, workload: Workload, weight: float, now: float) -> None:
        if not isinstance(workload, Workload):
            raise TypeError(f"workload must be a Workload, got {workload!r}; use Workload.parse()")
        if session in self:  # on another lane: its own lane would not see it
            raise DuplicateSessionError(f"session {session!r} is already on device {self._device}")
        self._lanes[workload].add_session(session, workload, weight, now)

    def remove_session(self, session: str, now: float) -> list[Action]:
        return self.lane_of(session).remove_session(session, now)

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
        # Check every lane's clock first, so that a refusal changes nothing (the first lane
        # refuses a policy that is none before it changes).
        for lane in self._lanes:
            lane._check_now(now)
        return [action for lane in self._lanes for action in lane.set_policy(policy, now)]

    def tick(self, now: float) -> list[Action]:
        return [action for lane in self._lanes for action in lane.tick(now)]

    # --------------------------------------------------------------- queries

    def next_deadline(self) -> float | None:
        return min((d for d in (lane.next_deadline() for lane in self._lanes) if d is not None), default=None)

    def holder(self) -> str | None:
        """The highest class's holder (the one the others are paced for); None if no lane has one."""
        return next(iter(self.holders()), None)

    def holders(self) -> tuple[str, ...]:
        """Every lane's holder, highest class first."""
        return tuple(h for h in (lane.holder() for lane in self._lanes) if h is not None)

    def wanted_by(self, workload: Workload) -> bool:
        return self._lanes[workload].wanted_by(workload)

    def waiting_count(self) -> int:
        return sum(lane.waiting_count() for lane in self._lanes)

    def state(self, session: str) -> SessionState:
        return self.lane_of(session).state(session)

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


#: The duties the controller moves between by default, in permille of each period a lower class may
#: issue work while a higher class holds: 0 is a pause, 1000 leaves the pacing to MPS client priority.
#: Why no steps between them (finer ones can be given to the controller): docs/internals.md.
DUTY_STEPS_PERMILLE = (0, 1000)

_OK, _OVER, _FAR = 0, 1, 2  # a window's verdict against the reference


@dataclass(frozen=True, slots=True)
class PaceWant:
    """What one higher-class session asks of the classes below it now: ``duty_permille``, the
    duty they run at while it holds its token (or holds a pause); ``armed``, a pause may come
    before they hear again, so they keep their queued GPU work short; ``holds_pause``, it holds
    no token but keeps them paused (its requests still wait: a pause held across back-to-back
    requests)."""

    duty_permille: int
    armed: bool
    holds_pause: bool = False


FREE_WANT = PaceWant(1000, False)


class PaceController:
    """Picks how hard lower classes are paced for one higher-class session (an inference service, or a
    trainer for the best-effort class below it), from that session's slices only, so that one service's
    ``slo_ms`` and reference are never another's (:func:`board_slot` combines a device's sessions). A
    session that says its queue is steered by it, one that does not by its slice lengths (how each:
    docs/internals.md). ``fixed_duty_permille`` pins the duty (observations are then only counted);
    ``changes`` counts duty changes. Driven, all times in seconds on one clock, by :meth:`tell_queue` at
    each slice request and release (never, for slice-length steering), :meth:`slice_started` at the
    grant and :meth:`slice_ended` at the release; :meth:`want` says what the lower classes are told
    now, :meth:`next_deadline` when to ask again with nothing said."""

    # Knobs no setting exposes (what each does: docs/internals.md).
    noise_z = 3.0  # standard errors of the difference past which a window counts as slower
    latency_quantile = 0.9  # the learned target: this quantile of the latencies measured paused,
    latency_margin = 0.25  # times 1 + this
    max_gap_s = 0.05  # how long past a release a pause is held for requests said to wait
    reference_window = 64  # slices kept in each reference
    max_backoff = 64  # windows held after failures, at most

    def __init__(self, *, tolerance: float = 0.05, window: int = 16, probe_every: int = 1024,
                 fixed_duty_permille: int | None = None, period_us: int = 10_000,
                 steps: tuple[int, ...] = DUTY_STEPS_PERMILLE) -> None:
        if not 0 < tolerance < 10:
            raise ValueError(f"tolerance must be in (0, 10), got {tolerance!r}")
        if window < 1 or probe_every < window:
            raise ValueError("window >= 1 and probe_every >= window are needed")
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
        self.changes = 0  # duty changes made (either steering), for metrics
        # Slice-length steering.
        self._step = 0  # index into steps; starts paused: the safe side for the higher class
        self._reference: deque[float] = deque(maxlen=self.reference_window)
        self._current: list[float] = []
        self._since_probe = 0
        self._probing = False
        self._resume_step = 0  # where a probe returns to
        self._trial = False  # trying a step up: a window decides; a quarter of one far off ends it
        self._early = max(4, self.window // 4)
        self._backoff = 1  # windows to hold after the next failure (doubles per failure)
        self._backoff_before = 1  # as it was before the last failure (restored if that one is forgotten)
        self._hold = 0  # windows left before the next try
        self._passes = 0  # windows in a row that held at a step above 0
        self._failed: list[float] | None = None  # the window that made the last pause, to check it
        self._at_step: deque[float] = deque(maxlen=4 * self.reference_window)  # slices since the last step change
        # Queue steering (tell_queue); off until the session says its queue.
        self._queue_said = False
        self._waiting = 0
        self._oldest_at: float | None = None  # when the oldest waiting request arrived (set while any waits)
        self._released_at: float | None = None  # the release that last said requests wait (the gap runs from it)
        self._paused = False  # a pause held until the queue is empty
        self._serving_since: float | None = None  # the slice in progress began (its duty below)
        self._serving_duty = 1000
        self._serving_lower = False
        self._served_arrival: float | None = None  # the slice in progress serves a request that arrived then
        self._service_free: deque[float] = deque(maxlen=self.reference_window)  # slices with lower classes running
        self._service_paused: deque[float] = deque(maxlen=self.reference_window)
        self._latency_paused: deque[float] = deque(maxlen=self.reference_window)  # arrival to release, paused
        self._queue_since_probe = 0
        self._queue_probe_left = 0

    # ---------------------------------------------------------------- what it says

    @property
    def duty_permille(self) -> int:
        """The duty slice-length steering holds (the fixed one if pinned)."""
        return self.fixed if self.fixed is not None else self.steps[self._step]

    @property
    def queue_steered(self) -> bool:
        """Whether the session said its queue with its last slice request (and is steered by it)."""
        return self._queue_said and self.fixed is None

    def want(self, now: float, in_line: bool = True) -> PaceWant:
        """What the lower classes are told for this session at ``now``. Under queue steering this
        may start a pause (held until the queue is empty): it is a step of the controller, and
        :meth:`next_deadline` says when it must be asked again. ``in_line``: the session's slice
        request is in line for its token (False: kept elsewhere, a suspended session's say, so
        nothing it waits for can run, and it holds nobody back)."""
        if not self.queue_steered:
            duty = self.duty_permille
            return PaceWant(duty, duty < 1000)
        serving = self._serving_since is not None
        if not serving and not in_line and self._released_at is None:
            return FREE_WANT
        if not serving and self._waiting and self._released_at is not None \
                and now > self._released_at + self.max_gap_s:
            self._forget_queue()  # released saying requests wait, and never asked again: as if none did
        if not serving and not self._waiting:
            return FREE_WANT
        if not self._paused and self._over_target(now):
            self._paused = True
            self.changes += 1
        if self._paused:
            return PaceWant(0, True, holds_pause=not serving)
        return PaceWant(1000, True)

    def next_deadline(self) -> float | None:
        """When :meth:`want` may change with nothing said (None: not before the next slice event)."""
        if not self.queue_steered:
            return None
        serving = self._serving_since is not None
        gap_end = None if serving or not self._waiting or self._released_at is None \
            else self._released_at + self.max_gap_s
        if self._paused or (not serving and not self._waiting):
            return gap_end
        target, expected = self.target_s(), self.expected_service_s() or 0.0
        if target is None:
            return gap_end
        cross = self._served_arrival + target if serving else self._oldest_at + target - expected
        return cross if gap_end is None else min(cross, gap_end)

    def reference_s(self) -> float | None:
        """The slice length slice-length steering holds the session to: the SLO if declared,
        else the median of slices measured with lower classes paused or absent."""
        if self.slo_s is not None:
            return self.slo_s
        if len(self._reference) < max(4, self.window // 2):
            return None
        return _median(self._reference)

    def target_s(self) -> float | None:
        """The latency queue steering holds a waiting request to (None: not learned yet)."""
        if self.slo_s is not None:
            return self.slo_s
        if len(self._latency_paused) < 8:
            return None
        return _quantile(self._latency_paused, self.latency_quantile) * (1.0 + self.latency_margin)

    def expected_service_s(self) -> float | None:
        """A request's expected time on the device with the lower classes running beside it (the
        paused one until such a slice was seen; None before any)."""
        samples = self._service_free or self._service_paused
        return _median(samples) if samples else None

    def set_slo(self, slo_s: float | None) -> None:
        self.slo_s = slo_s if slo_s is not None and math.isfinite(slo_s) and slo_s > 0 else None

    # ---------------------------------------------------------------- what it hears

    def tell_queue(self, now: float, waiting: int | None, oldest_wait_s: float | None = None, *,
                   released: bool = False) -> None:
        """The session said, at ``now``, with a slice request (or, ``released``, a release), that
        ``waiting`` of its requests wait (at a request, the ones the slice is for included), the
        oldest for ``oldest_wait_s``. ``waiting=None`` at a request: it says nothing, and is
        steered by slice lengths; at a release, from a session steered by its queue: none waits."""
        if waiting is None:
            if released:
                if not self._queue_said:
                    return
                waiting = 0
            else:
                self._queue_said = False
                self._forget_queue()
                return
        self._queue_said = True
        self._released_at = now if released else None
        self._waiting = max(0, int(waiting))
        if not self._waiting:
            self._oldest_at = None
            if self._serving_since is None:
                self._forget_queue()
            return
        age = oldest_wait_s if oldest_wait_s is not None and math.isfinite(oldest_wait_s) else 0.0
        self._oldest_at = now - min(max(age, 0.0), 3600.0)

    def slice_started(self, now: float, lower_active: bool) -> None:
        """The session was granted its token at ``now``; ``lower_active``: a lower class holds."""
        want = self.want(now)
        self._serving_since = now
        self._serving_duty = want.duty_permille
        self._serving_lower = lower_active
        self._served_arrival = self._oldest_at if self._oldest_at is not None else now

    def slice_ended(self, now: float, lower_active: bool) -> bool:
        """The slice begun at :meth:`slice_started` ended at ``now``; ``lower_active``: a lower
        class held at some point of it. True if the duty changed."""
        started, self._serving_since = self._serving_since, None
        if started is None:
            return False
        held_s = max(0.0, now - started)
        lower = lower_active or self._serving_lower
        if not self.queue_steered:
            return self.observe(held_s, self._serving_duty, lower)
        paused_throughout = self._serving_duty == 0 and self._paused or not lower
        latency_s = max(held_s, now - self._served_arrival)
        if paused_throughout:
            self._service_paused.append(held_s)
            self._latency_paused.append(latency_s)
            self._reference.append(held_s)
        elif self._serving_duty == 1000 and not self._paused:
            self._service_free.append(held_s)
        if self._queue_probe_left:
            self._queue_probe_left -= 1
        elif not self._paused:
            self._queue_since_probe += 1
            if self.slo_s is None and self._queue_since_probe >= self.probe_every:
                self._queue_since_probe = 0
                self._queue_probe_left = self.window  # the next requests measure the target afresh
        return False

    def observe(self, held_s: float, duty_permille: int, lower_active: bool) -> bool:
        """A slice of ``held_s`` ended (slice-length steering); it ran under ``duty_permille``,
        with a lower class holding (``lower_active``) or not. True if the duty changed."""
        if not (math.isfinite(held_s) and held_s >= 0):
            return False
        if not lower_active or duty_permille == 0:
            self._reference.append(held_s)  # as good as alone (a pause still costs the drain)
        if self.fixed is not None or not lower_active:
            return False
        if duty_permille != self.duty_permille:
            return False  # ran under an older duty: says nothing about this one
        self._current.append(held_s)
        early = self._trial and len(self._current) >= self._early and self._verdict(self._current) == _FAR
        if len(self._current) < self.window and not early:
            return False
        window, self._current = self._current, []
        before = self._step
        self._end_window(window)
        if self._step > 0 and not self._probing:
            self._since_probe += len(window)
            if self.slo_s is None and self._since_probe >= self.probe_every:
                self._since_probe = 0
                self._probing = True
                self._resume_step = self._step
                self._step = 0
        if self._step != before:
            self._at_step.clear()
            self.changes += 1
            return True
        return False

    # ---------------------------------------------------------------- internals

    def _end_window(self, window: list[float]) -> None:
        if self._probing:
            self._probing = False
            self._step = self._resume_step
            return
        verdict = self._verdict(window)
        if verdict is None:
            return
        if self._step > 0:  # a small cost shows over many windows: judged on all since the step began too
            self._at_step.extend(window)
            if verdict == _OK and len(self._at_step) > len(window):
                verdict = min(_OVER, self._verdict(self._at_step))
        if self._step == 0:  # the window was the reference: only the hold and the last failure are decided
            if self._failed is not None:
                failed, fresh, self._failed = self._failed, window, None
                # Pausing did not make them faster (within one standard error): not interference.
                if self._verdict(failed, fresh, z=1.0) == _OK:
                    self._hold, self._backoff = 0, self._backoff_before
                    self._reference.clear()  # the service's own time changed: measured afresh from here
                    self._reference.extend(fresh)
            if self._hold > 0:
                self._hold -= 1
            elif len(self.steps) > 1:
                self._step, self._trial = 1, True
            return
        if verdict == _OK:
            self._trial = False
            self._passes += 1
            if self._passes >= 4:  # held a while: failures long ago count less
                self._passes, self._backoff = 0, max(1, self._backoff // 2)
            if self._hold > 0:
                self._hold -= 1  # a failed try is not repeated at once
            elif self._step + 1 < len(self.steps):
                self._step += 1
                self._trial = True
            return
        self._backoff_before = self._backoff
        self._backoff = min(self._backoff * 2, self.max_backoff)
        self._hold = self._backoff
        self._trial, self._passes = False, 0
        self._step = 0 if verdict == _FAR else self._step - 1
        if self._step == 0:  # the next window, paused, says whether pausing helped
            self._failed = list(window)

    def _verdict(self, samples, reference=None, z: float | None = None) -> int | None:
        """Whether ``samples`` are slower than the reference (the SLO, else ``reference`` or the
        controller's reference slices) past the tolerance and ``z`` (``noise_z``) standard errors."""
        if self.slo_s is not None:
            ref, ref_samples = self.slo_s, ()
        else:
            ref_samples = self._reference if reference is None else reference
            if len(ref_samples) < max(4, self.window // 2):
                return None
            ref = _median(ref_samples)
        if not samples:
            return None
        measured = _median(samples)
        if measured <= 0 or ref <= 0:
            return _OK if measured <= ref else _FAR
        spread = max(_log_spread(samples), _log_spread(ref_samples) if ref_samples else 0.0)
        # The standard error of a median of n draws is about 1.2533 sigma / sqrt(n).
        se = 1.2533 * spread * math.sqrt(1.0 / len(samples) + (1.0 / len(ref_samples) if ref_samples else 0.0))
        excess = math.log(measured / ref) - (self.noise_z if z is None else z) * se
        if excess > math.log1p(2.0 * self.tolerance):
            return _FAR
        if excess > math.log1p(self.tolerance):
            return _OVER
        return _OK

    def _over_target(self, now: float) -> bool:
        if self._queue_probe_left:
            return True
        target, expected = self.target_s(), self.expected_service_s()
        if target is None:
            return True
        expected = expected or 0.0  # no slice seen yet: its age alone
        if self._serving_since is not None:
            arrival = self._served_arrival
            finish = max(self._serving_since + expected, now)
        else:
            arrival = self._oldest_at
            finish = now + expected
        return finish - arrival > target

    def _forget_queue(self) -> None:
        self._waiting = 0
        self._oldest_at = None
        if self._paused:
            self._paused = False
            self.changes += 1


def board_slot(present: int, wants, period_us: int) -> PaceSlot:
    """One lower class's slot on a device's board, from ``wants``: (want, holding) of each
    higher-class session on it, ``holding`` whether it holds its token now. The class is paced
    while any of them holds (or holds a pause), at the lowest duty among those; the bound is
    armed if any of them may pause it; the duty shown while none holds is the lowest that the
    next slice may bring (what a reader of protocol 2.6, which knows no ``armed``, bounds by)."""
    active, duty_active, duty_next, armed = False, 1000, 1000, False
    for want, holding in wants:
        armed = armed or want.armed
        duty_next = min(duty_next, want.duty_permille)
        if holding or want.holds_pause:
            active = True
            duty_active = min(duty_active, want.duty_permille)
    return PaceSlot(present, active, duty_active if active else duty_next, period_us, armed)


def _log_spread(values) -> float:
    """A robust standard deviation of log(values): 1.4826 times their median absolute deviation."""
    logs = [math.log(v) for v in values if v > 0]
    if len(logs) < 2:
        return 0.0
    mid = _median(logs)
    return 1.4826 * _median([abs(x - mid) for x in logs])


def _quantile(values, q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, max(0, math.ceil(q * len(ordered)) - 1))]
