"""Replay a recorded ``bench.colocate`` run: re-time its requests under a pacing policy, predict p99 and kept.

    python -m bench.replay bench/results/h100-80gb-hbm3-2026-11-27/colocate-run1.json --policy adaptive
    python -m bench.replay RUN.json --reproduce      # each recorded mode from its own records

A design tool, not evidence: what it predicts for a policy comes from a model
(a FIFO single server re-timed from measured service times, a trainer whose
speed depends on whether a request is in service and whether it is paused);
only a GPU run measures. What it models and ignores: docs/replay.md.

Records. A run's JSON holds, per mode and load, the arrival-ordered latencies
and the seed and rate of its Poisson arrivals. The arrivals are regenerated
with the bench's own generator (:func:`bench.colocate_worker.poisson_arrivals`);
the worker serves one request at a time, first come first served, so a
request starts when it arrives or when the one before it ends, whichever is
later, and its service time (its occupancy of the server) is its end minus
its start. Every mode of a load saw the same arrivals, so request ``i`` of
``corun-pause`` and request ``i`` of ``corun-free`` are the same request served
with the trainer paused and free: a policy's replay takes, per request, the
one its trainer state calls for (part of each where the state changes during
it, in proportion to the work done).

Policies. The recorded modes replay from their own records. ``adaptive``,
``pause``, ``free`` and ``queue`` run the daemon's own pace logic: the
:class:`~nodeagent.daemon.tokens.Pacing` component with the
:class:`~sharing.corun.PaceController` per higher-class session the daemon's
settings make, driven by the replayed slices (request, grant, release, time
passed in); the trainer's state is read from the pace board it writes.
``queue`` is the default controller told, at each slice request and release,
how many requests wait and the oldest's age (as ``Client.slice(queue=...)``
says them, protocol 2.7); ``adaptive`` is the same controller told nothing
(steered by slice lengths). :class:`DaemonPacing` is the only code that
touches that API.
"""

from __future__ import annotations

import argparse
import contextlib
import heapq
import json
import math
import os
import sys
import tempfile
import types
from collections import deque
from dataclasses import dataclass

from bench.colocate_worker import poisson_arrivals
from bench.common import percentile

#: Modes whose records are the service times with the trainer paused and free beside a daemon.
PAUSED_MODE, FREE_MODE = "corun-pause", "corun-free"
#: Policies that run the daemon's pace logic, and the ``corun.duty`` each is configured with.
DAEMON_POLICIES = {"adaptive": "adaptive", "pause": "pause", "free": "free", "queue": "queue"}
_MAX_REQUESTS = 1_000_000  # a record beyond this is not a bench.colocate phase
_TICKS_AT_ONCE = 2


class ReplayError(Exception):
    """A record that cannot be replayed, or a policy this tree lacks; the message says what to do."""


class PolicyUnavailable(ReplayError):
    """The policy needs a controller this tree does not have."""


# ------------------------------------------------------------------ records


@dataclass(frozen=True)
class Request:
    arrival_ms: float
    start_ms: float
    end_ms: float

    @property
    def service_ms(self) -> float:
        return self.end_ms - self.start_ms

    @property
    def latency_ms(self) -> float:
        return self.end_ms - self.arrival_ms


@dataclass(frozen=True)
class ModeRecord:
    """One mode's phase of one load, rebuilt per request."""

    mode: str
    requests: tuple[Request, ...]
    p99_ms: float
    kept: float | None
    dropped_at: frozenset[int]  # arrival indices the worker dropped (a full backlog)
    recorded_service_p50_ms: float | None  # what the worker measured itself (its t0..t1), a check on the rebuild
    recorded_service_p99_ms: float | None


@dataclass(frozen=True)
class LoadRecord:
    """One load of one run: its arrivals, and every mode measured under them."""

    run: str
    load: str
    rate_per_s: float
    seed: int
    phase_s: float
    max_backlog: int
    arrivals_ms: tuple[float, ...]
    alone_p99_ms: float | None
    modes: dict[str, ModeRecord]


