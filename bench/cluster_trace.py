"""The workloads bench.cluster_sim runs: training jobs and an inference demand curve.

Two sources:

- :func:`generate`, the shipped workload, with the published shape and no download:
  job arrivals Poisson over ``hours``; each job's GPU time drawn from the buckets of the
  Microsoft Philly trace as Pollux's simulator filters it (jobs of at least 60 s and under
  1,000 GPU-hours: 74.6% under 1 GPU-hour, 18.6% 1-10, 4.8% 10-100, 2.1% 100-1,000; each
  bucket gets exactly its share, so seeds differ in which jobs come when, not in how many
  big ones there are), log-uniform inside a bucket (at most ``max_gpu_h``); the kind of job
  by bucket, as Pollux's generator maps them
  (small: cifar10 or ncf, medium: deepspeech2 or bert, large: yolov3, xlarge: imagenet),
  each asking for the worker counts that kind scales to; a share of the jobs given a
  deadline (SLO jobs). The inference demand is a day/night curve over the inference pool
  (mean utilisation ``demand_mean``, under 40% as Aryl found in production).
- :func:`read_trace`, the job-trace format of the Pollux simulator
  (petuum/adaptdl ``simulator/workloads*/*.csv``: ``name,time,application,num_replicas,
  batch_size``) and of DeepBoot's, which adds ``duration,num_task`` and inference rows
  (``application`` ``infer-<model>-<n>``, one GPU each for ``duration`` seconds). Job lengths
  and throughput come from the simulator's ``traces/<application>/`` folder when given
  (``placements.csv``: step time per placement and local batch size; ``validation-<batch>.csv``:
  iterations per epoch; ``scalability.csv``), else from this module's profile of that
  application.

Times are seconds from the start of the trace; throughput is steps per second per worker
count, the signal a job's tracker reports (``JobView.steps_per_s``).
"""

from __future__ import annotations

import bisect
import csv
import glob
import math
import os
import random
from dataclasses import dataclass

DAY_S = 86400.0


@dataclass(frozen=True)
class JobSpec:
    """One training job of a trace."""

    name: str
    submit_s: float
    max_workers: int  # the workers it asks for; elastic policies may run it on fewer
    steps: int  # its whole length
    steps_per_s: tuple[float, ...]  # [n - 1]: steps per second on n workers, n = 1..max_workers
    application: str = ""
    deadline_s: float | None = None  # set: an SLO job
    state_mb: float = 200.0  # parameters, gradients and optimizer state: what a park copies

    def __post_init__(self) -> None:
        if self.max_workers < 1 or len(self.steps_per_s) != self.max_workers:
            raise ValueError(f"job {self.name}: steps_per_s needs one value per worker count 1..{self.max_workers}")
        if self.steps < 1 or any(not (math.isfinite(v) and v > 0) for v in self.steps_per_s):
            raise ValueError(f"job {self.name}: steps and every steps_per_s must be > 0")

    @property
    def gpu_s(self) -> float:
        """GPU-seconds it takes on the workers it asks for (the Philly trace's measure of size)."""
        return self.steps / self.steps_per_s[-1] * self.max_workers


@dataclass(frozen=True)
class Workload:
    jobs: tuple[JobSpec, ...]
    demand: tuple[tuple[float, int], ...]  # (from this time, inference devices wanted), times increasing
    source: str
    inference_devices: int  # the pool the demand is a share of

    def demand_at(self, t: float) -> int:
        i = bisect.bisect_right([d[0] for d in self.demand], t) - 1
        return self.demand[i][1] if i >= 0 else 0


# ------------------------------------------------------------------ the kinds of job


@dataclass(frozen=True)
class Profile:
    """A kind of training job: how it scales and how much state it parks. Shaped like the six
    applications of Pollux's simulator (its measured placements, not reproduced here, show the
    same order: ncf does not scale, imagenet scales furthest)."""

    name: str
    sizes: tuple[int, ...]  # the worker counts jobs of this kind ask for
    step_s: float  # one step on one worker
    comm: float  # scaling loss per extra worker: speedup(n) = n / (1 + comm * (n - 1))
    state_mb: float
    median_gpu_h: float  # a job's size when a trace names the kind but gives no length

    def steps_per_s(self, workers: int) -> tuple[float, ...]:
        return tuple(n / (1.0 + self.comm * (n - 1)) / self.step_s for n in range(1, workers + 1))


