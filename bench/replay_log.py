"""The duties a recorded run's controller chose, from its daemon's ``[pace]`` lines: a check of the replay.

A ``bench.colocate`` mode with a daemon keeps the daemon's ``[pace]`` lines
(``daemon_log``); each says that the duty changed at the end of a slice, with
the slice's length and the wall-clock time. Matched to the replayed requests
(a time offset per load, fitted so that most lines land on the end of a
request of the same length), they give the duty each request was granted
under. Replaying a mode under its own schedule checks the replay's model on a
mode none of its parameters were fitted to: with the mode's own service times
it checks the trainer model (kept); with the service times of ``corun-pause``
and ``corun-free`` paired by request, the service model (p99) as a policy
replay uses it.
"""

from __future__ import annotations

import bisect
import datetime
import json
import re
from dataclasses import dataclass

from bench.replay import (FREE_MODE, PAUSED_MODE, FixedPacing, LoadRecord, Outcome, ReplayError, _services,
                          fit_speeds, load_run, replay)

_LINE = re.compile(r"^(\d{4}-\d\d-\d\d \d\d:\d\d:\d\d),(\d{3}) .*\[pace\] device=0 duty_permille=(\d+) "
                   r"\(slice ([0-9.]+) ms")
_MATCH_MS = 5.0  # a line is logged this soon after its slice ended, at most
_SLICE_MS = 0.6  # a slice's length against its request's occupancy (the occupancy holds the loop's turn)
_LINES_MAX = 10_000


@dataclass(frozen=True)
class Schedule:
    """Per load, the duty each request was granted under, and which requests ended with a change."""

    duties: dict[str, list[int]]
    changes: dict[str, list[int]]  # request indices whose slice end changed the duty
    unmatched: int  # [pace] lines matched to no request


def _changes(lines: list[str]) -> list[tuple[float, int, float]]:
    """(wall ms, new duty, slice ms) of each duty-change line."""
    out = []
    for line in lines[:_LINES_MAX]:
        m = _LINE.match(line) if isinstance(line, str) else None
        if m:
            wall = datetime.datetime.strptime(m.group(1), "%Y-%m-%d %H:%M:%S").timestamp() * 1e3 + int(m.group(2))
            out.append((wall, int(m.group(3)), float(m.group(4))))
    return out


def _matches(ends: list[float], services: list[float], changes, offset: float) -> dict[int, int]:
    """line index -> request index, for the lines that land on a request's end of their length."""
    found = {}
    for j, (wall, _, slice_ms) in enumerate(changes):
        t = wall - offset
        lo = bisect.bisect_left(ends, t - _MATCH_MS)
        for k in range(lo, len(ends)):
            if ends[k] > t + 0.5:  # logged after the slice ended, never before it (clock resolution aside)
                break
            if abs(services[k] - slice_ms) <= _SLICE_MS:
                found[j] = k
                break
    return found


def schedule(path: str, mode: str, loads: dict[str, LoadRecord] | None = None) -> Schedule:
    """The duty schedule of ``mode`` in the run at ``path`` (ReplayError if it kept no [pace] lines)."""
    loads = load_run(path) if loads is None else loads
    with open(path) as f:
        entry = json.load(f)["modes"].get(mode)
    changes = _changes(entry.get("daemon_log") or []) if isinstance(entry, dict) else []
    if not changes:
        raise ReplayError(f"{mode} in {path} kept no [pace] duty changes (daemon_log): no schedule to replay")
    duties, at, left, duty = {}, {}, list(range(len(changes))), 0  # a controller starts paused
    for name, load in loads.items():
        requests = load.modes[mode].requests
        ends, services = [r.end_ms for r in requests], [r.service_ms for r in requests]
        remaining = [changes[j] for j in left]
        best: dict[int, int] = {}
        for wall, _, slice_ms in remaining:  # every (line, request of its length) is an offset to try
            for k, service in enumerate(services):
                if abs(service - slice_ms) <= _SLICE_MS:
                    found = _matches(ends, services, remaining, wall - ends[k])
                    if len(found) > len(best):
                        best = found
        change_at = {best[j]: remaining[j][1] for j in sorted(best)}
        left = [left[j] for j in range(len(remaining)) if j not in best]
        seq = []
        for k in range(len(requests)):
            seq.append(duty)
            duty = change_at.get(k, duty)
        duties[name], at[name] = seq, sorted(change_at)
    return Schedule(duties, at, len(left))


class ScheduledPacing(FixedPacing):
    """The trainer paused during each request granted under duty 0, as the schedule says."""

    def __init__(self, duties: list[int]) -> None:
        super().__init__()
        self._duties, self._next, self._now_paused = duties, 0, False

    def granted(self, now_s: float, waiting: int, oldest_arrival_s: float) -> None:
        self._now_paused = self._duties[min(self._next, len(self._duties) - 1)] == 0
        self._next += 1

    def ended(self, now_s: float, held_s: float, waiting: int, oldest_arrival_s: float | None) -> None:
        self._now_paused = False

    def trainer_paused(self) -> bool:
        return self._now_paused


def replay_schedule(load: LoadRecord, mode: str, duties: list[int], *, own: bool) -> Outcome:
    """``mode`` replayed under its recorded duties: its own service times (``own``), or those of
    corun-pause and corun-free paired by request; the trainer's speeds fitted to those two."""
    n = len(load.arrivals_ms)
    if own:
        paused = free = _services(load.modes[mode], n)
    else:
        paused, free = _services(load.modes[PAUSED_MODE], n), _services(load.modes[FREE_MODE], n)
    out = replay(load.arrivals_ms, paused, free, ScheduledPacing(duties), fit_speeds(load), load.phase_s,
                 load.max_backlog)
    out.alone_p99_ms = load.alone_p99_ms
    return out