def arrivals_ms(rate_per_s: float, seed: int, phase_s: float) -> list[float]:
    """The phase's arrivals in ms from its start, from the bench's own seeded generator."""
    return [t / 1e6 for t in poisson_arrivals(rate_per_s, seed, 0, int(round(phase_s * 1e9)))]


def rebuild(arrivals: list[float], latencies: list[float], max_backlog: int) -> tuple[list[Request], set[int]]:
    """Per request (arrival, start, end) from arrival-ordered latencies of a FIFO single server;
    an arrival that found ``max_backlog`` requests waiting was dropped (and has no latency)."""
    requests: list[Request] = []
    dropped: set[int] = set()
    free_at = -math.inf  # when the server finishes the last accepted request
    pending: deque[float] = deque()  # starts of accepted requests, for the backlog at an arrival
    k = 0
    for i, a in enumerate(arrivals):
        while pending and pending[0] <= a:
            pending.popleft()
        if len(pending) >= max_backlog:
            dropped.add(i)
            continue
        if k >= len(latencies):
            raise ReplayError(f"{len(latencies)} latencies for {len(arrivals)} arrivals: the record does not "
                              "match its seed and rate; replay only a bench.colocate JSON as written")
        end = a + latencies[k]
        start = max(a, free_at)
        if end < start - 1e-3:  # rounded to µs: anything more is not this server
            raise ReplayError(f"request {i} ends before it can start ({end:.3f} < {start:.3f} ms): the latencies "
                              "are not a FIFO single server's under these arrivals")
        requests.append(Request(a, start, max(end, start)))
        free_at = max(end, start)
        if start > a:
            pending.append(start)
        k += 1
    if k != len(latencies):
        raise ReplayError(f"{len(latencies)} latencies for {k} accepted arrivals: the record does not match "
                          "its seed and rate")
    return requests, dropped


def _number(value, what: str) -> float:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or not math.isfinite(value):
        raise ReplayError(f"{what} is {value!r}, not a number: replay only a bench.colocate JSON as written")
    return float(value)


def load_run(path: str) -> dict[str, LoadRecord]:
    """Every load of the run at ``path`` (ReplayError with one line if it cannot be replayed): from
    its per-request record where it has one (``record_format`` 1: arrival, start and end of each
    request), else rebuilt from its latencies and seeds (the runs of 2026-11-27)."""
    try:
        with open(path) as f:
            run = json.load(f)
    except (OSError, ValueError) as exc:
        raise ReplayError(f"cannot read {path}: {exc}") from None
    if not isinstance(run, dict) or run.get("benchmark") != "colocate":
        raise ReplayError(f"{path} is not a bench.colocate result (no \"benchmark\": \"colocate\")")
    name = os.path.splitext(os.path.basename(path))[0]
    try:
        params, loads, modes = run["parameters"], run["loads"], run["modes"]
        seed, max_backlog = int(params["seed"]), int(params["max_backlog"])
        ok = {mode: entry for mode, entry in modes.items() if isinstance(entry, dict) and entry.get("status") == "ok"}
        out = {}
        for index, load in enumerate(loads):
            entries = {mode: entry["loads"][load] for mode, entry in ok.items()}
            if entries and all(isinstance(e.get("requests"), dict) for e in entries.values()):
                out[load] = _recorded_load(name, load, entries, max_backlog)
            else:
                out[load] = _rebuilt_load(name, load, index, loads[load], entries, params, seed, max_backlog)
    except (KeyError, TypeError, ValueError, AttributeError, IndexError) as exc:
        raise ReplayError(f"{path} lacks what a replay needs ({type(exc).__name__}: {exc}); replay only a "
                          "bench.colocate JSON as written") from None
    return out