PROFILES = {p.name: p for p in (
    Profile("cifar10", (1, 2, 4), 0.06, 0.15, 180.0, 0.25),
    Profile("ncf", (1,), 0.03, 0.9, 100.0, 0.1),
    Profile("deepspeech2", (2, 4, 8), 0.4, 0.08, 300.0, 3.0),
    Profile("bert", (4, 8), 0.9, 0.06, 1300.0, 4.0),
    Profile("yolov3", (4, 8), 0.6, 0.05, 950.0, 30.0),
    Profile("imagenet", (8, 16), 0.35, 0.03, 400.0, 200.0),
)}

# (share of jobs, GPU-hours from, to, kinds): Philly's buckets as Pollux's generator filters them
BUCKETS = (
    (0.746, 1.0 / 60.0, 1.0, ("cifar10", "ncf")),
    (0.186, 1.0, 10.0, ("deepspeech2", "bert")),
    (0.048, 10.0, 100.0, ("yolov3",)),
    (0.021, 100.0, 1000.0, ("imagenet",)),
)


def bucket_of(gpu_s: float) -> str:
    """small / medium / large / xlarge, by GPU-hours (the Philly buckets)."""
    hours = gpu_s / 3600.0
    return "small" if hours < 1 else "medium" if hours < 10 else "large" if hours < 100 else "xlarge"


# ------------------------------------------------------------------ the generator


def day_night(hours: float, devices: int, *, mean: float = 0.35, swing: float = 0.25, noise: float = 0.05,
              peak_hour: float = 14.0, step_s: float = 300.0, seed: int = 0) -> tuple[tuple[float, int], ...]:
    """Inference devices wanted, every ``step_s``: ``mean`` + ``swing`` x cos(peak at ``peak_hour``)
    + gaussian ``noise``, a share of ``devices``."""
    rng = random.Random(seed * 7919 + 17)
    out = []
    for k in range(int(math.ceil(hours * 3600.0 / step_s)) + 1):
        t = k * step_s
        share = mean + swing * math.cos(2 * math.pi * (t - peak_hour * 3600.0) / DAY_S) + rng.gauss(0.0, noise)
        out.append((t, max(0, min(devices, round(share * devices)))))
    return tuple(out)


def generate(*, jobs: int = 96, hours: float = 24.0, seed: int = 0, inference_devices: int = 32,
             demand_hours: float | None = None, slo_fraction: float = 0.25, slack: tuple[float, float] = (1.5, 3.0),
             max_gpu_h: float = 400.0, demand_mean: float = 0.35) -> Workload:
    """The shipped workload (module docstring). ``demand_hours``: how long the demand curve runs
    (default: the arrivals' ``hours`` plus three days, for the jobs that run on)."""
    rng = random.Random(seed)
    # Stratified: each bucket gets its share of the jobs (rounded), in a random order, so that
    # seeds differ in which jobs come when and how long each is, not in how many big ones there are.
    counts = [round(share * jobs) for share, *_ in BUCKETS]
    counts[0] += jobs - sum(counts)
    kinds_of = [b for b, n in zip(BUCKETS, counts) for _ in range(n)]
    rng.shuffle(kinds_of)
    specs = []
    t = 0.0
    rate = jobs / (hours * 3600.0)
    for i in range(jobs):
        t += rng.expovariate(rate) if i else rng.uniform(0, 1.0 / rate)
        _, lo, hi, kinds = kinds_of[i]
        gpu_h = math.exp(rng.uniform(math.log(lo), math.log(min(hi, max_gpu_h))))
        profile = PROFILES[rng.choice(kinds)]
        size = rng.choice(profile.sizes)
        curve = profile.steps_per_s(size)
        duration_s = gpu_h * 3600.0 / size
        steps = max(1, round(duration_s * curve[-1]))
        deadline = None
        if rng.random() < slo_fraction:
            deadline = t + rng.uniform(*slack) * duration_s
        specs.append(JobSpec(f"{profile.name}-{i}", round(t, 3), size, steps, curve, profile.name,
                             None if deadline is None else round(deadline, 3), profile.state_mb))
    demand = day_night(demand_hours if demand_hours is not None else hours + 72.0, inference_devices,
                       mean=demand_mean, seed=seed)
    return Workload(tuple(specs), demand, f"generated: {jobs} jobs over {hours:g} h, seed {seed}", inference_devices)


# ------------------------------------------------------------------ the Pollux / DeepBoot trace format

# Pollux's simulator trains each application for this many epochs (simulator/applications.py).
POLLUX_EPOCHS = {"bert": 2, "cifar10": 100, "ncf": 10, "imagenet": 90, "deepspeech2": 80, "yolov3": 50}


class TraceError(ValueError):
    """A trace or its application folder could not be read; the message says which file and why."""


