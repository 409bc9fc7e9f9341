"""Timing of one scheduler step at a given queue length, for ``bench.scale``.

It reads a clock only to measure, which is why it lives here and not in the pure
:mod:`sharing`: the scheduler itself is driven by a fake clock that advances 1 ms
per step. It uses the public API alone, so the same function times any version of
the scheduler.
"""

from __future__ import annotations

import gc
import statistics
import time

from sharing.scheduler import SchedulerPolicy, TokenScheduler, Workload

__all__ = ["scheduler_step_us"]

_STEP_S = 0.001  # fake-clock advance between two measured calls
_WEIGHTS = (0.5, 1.0, 2.0, 3.0)  # varied, so virtual times spread out as sessions are charged


def scheduler_step_us(waiting: int, samples: int = 300) -> dict[str, float | int]:
    """Mean and median µs of scheduler steps with ``waiting`` sessions in line.

    All sessions are of one class (training), the worst case for the in-class fair
    order. Measured, each ``samples`` times:

    * ``grant_next_us_*``: the holder releases with requeue and the next waiter is
      granted (one ``release`` call), so the queue length stays ``waiting``;
    * ``request_us_*``: an idle session of the same class asks (the sleeper clamp
      reads the class minimum) while the token is held;
    * ``cancel_us_*``: that session leaves the line again;
    * ``snapshot``: a full snapshot (every session's view and the ordered queue)
      taken after a handoff, reported in ms from fewer samples.
    """
    if isinstance(waiting, bool) or not isinstance(waiting, int) or waiting < 1:
        raise ValueError(f"waiting must be an int >= 1, got {waiting!r}")
    if isinstance(samples, bool) or not isinstance(samples, int) or samples < 1:
        raise ValueError(f"samples must be an int >= 1, got {samples!r}")
    sched = TokenScheduler(0, SchedulerPolicy())
    now = 0.0
    ids = [f"s{i}" for i in range(waiting + 1)]
    for i, sid in enumerate(ids):
        sched.add_session(sid, Workload.TRAINING, _WEIGHTS[i % len(_WEIGHTS)], now)
    (grant,) = sched.request(ids[0], now)
    for sid in ids[1:]:
        # waiting_since skips the sleeper clamp: builds the line in O(n) on any version.
        sched.request(sid, now, waiting_since=now)
    probe = "probe"
    sched.add_session(probe, Workload.TRAINING, 1.0, now)

    def handoff() -> None:
        nonlocal grant, now
        now += _STEP_S
        (grant,) = sched.release(grant.session, grant.grant, now, requeue=True)

    for _ in range(min(samples, 50)):  # warm up: spread the virtual times a little
        handoff()
    grant_ns: list[int] = []
    request_ns: list[int] = []
    cancel_ns: list[int] = []
    clock = time.perf_counter_ns
    gc_was_enabled = gc.isenabled()
    gc.disable()
    try:
        for _ in range(samples):
            now += _STEP_S
            t0 = clock()
            (next_grant,) = sched.release(grant.session, grant.grant, now, requeue=True)
            t1 = clock()
            grant = next_grant
            grant_ns.append(t1 - t0)
            now += _STEP_S
            t0 = clock()
            sched.request(probe, now)
            t1 = clock()
            sched.cancel(probe, now)
            t2 = clock()
            request_ns.append(t1 - t0)
            cancel_ns.append(t2 - t1)
        snapshot_ns = []
        for _ in range(max(1, min(samples // 30, 10))):
            handoff()  # a status usually follows some change
            t0 = clock()
            sched.snapshot(now)
            snapshot_ns.append(clock() - t0)
    finally:
        if gc_was_enabled:
            gc.enable()
    return {
        "waiting": waiting,
        "samples": samples,
        "grant_next_us_mean": statistics.fmean(grant_ns) / 1e3,
        "grant_next_us_p50": statistics.median(grant_ns) / 1e3,
        "request_us_mean": statistics.fmean(request_ns) / 1e3,
        "request_us_p50": statistics.median(request_ns) / 1e3,
        "cancel_us_mean": statistics.fmean(cancel_ns) / 1e3,
        "cancel_us_p50": statistics.median(cancel_ns) / 1e3,
        "snapshot_ms_p50": statistics.median(snapshot_ns) / 1e6,
    }