def _rebuilt_load(name, load, index, spec, entries, params, seed, max_backlog) -> LoadRecord:
    phase_s = _number(params["phase_s"], "parameters.phase_s")
    rate = _number(spec["rate_per_s"], f"loads.{load}.rate_per_s")
    if not 0 < rate * phase_s <= _MAX_REQUESTS:
        raise ReplayError(f"load {load}: {rate:g} req/s for {phase_s:g} s is not a bench phase")
    # The seed as bench.colocate.run_phase derived it: run seed * 1000 + the load's index.
    arrivals = arrivals_ms(rate, seed * 1000 + index, phase_s)
    records = {}
    for mode, e in entries.items():
        lat = [_number(v, f"{mode}.{load}.latency_ms[]") for v in e["latency_ms"]]
        if len(arrivals) != e["offered"]:
            raise ReplayError(f"{mode} {load}: {e['offered']} offered, {len(arrivals)} regenerated from "
                              "the seed and rate: not a record of this bench's arrivals")
        requests, dropped = rebuild(arrivals, lat, max_backlog)
        if len(dropped) != e["dropped"]:
            raise ReplayError(f"{mode} {load}: {e['dropped']} dropped, the rebuild finds {len(dropped)}")
        records[mode] = ModeRecord(mode, tuple(requests), percentile(lat, 99), e.get("kept"),
                                   frozenset(dropped), e.get("service_p50_ms"), e.get("service_p99_ms"))
    alone = records.get("alone")
    return LoadRecord(name, load, rate, seed * 1000 + index, phase_s, max_backlog, tuple(arrivals),
                      alone.p99_ms if alone else None, records)


def _recorded_load(name, load, entries, max_backlog) -> LoadRecord:
    """A load whose modes carry ``requests`` (arrival_us, start_us, end_us; null start and end for a
    dropped one; window_us: the phase's start and end), times from each mode's own window start."""
    records, arrivals, phase_s, rate, seed = {}, None, None, None, None
    for mode, e in entries.items():
        r = e["requests"]
        start_us, end_window_us = (_number(v, f"{mode}.{load}.requests.window_us") for v in r["window_us"])
        arrival = [(_number(v, f"{mode}.{load}.arrival_us[]") - start_us) / 1e3 for v in r["arrival_us"]]
        if not 0 < len(arrival) <= _MAX_REQUESTS or len(r["start_us"]) != len(arrival) or \
                len(r["end_us"]) != len(arrival) or end_window_us <= start_us:
            raise ReplayError(f"{mode} {load}: arrival_us, start_us and end_us are not one entry per request")
        requests, dropped = [], set()
        for i, (a, st, en) in enumerate(zip(arrival, r["start_us"], r["end_us"])):
            if st is None or en is None:
                dropped.add(i)
                continue
            st, en = (_number(st, f"{mode}.{load}.start_us[]") - start_us) / 1e3, \
                (_number(en, f"{mode}.{load}.end_us[]") - start_us) / 1e3
            if not a - 1e-3 <= st <= en:
                raise ReplayError(f"{mode} {load}: request {i} starts before it arrives or ends before it starts")
            requests.append(Request(a, st, en))
        if arrivals is None:
            arrivals, phase_s = arrival, (end_window_us - start_us) / 1e6
            rate, seed = _number(r["rate_per_s"], f"{mode}.{load}.requests.rate_per_s"), int(r["seed"])
        elif len(arrival) != len(arrivals) or any(abs(x - y) > 0.05 for x, y in zip(arrival, arrivals)):
            raise ReplayError(f"load {load}: mode {mode} saw other arrivals than the modes before it; a replay "
                              "pairs the modes' requests by arrival")
        lat = [q.latency_ms for q in requests]
        records[mode] = ModeRecord(mode, tuple(requests), percentile(lat, 99) if lat else math.nan, e.get("kept"),
                                   frozenset(dropped), e.get("service_p50_ms"), e.get("service_p99_ms"))
    alone = records.get("alone")
    return LoadRecord(name, load, rate, seed, phase_s, max_backlog, tuple(arrivals),
                      alone.p99_ms if alone else None, records)


# ------------------------------------------------------------------ the trainer


@dataclass(frozen=True)
class TrainerSpeeds:
    """The trainer's speed as a fraction of alone: ``idle`` while no request is in service and
    ``beside`` while one is and the trainer runs (paused: 0)."""

    idle: float
    beside: float


def busy_fraction(requests, phase_s: float) -> float:
    """The share of the phase's window a request was in service."""
    window = phase_s * 1e3
    return sum(max(0.0, min(r.end_ms, window) - max(r.start_ms, 0.0)) for r in requests) / window