def _rows(path: str) -> list[dict[str, str]]:
    try:
        with open(path, newline="", encoding="utf-8") as f:
            return list(csv.DictReader(f))
    except OSError as exc:
        raise TraceError(f"{path}: {exc.strerror or exc}") from None


def _float(row: dict[str, str], key: str, path: str) -> float:
    try:
        value = float(row[key])
    except (KeyError, TypeError, ValueError):
        raise TraceError(f"{path}: row {row!r} has no number in column {key!r}") from None
    if not math.isfinite(value):
        raise TraceError(f"{path}: column {key!r} is not finite in row {row!r}")
    return value


def _interp(xs: list[float], ys: list[float], x: float) -> float:
    """Linear inside, clamped outside."""
    if x <= xs[0]:
        return ys[0]
    if x >= xs[-1]:
        return ys[-1]
    i = bisect.bisect_right(xs, x)
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 + (y1 - y0) * (x - x0) / (x1 - x0)


class Application:
    """One application folder of the Pollux simulator's traces."""

    def __init__(self, folder: str, epochs: int | None = None, gpus_per_node: int = 4) -> None:
        self.name = os.path.basename(os.path.normpath(folder))
        self.gpus_per_node = gpus_per_node
        placements = os.path.join(folder, "placements.csv")
        self._by_placement: dict[str, list[tuple[float, float, float]]] = {}
        for row in _rows(placements):
            key = str(row.get("placement", "")).strip()
            if not key.isdigit():
                raise TraceError(f"{placements}: placement {key!r} is not a string of GPUs per node")
            self._by_placement.setdefault(key, []).append(
                (_float(row, "local_bsz", placements), _float(row, "step_time", placements),
                 _float(row, "sync_time", placements)))
        if not self._by_placement:
            raise TraceError(f"{placements}: no rows")
        for rows in self._by_placement.values():
            rows.sort()
        self._scalability: dict[int, list[tuple[float, float, float]]] = {}
        path = os.path.join(folder, "scalability.csv")
        if os.path.exists(path):
            for row in _rows(path):
                self._scalability.setdefault(int(_float(row, "num_replicas", path)), []).append(
                    (_float(row, "local_bsz", path), _float(row, "step_time", path), _float(row, "sync_time", path)))
            for rows in self._scalability.values():
                rows.sort()
        local = [b for rows in self._by_placement.values() for b, _, _ in rows]
        self.min_local_bsz, self.max_local_bsz = min(local), max(local)
        self._iterations: dict[int, list[float]] = {}
        for path in glob.glob(os.path.join(folder, "validation-*.csv")):
            try:
                batch = int(os.path.basename(path)[len("validation-"):-len(".csv")])
            except ValueError:
                continue
            self._iterations[batch] = [_float(row, "iteration", path) for row in _rows(path)]
        if not self._iterations:
            raise TraceError(f"{folder}: no validation-<batch>.csv (iterations per epoch)")
        self.epochs = epochs or POLLUX_EPOCHS.get(self.name) or min(map(len, self._iterations.values()))

    def _step(self, rows: list[tuple[float, float, float]], local_bsz: float) -> tuple[float, float]:
        xs = [r[0] for r in rows]
        return _interp(xs, [r[1] for r in rows], local_bsz), _interp(xs, [r[2] for r in rows], local_bsz)

    def step_time(self, workers: int, batch_size: int) -> float | None:
        """Seconds per step of the whole batch on ``workers`` packed ``gpus_per_node`` a node, with
        gradient accumulation where a worker's share is above the largest measured; None when a
        worker's share is below the smallest measured (too many workers for this batch)."""
        local = math.ceil(batch_size / workers - 1e-8)
        if local < self.min_local_bsz:
            return None
        accum = math.ceil(local / self.max_local_bsz - 1e-8) - 1
        atomic = math.ceil(local / (accum + 1) - 1e-8)
        nodes = []
        left = workers
        while left > 0:
            nodes.append(min(left, self.gpus_per_node))
            left -= nodes[-1]
        key = min("".join(map(str, nodes[i:] + nodes[:i])) for i in range(len(nodes)))
        rows = self._by_placement.get(key)
        if rows is None:  # not measured: the nearest measured worker count (its most packed placement)
            counts = sorted(set(self._scalability) | {sum(map(int, k)) for k in self._by_placement})
            near = min(counts, key=lambda c: (abs(c - workers), c))
            rows = self._scalability.get(near) or self._by_placement[min(
                (k for k in self._by_placement if sum(map(int, k)) == near), key=lambda k: (len(k), k))]
        step, sync = self._step(rows, atomic)
        return step + accum * (step - sync)

    def iterations(self, batch_size: int) -> float:
        """Steps to train ``epochs`` epochs at ``batch_size`` (interpolated between measured batches)."""
        batches = sorted(self._iterations)
        per = [self._iterations[b][min(self.epochs, len(self._iterations[b])) - 1] for b in batches]
        return _interp([float(b) for b in batches], per, float(batch_size))