def fit_speeds(load: LoadRecord, paused_mode: str = PAUSED_MODE, free_mode: str = FREE_MODE) -> TrainerSpeeds:
    """Speeds that give the recorded kept of ``paused_mode`` (runs only while idle) and
    ``free_mode`` (runs beside every request): two equations, two unknowns."""
    paused, free = _mode(load, paused_mode), _mode(load, free_mode)
    if paused.kept is None or free.kept is None:
        raise ReplayError(f"{load.run} {load.load}: {paused_mode} and {free_mode} need a recorded kept")
    idle = paused.kept / max(1e-9, 1.0 - busy_fraction(paused.requests, load.phase_s))
    busy = busy_fraction(free.requests, load.phase_s)
    beside = (free.kept - idle * (1.0 - busy)) / max(1e-9, busy)
    return TrainerSpeeds(idle, min(max(beside, 0.0), idle))


def fit_beside(load: LoadRecord, mode: str, idle: float = 1.0) -> TrainerSpeeds:
    """Speeds of a mode that never pauses (no daemon, MPS priority), its idle speed given."""
    record = _mode(load, mode)
    if record.kept is None:
        raise ReplayError(f"{load.run} {load.load}: {mode} has no recorded kept")
    busy = busy_fraction(record.requests, load.phase_s)
    return TrainerSpeeds(idle, min(max((record.kept - idle * (1.0 - busy)) / max(1e-9, busy), 0.0), idle))


def _mode(load: LoadRecord, mode: str) -> ModeRecord:
    try:
        return load.modes[mode]
    except KeyError:
        raise ReplayError(f"{load.run} {load.load} has no mode {mode!r}; it has {', '.join(load.modes)}") from None


# ------------------------------------------------------------------ the adapter to the daemon's pace logic


class DaemonPacing:
    """The daemon's pace logic for one co-run device with one inference and one training session:
    the real :class:`~nodeagent.daemon.tokens.Pacing` with the controllers the daemon's settings make
    (``ServeConfig.pace_controller``, one per higher-class session), fed the replayed slices with
    time passed in, in the order the daemon feeds them; the trainer's state is what the pace board
    it writes says (read with ``PaceBoardReader``).

    The only code here that knows that API. ``joined`` for each session as it comes on the device;
    at each slice request ``told_queue`` (``queue`` policy: the requests waiting, the one the slice
    is for included, and the oldest's age, as ``Client.slice(queue=...)`` says them; else nothing,
    steered by slice lengths) then ``granted``; at its release ``slice_ended`` then ``told_queue``
    with ``released`` (what still waits); ``refresh_all`` after each, as after each loop turn, and at
    ``next_deadline()``, when the loop wakes for a decision nobody's message brings. ``corun.duty``
    pins ``pause`` and ``free``. The scheduler ``Pacing`` is handed to read is this object
    (:meth:`holders`, :meth:`pace`, :meth:`waiting_count`, :meth:`state`, :meth:`lanes`, :meth:`lane_of`):
    the trainer holds its lane's token the whole phase, the inference session holds while a request
    is in service and is granted at once (it is alone in its lane), so it never waits in line."""

    DEVICE = 0

    def __init__(self, policy: str, *, slo_ms: float | None = None) -> None:
        from client_lib.pace import PaceBoardReader
        from nodeagent.config import ConfigError, ServeConfig
        from nodeagent.daemon.tokens import Pacing
        from sharing import SessionState, Workload
        config = ServeConfig(corun_duty="adaptive" if policy == "queue" else policy)
        try:
            config.validate()
            config.pace_controller()
        except (ConfigError, ValueError) as exc:
            raise PolicyUnavailable(f"policy {policy!r}: the daemon's settings refuse it ({exc})") from None
        self._workload, self._state = Workload, SessionState
        self._now = 0.0
        self._says_queue = policy == "queue"
        self.inference = types.SimpleNamespace(id="inference", workload=Workload.INFERENCE, device=self.DEVICE,
                                               slo_ms=slo_ms)
        self.trainer = types.SimpleNamespace(id="trainer", workload=Workload.TRAINING, device=self.DEVICE,
                                             slo_ms=None)
        self._holders: set[str] = set()
        self._sessions = {"inference": self.inference, "trainer": self.trainer}
        self._lanes = tuple(object() for _ in Workload)  # a lane per class, indexed by its workload
        self.pacing = Pacing(sessions=self._sessions, devices=(self.DEVICE,),
                             new_controller=config.pace_controller, clock=lambda: self._now)
        self._dir = tempfile.TemporaryDirectory(prefix="na-replay-")
        self.pacing.start(None, self._dir.name)
        path = self.pacing.board_path(self.DEVICE)
        if not path:
            self.close()
            raise ReplayError(f"the pace logic made no board in {self._dir.name}; see its [pace] warning")
        self._board = PaceBoardReader(path)
        for s in (self.inference, self.trainer):
            self.pacing.joined(self.DEVICE, s.id, s.workload)
        self._holders.add("trainer")  # granted at once: nobody else is in its lane
        self.pacing.granted(self.trainer, self._now, self)
        self.pacing.refresh_all([self])

    # The device's co-run scheduler, read only, as Pacing reads it.
    corun = True

    def holders(self) -> tuple[str, ...]:
        return tuple(s for s in ("inference", "trainer") if s in self._holders)  # highest class first

    def pace(self) -> tuple[tuple[int, bool], ...]:
        inference_holds = "inference" in self._holders
        return ((0, False), (1, inference_holds), (2, inference_holds or "trainer" in self._holders))

    def waiting_count(self) -> int:
        return 0  # each session is alone in its lane: granted the moment it asks

    def state(self, sid: str):
        return self._state.HOLDING if sid in self._holders else self._state.IDLE

    def lanes(self) -> list:
        return list(self._lanes)

    def lane_of(self, sid: str):
        return self._lanes[int(self._sessions[sid].workload)]

    def __contains__(self, sid: object) -> bool:
        return sid in self._sessions

    def __len__(self) -> int:
        return len(self._sessions)

    # What the replay tells it: a slice granted and ended, with the service's queue at each.
    def granted(self, now_s: float, waiting: int, oldest_arrival_s: float) -> None:
        self._now = now_s
        self.pacing.told_queue(self.inference, now_s, waiting if self._says_queue else None,
                               (now_s - oldest_arrival_s) * 1e3 if self._says_queue else None)
        self._holders.add("inference")
        self.pacing.granted(self.inference, now_s, self)
        self.pacing.refresh_all([self])

    def ended(self, now_s: float, held_s: float, waiting: int, oldest_arrival_s: float | None) -> None:
        self._now = now_s
        self._holders.discard("inference")
        self.pacing.slice_ended(self.inference, now_s, self)
        said = self._says_queue and waiting > 0 and oldest_arrival_s is not None
        self.pacing.told_queue(self.inference, now_s, waiting if self._says_queue else None,
                               (now_s - oldest_arrival_s) * 1e3 if said else None, released=True)
        self.pacing.refresh_all([self])

    def next_deadline(self) -> float | None:
        return self.pacing.next_deadline()

    def tick(self, now_s: float) -> None:
        self._now = now_s
        self.pacing.refresh_all([self])  # the loop's turn at a timed component's deadline

    # What the trainer sees.
    def trainer_paused(self) -> bool:
        """Whether the trainer holds at its pause points now (a duty below 1000 while a higher class
        holds, or holds a pause, is replayed as a pause: the default duties are 0 and 1000 only)."""
        return self._board.read(int(self._workload.TRAINING)).throttled

    @property
    def controller(self):
        """The inference session's controller."""
        return self.pacing.controller("inference")

    @property
    def changes(self) -> int:
        return int(self.controller.changes)

    def close(self) -> None:
        with contextlib.suppress(Exception):
            self._board.close()
        self.pacing.close()
        self._dir.cleanup()

    def __enter__(self) -> DaemonPacing:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