def read_trace(path: str, traces_dir: str | None = None, *, gpus_per_node: int = 4, demand: str = "auto",
               inference_devices: int = 32, epochs: dict[str, int] | None = None, seed: int = 0,
               slo_fraction: float = 0.0, slack: tuple[float, float] = (1.5, 3.0)) -> Workload:
    """A Pollux or DeepBoot workload CSV as a :class:`Workload`. ``demand``: "trace" (the inference
    rows), "generated" (the day/night curve), "none", or "auto" (the rows if there are any, else
    the curve). ``slo_fraction``: give that share of the jobs a deadline (the formats have none)."""
    rows = _rows(path)
    if not rows:
        raise TraceError(f"{path}: no rows")
    missing = {"name", "time", "application", "num_replicas", "batch_size"} - set(rows[0])
    if missing:
        raise TraceError(f"{path}: no column {', '.join(sorted(missing))} (want name,time,application,"
                         "num_replicas,batch_size[,duration,num_task])")
    apps: dict[str, Application | None] = {}
    rng = random.Random(seed)
    jobs: list[JobSpec] = []
    tasks: list[tuple[float, float]] = []
    for row in rows:
        app = row["application"].strip()
        t = _float(row, "time", path)
        if app.startswith("infer"):
            tasks.append((t, max(1.0, _float(row, "duration", path)) if row.get("duration") else 60.0))
            continue
        replicas = int(_float(row, "num_replicas", path))
        batch = int(_float(row, "batch_size", path))
        if replicas < 1 or batch < 1:
            raise TraceError(f"{path}: job {row['name']!r} asks for {replicas} replicas of batch {batch}")
        if app not in apps:
            folder = os.path.join(traces_dir, app) if traces_dir else None
            apps[app] = (Application(folder, (epochs or {}).get(app), gpus_per_node)
                         if folder and os.path.isdir(folder) else None)
        measured = apps[app]
        profile = PROFILES.get(app)
        if measured is not None:
            times = [measured.step_time(n, batch) for n in range(1, replicas + 1)]
            usable = [1.0 / s for s in times if s is not None and s > 0]
            curve = tuple(usable[:next((i for i, s in enumerate(times) if s is None), len(times))]) or (1.0,)
            steps = max(1, round(measured.iterations(batch)))
        elif profile is not None:
            curve = profile.steps_per_s(replicas)
            steps = max(1, round(profile.median_gpu_h * 3600.0 / replicas * curve[-1]))
        else:
            raise TraceError(f"{path}: application {app!r} has no folder under {traces_dir or '(no --trace-dir)'} "
                             f"and no built-in profile ({', '.join(PROFILES)})")
        deadline = None
        if slo_fraction > 0 and rng.random() < slo_fraction:
            deadline = t + rng.uniform(*slack) * steps / curve[-1]
        jobs.append(JobSpec(row["name"], t, len(curve), steps, curve, app, deadline,
                            profile.state_mb if profile else 200.0))
    jobs.sort(key=lambda j: (j.submit_s, j.name))
    last = max([j.submit_s for j in jobs] + [s + d for s, d in tasks] + [0.0])
    if demand == "auto":
        demand = "trace" if tasks else "generated"
    if demand == "trace":
        curve_points = _tasks_to_demand(tasks, inference_devices)
    elif demand == "generated":
        curve_points = day_night(last / 3600.0 + 72.0, inference_devices, seed=seed)
    elif demand == "none":
        curve_points = ((0.0, 0),)
    else:
        raise ValueError(f"demand must be auto, trace, generated or none, got {demand!r}")
    return Workload(tuple(jobs), curve_points, f"{os.path.basename(path)} ({len(jobs)} jobs, {len(tasks)} "
                    f"inference tasks, demand {demand})", inference_devices)


def _tasks_to_demand(tasks: list[tuple[float, float]], devices: int) -> tuple[tuple[float, int], ...]:
    """Inference tasks (start, seconds) as devices wanted over time, at most ``devices``."""
    edges: dict[float, int] = {}
    for start, seconds in tasks:
        edges[start] = edges.get(start, 0) + 1
        edges[start + seconds] = edges.get(start + seconds, 0) - 1
    out, level = [(0.0, 0)], 0
    for t in sorted(edges):
        level += edges[t]
        out.append((t, min(devices, level)))
    return tuple(out)