class FixedPacing:
    """No daemon: the trainer never paused (a recorded mode replayed from its own records)."""

    changes = 0

    def __init__(self, paused: bool = False) -> None:
        self._paused = paused

    def granted(self, now_s: float, waiting: int, oldest_arrival_s: float) -> None:
        pass

    def ended(self, now_s: float, held_s: float, waiting: int, oldest_arrival_s: float | None) -> None:
        pass

    def next_deadline(self) -> float | None:
        return None

    def tick(self, now_s: float) -> None:
        pass

    def trainer_paused(self) -> bool:
        return self._paused

    def close(self) -> None:
        pass

    def __enter__(self) -> FixedPacing:
        return self

    def __exit__(self, *exc) -> None:
        pass


# ------------------------------------------------------------------ the replay


@dataclass
class Outcome:
    latency_ms: list[float]
    dropped: int
    kept: float | None  # None: not modelled (a mode whose pauses its record does not say)
    p99_ms: float
    paused_share: float  # of the window, the trainer held at its pause points
    busy_share: float  # of the window, a request in service
    duty_changes: int
    alone_p99_ms: float | None = None

    @property
    def p99_over_alone(self) -> float | None:
        return self.p99_ms / self.alone_p99_ms if self.alone_p99_ms else None

    def summary(self) -> dict:
        return {"p99_ms": round(self.p99_ms, 3), "p99_over_alone": _round(self.p99_over_alone),
                "kept": _round(self.kept), "paused_share": round(self.paused_share, 3),
                "busy_share": round(self.busy_share, 3), "dropped": self.dropped,
                "completed": len(self.latency_ms), "duty_changes": self.duty_changes}


def _round(value: float | None, digits: int = 3) -> float | None:
    return None if value is None else round(value, digits)


def replay(arrivals: list[float] | tuple[float, ...], paused_ms, free_ms, pacing, speeds: TrainerSpeeds,
           phase_s: float, max_backlog: int, skip: frozenset[int] = frozenset()) -> Outcome:
    """Re-time ``arrivals`` through a FIFO single server under ``pacing``.

    Request ``i`` takes ``paused_ms[i]`` with the trainer paused and ``free_ms[i]`` with it running
    (``None``: the arrival was not served in that record; it is served at the other's time); a
    change of state during it re-times the rest of its work. ``skip``: arrivals replayed as dropped
    (a recorded mode's own drops). The trainer's kept is its speed integrated over the window."""
    window = phase_s * 1e3
    n = len(arrivals)
    latency: list[float] = []
    dropped = 0
    queue: deque[int] = deque()
    now = 0.0
    serving: int | None = None
    work_left = 0.0  # of the request in service, as a fraction of its work
    started_at = 0.0
    kept_ms = paused_ms_total = busy_ms = 0.0
    i = 0
    ticks_at_now = 0  # deadlines met at this instant: one that stays due after its tick is not met again

    def service_of(index: int, paused: bool) -> float:
        chosen = paused_ms[index] if paused else free_ms[index]
        other = free_ms[index] if paused else paused_ms[index]
        value = chosen if chosen is not None else other
        return max(1e-6, value)

    def advance(to: float) -> None:
        nonlocal now, kept_ms, paused_ms_total, busy_ms, work_left
        lo, hi = min(now, window), min(to, window)
        paused = pacing.trainer_paused()
        if hi > lo:
            if serving is not None:
                busy_ms += hi - lo
            if paused:
                paused_ms_total += hi - lo
            else:
                kept_ms += (hi - lo) * (speeds.beside if serving is not None else speeds.idle)
        if serving is not None:
            work_left -= (to - now) / service_of(serving, paused)
        now = to

    def start_next() -> None:
        nonlocal serving, work_left, started_at
        serving = queue.popleft()
        work_left, started_at = 1.0, now
        pacing.granted(now / 1e3, len(queue) + 1, arrivals[serving] / 1e3)

    while i < n or queue or serving is not None:
        events = []
        if i < n:
            heapq.heappush(events, (arrivals[i], 0))
        if serving is not None:
            heapq.heappush(events, (now + max(0.0, work_left) * service_of(serving, pacing.trainer_paused()), 1))
        deadline = pacing.next_deadline()
        if deadline is not None and ticks_at_now < _TICKS_AT_ONCE:
            heapq.heappush(events, (max(now, deadline * 1e3), 2))
        t, kind = events[0]
        ticks_at_now = ticks_at_now + 1 if kind == 2 and t == now else 0
        advance(t)
        if kind == 0:
            if i in skip or len(queue) >= max_backlog:
                dropped += 1
            else:
                queue.append(i)
            i += 1
            if serving is None and queue:
                start_next()
        elif kind == 1:
            latency.append(now - arrivals[serving])
            held = now - started_at
            serving = None
            pacing.ended(now / 1e3, held / 1e3, len(queue), arrivals[queue[0]] / 1e3 if queue else None)
            if queue:
                start_next()
        else:
            pacing.tick(now / 1e3)
    if now < window:
        advance(window)
    return Outcome(latency, dropped, kept_ms / window, percentile(latency, 99) if latency else math.nan,
                   paused_ms_total / window, busy_ms / window, pacing.changes)


# ------------------------------------------------------------------ what a run replays to


@dataclass(frozen=True)
class Sources:
    """Where a policy replay takes its service times and trainer speeds from."""

    paused_mode: str = PAUSED_MODE
    free_mode: str = FREE_MODE

    @property
    def label(self) -> str:
        return f"paused from {self.paused_mode}, free from {self.free_mode}"


def _services(record: ModeRecord, n: int) -> list[float | None]:
    out: list[float | None] = [None] * n
    served = iter(record.requests)
    for index in range(n):
        if index not in record.dropped_at:
            out[index] = next(served).service_ms
    return out


def reproduce(load: LoadRecord, mode: str) -> Outcome:
    """``mode`` replayed from its own records: its service times whatever the trainer does. Its kept
    is modelled where the record says when the trainer ran: corun-pause and corun-free through the
    daemon's pace logic pinned to pause and free (the speeds fitted to them, so their kept is theirs
    by construction), and the modes without a daemon (never paused, idle at the trainer's alone speed)."""
    record = _mode(load, mode)
    services = _services(record, len(load.arrivals_ms))
    if mode == PAUSED_MODE or mode == FREE_MODE:
        speeds = fit_speeds(load)
        pacing = DaemonPacing("pause" if mode == PAUSED_MODE else "free")
    elif record.kept is not None and mode in ("no-daemon", "mps", "mps-priority"):
        speeds, pacing = fit_beside(load, mode), FixedPacing()
    else:  # alone (no trainer), or a mode whose pauses the record does not say: its kept is not modelled
        speeds, pacing = TrainerSpeeds(math.nan, math.nan), FixedPacing()
    with pacing:
        out = replay(load.arrivals_ms, services, services, pacing, speeds, load.phase_s, load.max_backlog,
                     skip=record.dropped_at)
    if math.isnan(speeds.idle):
        out.kept = None
    out.alone_p99_ms = load.alone_p99_ms
    return out


def predict(load: LoadRecord, policy: str, sources: Sources = Sources(), *, slo_ms: float | None = None) -> Outcome:
    """``policy`` (a daemon policy, or a recorded mode) replayed on this load's arrivals."""
    if policy in load.modes and policy not in DAEMON_POLICIES:
        return reproduce(load, policy)
    if policy not in DAEMON_POLICIES:
        raise ReplayError(f"unknown policy {policy!r}; valid: {', '.join(policies(load))}")
    n = len(load.arrivals_ms)
    paused = _services(_mode(load, sources.paused_mode), n)
    free = _services(_mode(load, sources.free_mode), n)
    speeds = fit_speeds(load, sources.paused_mode, sources.free_mode) if sources.free_mode != "mps-priority" \
        else TrainerSpeeds(1.0, fit_beside(load, "mps-priority").beside)
    with DaemonPacing(DAEMON_POLICIES[policy], slo_ms=slo_ms) as pacing:
        out = replay(load.arrivals_ms, paused, free, pacing, speeds, load.phase_s, load.max_backlog)
    out.alone_p99_ms = load.alone_p99_ms
    return out


#: The baseline a policy must beat (issue 30): MPS client priority, which one environment variable sets.
BASELINE_MODE = "mps-priority"
KEPT_SLACK = 0.02  # "dominates": p99 no higher, training kept no more than 2 points lower


def compare(load: LoadRecord, sources: Sources = Sources(), *, slo_ms: float | None = None) -> dict:
    """Every daemon policy this tree has, predicted, beside the baseline as recorded: per policy
    its figures and whether it dominates the baseline."""
    base = reproduce(load, BASELINE_MODE)
    rows: dict = {BASELINE_MODE: {**base.summary(), "recorded": True}}
    for policy in DAEMON_POLICIES:
        try:
            got = predict(load, policy, sources, slo_ms=slo_ms)
        except PolicyUnavailable as exc:
            rows[policy] = {"unavailable": str(exc)}
            continue
        rows[policy] = {**got.summary(), "dominates_baseline":
                        got.p99_ms <= base.p99_ms and got.kept >= base.kept - KEPT_SLACK}
    return rows


def policies(load: LoadRecord) -> list[str]:
    return list(DAEMON_POLICIES) + [m for m in load.modes if m not in DAEMON_POLICIES]


# ------------------------------------------------------------------ command line


class _Parser(argparse.ArgumentParser):
    def error(self, message: str):  # one line, not the usage block
        self.exit(2, f"{self.prog}: {message} (see --help)\n")


def build_parser() -> argparse.ArgumentParser:
    ap = _Parser(prog="python -m bench.replay", allow_abbrev=False,
                 description="Replay a recorded bench.colocate run under a pacing policy: predicted p99 and "
                             "training kept per load (a design tool, not evidence: see docs/replay.md).")
    ap.add_argument("run", metavar="RUN.json", help="a bench.colocate --json result")
    what = ap.add_mutually_exclusive_group()
    what.add_argument("--policy", default="adaptive",
                      help="adaptive (the daemon's default), pause, free, queue (the default controller told the "
                           "service's queue at each slice request and release), or a recorded mode (default: adaptive)")
    what.add_argument("--reproduce", action="store_true", help="every recorded mode from its own records, "
                      "against what was recorded")
    what.add_argument("--compare", action="store_true", help=f"every daemon policy beside {BASELINE_MODE} as "
                      "recorded, and whether each dominates it (p99 no higher, kept no more than 2 points lower)")
    ap.add_argument("--free-from", default=FREE_MODE, metavar="MODE",
                    help=f"the mode whose records are the trainer running beside a request (default {FREE_MODE}; "
                         "mps-priority: as if pacing cost the trainer nothing while it runs)")
    ap.add_argument("--paused-from", default=PAUSED_MODE, metavar="MODE",
                    help=f"the mode whose records are the trainer paused (default {PAUSED_MODE})")
    ap.add_argument("--slo-ms", type=float, help="the inference session's declared slo_ms")
    ap.add_argument("--json", action="store_true", help="one JSON object on stdout")
    return ap


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        loads = load_run(args.run)
        out: dict = {"run": args.run, "loads": {}}
        for name, load in loads.items():
            if args.reproduce:
                rows = {}
                for mode, record in load.modes.items():
                    got = reproduce(load, mode)
                    rows[mode] = {"recorded_p99_ms": round(record.p99_ms, 3), "replayed_p99_ms": round(got.p99_ms, 3),
                                  "error": round(got.p99_ms / record.p99_ms - 1.0, 5),
                                  "recorded_kept": record.kept, "replayed_kept": _round(got.kept)}
                out["loads"][name] = rows
            elif args.compare:
                out["loads"][name] = compare(load, Sources(args.paused_from, args.free_from), slo_ms=args.slo_ms)
            else:
                got = predict(load, args.policy, Sources(args.paused_from, args.free_from), slo_ms=args.slo_ms)
                out["loads"][name] = {"policy": args.policy, **got.summary()}
    except ReplayError as exc:
        print(f"bench.replay: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(out))
    else:
        for name, rows in out["loads"].items():
            print(f"{name}:")
            for key, row in (rows.items() if args.reproduce or args.compare else [(args.policy, rows)]):
                print(f"  {key:<17} " + "  ".join(f"{k}={v}" for k, v in row.items() if k != "policy"))
    return 0


if __name__ == "__main__":
    sys.exit(main())
