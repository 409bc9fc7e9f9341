"""The placement policies on a real Ray cluster, beside bench.cluster_sim on the same mix.

``examples/ray_policies.py`` runs a small mix of Ray Train jobs and an inference demand that
rises and falls on a local Ray cluster with nodeagent daemons, once per policy, and keeps an
event log of each run. This module is the part of that which needs no Ray:

- :data:`MIX`, the jobs and the demand (:class:`Mix`);
- :func:`metrics`: from a run's event log, the figures :meth:`bench.cluster_engine.Result.summary`
  reports (average and p99 JCT, queueing, inference wait, GPU-seconds harvested from inference
  devices, deadlines met, resizes, preemptions, parks), counted the way the simulator counts them;
- :func:`measured_costs`: what the simulator assumes a move costs (lend to loan node up, Ray Train
  start, grow and shrink, reclaim, park, resume), as this run measured it;
- :func:`simulate`: ``bench.cluster_engine.Simulation`` on the same mix with those costs and the
  jobs' measured throughput;
- :func:`side_by_side`: real and simulated figures with their ratio.

An event log is a list of dicts, each with ``t`` (seconds from the run's start) and ``kind``:

==============  ======================================================================
``submit``      ``job``, ``max_workers``, ``steps``, ``deadline_s`` (from the start; or None)
``progress``    ``job``, ``step``, ``workers``: the job's tracker, sampled
``tracker``     ``job``, ``event`` (start, park, resume, workers_done, finish, ...), ``world_size``
``controller``  ``what`` (lend, loan_node, reclaim, release, resume), ``job``, and the record's fields
``placed``      ``node``, ``wait_ms`` (demand rise to the replica's first grant), ``reclaimed``,
                ``decide_ms`` (ask to the controller's answer, when it reclaimed)
``demand``      ``devices``: inference devices wanted from now
``rates``       ``job``, ``steps_per_s`` (by worker count, as the tracker measured)
``end``         the run is over
==============  ======================================================================
"""

from __future__ import annotations

import statistics
from dataclasses import asdict, dataclass, fields

from bench.cluster_engine import Cluster, Costs, Simulation, _mean, _pct
from bench.cluster_trace import JobSpec, Workload

__all__ = ["COMPARED", "DemandStep", "JobPlan", "MIX", "Mix", "compact", "executed", "measured_costs", "metrics",
           "simulate", "side_by_side"]


@dataclass(frozen=True)
class JobPlan:
    name: str
    submit_s: float
    max_workers: int
    steps: int
    deadline_s: float | None = None  # from the run's start: an SLO job


@dataclass(frozen=True)
class DemandStep:
    """From a moment on, ``devices`` inference devices are wanted. The moment: ``at_s`` from the
    run's start, ``after_s`` after the step before, or once ``job`` has made ``steps`` steps (so
    that the demand meets training however long the jobs took to start on a busy host)."""

    devices: int
    at_s: float | None = None
    after_s: float | None = None
    job: str | None = None
    steps: int | None = None

    def __post_init__(self) -> None:
        given = [self.at_s is not None, self.after_s is not None, self.job is not None and self.steps is not None]
        if sum(given) != 1:
            raise ValueError(f"a demand step needs one of at_s, after_s, or job and steps: {self}")


@dataclass(frozen=True)
class Mix:
    jobs: tuple[JobPlan, ...]
    demand: tuple[DemandStep, ...]
    nodes: int  # inference nodes of one device each; every one may be lent
    step_s: float  # one step's compute on one worker; on n workers step_s / n (a global batch split n ways)

    def nominal_steps_per_s(self, workers: int) -> float:
        return workers / self.step_s


# Three nodes; n1 serves from the start. A two-worker job takes both other devices; a short
# one-worker job arrives while it runs, a second (with a deadline) a little later; inference
# wants a second device for 20 s once the big job is well under way, then none. Today's rule
# keeps both devices on the big job (the short ones queue behind it); the knapsack admits the
# first short job, shrinking the big one, as soon as its last resize is min_resize_interval_s old.
MIX = Mix(
    jobs=(JobPlan("a", 0.0, 2, 700), JobPlan("b", 8.0, 1, 180), JobPlan("c", 16.0, 1, 180, deadline_s=180.0)),
    demand=(DemandStep(1, at_s=0.0), DemandStep(2, job="a", steps=250), DemandStep(1, after_s=20.0),
            DemandStep(0, after_s=20.0)),
    nodes=3,
    step_s=0.06,
)

# What the real run and the simulation compare (summary keys; harvested in GPU-seconds at this scale).
COMPARED = ("jct_avg_s", "jct_p99_s", "queue_avg_s", "inference_wait_p50_ms", "inference_wait_p99_ms",
            "harvested_gpu_s", "deadlines_met", "resizes", "preemptions", "parks")


# ------------------------------------------------------------------ a real run's figures


def _of(log: list[dict], kind: str, **match) -> list[dict]:
    return [e for e in log if e["kind"] == kind and all(e.get(k) == v for k, v in match.items())]


def metrics(log: list[dict]) -> dict:
    """The simulator's summary figures, from a real run's event log.

    JCT is submission to the job's last step (its rank 0 leaving the loop, as the simulator's
    ``complete``); queueing is submission to its first loan node up (the simulator's
    ``first_up``: a worker counted, before Ray Train's start). Harvested GPU-seconds: the
    workers of each interval between two samples in which the job made steps (every device
    here is an inference node's). A placement's wait is the demand's rise to the replica's
    first grant on its device: 0 ms in the simulator when an idle device took it, so here
    too (the replica's own start is not the placement's cost)."""
    submits = {e["job"]: e for e in _of(log, "submit")}
    jobs = []
    for name, sub in submits.items():
        done = _of(log, "tracker", job=name, event="workers_done")
        returned = _of(log, "tracker", job=name, event="finish")
        ups = _of(log, "controller", what="loan_node", job=name)
        finished = done[0]["t"] if done else None
        jobs.append({"name": name, "submit_s": sub["t"], "deadline_s": sub.get("deadline_s"),
                     "finished_s": finished, "jct_s": None if finished is None else finished - sub["t"],
                     "queue_s": min(u["t"] for u in ups) - sub["t"] if ups else None,
                     "returned_s": returned[0]["t"] if returned else None})
    jct = sorted(j["jct_s"] for j in jobs if j["jct_s"] is not None)
    queue = sorted(j["queue_s"] for j in jobs if j["queue_s"] is not None)
    slo = [j for j in jobs if j["deadline_s"] is not None]
    met = [j for j in slo if j["finished_s"] is not None and j["finished_s"] <= j["deadline_s"]]
    placed = _of(log, "placed")
    waits = sorted(p["wait_ms"] if p["reclaimed"] else 0.0 for p in placed)
    harvested = 0.0
    for name in submits:
        samples = _of(log, "progress", job=name)
        for before, after in zip(samples, samples[1:]):
            if after["step"] > before["step"] and after["workers"] > 0:
                harvested += after["workers"] * (after["t"] - before["t"])
    reclaims = _of(log, "controller", what="reclaim")
    teardown = [j["returned_s"] - j["finished_s"] for j in jobs
                if j["returned_s"] is not None and j["finished_s"] is not None]
    end = _of(log, "end")
    return {
        "jobs": len(jobs), "finished": len(jct),
        "jct_avg_s": _mean(jct), "jct_p50_s": _pct(jct, 50), "jct_p99_s": _pct(jct, 99),
        "queue_avg_s": _mean(queue), "queue_p99_s": _pct(queue, 99),
        "jct_s": {j["name"]: None if j["jct_s"] is None else round(j["jct_s"], 1) for j in jobs},
        "queue_s": {j["name"]: None if j["queue_s"] is None else round(j["queue_s"], 1) for j in jobs},
        "slo_jobs": len(slo), "deadlines_met": len(met),
        "deadlines_met_share": round(len(met) / len(slo), 4) if slo else None,
        "inference_placements": len(placed), "inference_reclaims": sum(1 for p in placed if p["reclaimed"]),
        "inference_wait_p50_ms": _pct(waits, 50), "inference_wait_p99_ms": _pct(waits, 99),
        "inference_wait_max_ms": round(waits[-1], 3) if waits else None,
        "harvested_gpu_s": round(harvested, 1),
        "resizes": len(_of(log, "tracker", event="start")),
        "preemptions": sum(1 for r in reclaims if not r.get("reason", "").startswith("inference")
                           and r.get("reason") != "job gone"),
        "parks": sum(1 for r in reclaims if r.get("then") == "park"),
        "fit_returned_after_last_step_avg_s": round(sum(teardown) / len(teardown), 1) if teardown else None,
        "span_s": round(end[-1]["t"], 1) if end else None,
    }


def compact(log: list[dict]) -> list[dict]:
    """The log without the progress samples that repeat a job's step and workers, but for the
    last of each such run (the start of the interval in which it moved again), so that
    :func:`metrics` reads the same figures from it. A job waiting for minutes is sampled four
    times a second; the committed logs keep what changed."""
    out: list[dict] = []
    last: dict[str, tuple] = {}
    held: dict[str, dict] = {}
    for e in log:
        if e["kind"] != "progress":
            out.append(e)
            continue
        state = (e["step"], e["workers"])
        if last.get(e["job"]) == state:
            held[e["job"]] = e
            continue
        if e["job"] in held:
            out.append(held.pop(e["job"]))
        out.append(e)
        last[e["job"]] = state
    return sorted(out + list(held.values()), key=lambda e: e["t"])


def _median(values: list[float]) -> float | None:
    return round(statistics.median(values), 3) if values else None


def _decided_at(rec: dict) -> float:
    """When the controller began a reclaim or release: its record is written once the loan node
    is stopped and Ray has seen it go (``ray_caught_up_ms``, counted from the device free)."""
    back_ms = (rec.get("ray_caught_up_ms") or rec.get("stop_ms") or 0.0) + (rec.get("free_ms") or 0.0)
    return rec["t"] - back_ms / 1000.0


def measured_costs(logs: list[list[dict]]) -> dict:
    """The costs the simulator assumes, each a list of what these runs measured and its median.

    ``loan_node_s``: a lend to its loan node up (the controller's ``lend_to_node_ms``).
    ``start_s``: a job's first loan node up to its first worker group started. After that, each
    restart of the group (Ray Train restarts the whole group on any change) counts from what
    caused it, the first loss or gain of a loan since the group before started: ``shrink_s`` when
    the first was a loss (a reclaim or release, not the job's end), ``grow_s`` when it was a gain
    (a loan node up); a restart with no cause since the group before (a node that came up while
    that group was starting) counts from that group's start, as the size changed. A shrink that a
    grow overtakes before the smaller group starts is one restart, counted as a shrink.
    ``reclaim_ms``: the daemon's reclaim, to the device free (``free_ms``); ``inference_reclaim_ms``
    those for inference, ``park_ms`` those that parked the job's last worker; ``resume_ms``: a
    parked worker resumed in-process. ``decide_ms``: a serving layer's ask to the controller's
    answer (which loan it takes)."""
    out: dict[str, list[float]] = {k: [] for k in ("loan_node_s", "start_s", "grow_s", "shrink_s", "reclaim_ms",
                                                   "inference_reclaim_ms", "park_ms", "resume_ms", "decide_ms")}
    for log in logs:
        ctl = _of(log, "controller")
        reclaims = [r for r in ctl if r["what"] == "reclaim"]
        out["loan_node_s"] += [r["lend_to_node_ms"] / 1000.0 for r in ctl if r["what"] == "loan_node"]
        out["reclaim_ms"] += [r["free_ms"] for r in reclaims]
        out["inference_reclaim_ms"] += [r["free_ms"] for r in reclaims
                                        if r.get("reason", "").startswith("inference")]
        out["park_ms"] += [r["free_ms"] for r in reclaims if r.get("then") == "park"]
        out["resume_ms"] += [r["resume_ms"] for r in ctl if r["what"] == "resume"]
        out["decide_ms"] += [p["decide_ms"] for p in _of(log, "placed") if p.get("decide_ms") is not None]
        for name in {e["job"] for e in _of(log, "submit")}:
            starts = _of(log, "tracker", job=name, event="start")
            ups = [r["t"] for r in ctl if r["what"] == "loan_node" and r.get("job") == name]
            downs = [_decided_at(r) for r in ctl if r["what"] in ("reclaim", "release") and r.get("job") == name
                     and r.get("reason") != "job gone"]
            if starts:
                first = [t for t in ups if t <= starts[0]["t"]]
                if first:
                    out["start_s"].append(starts[0]["t"] - max(first))
            for prev, start in zip(starts, starts[1:]):
                causes = sorted([(t, "shrink_s") for t in downs if prev["t"] < t <= start["t"]]
                                + [(t, "grow_s") for t in ups if prev["t"] < t <= start["t"]])
                if causes:
                    out[causes[0][1]].append(start["t"] - causes[0][0])
                elif start["world_size"] != prev["world_size"]:
                    out["grow_s" if start["world_size"] > prev["world_size"] else "shrink_s"].append(
                        start["t"] - prev["t"])
    return {k: {"median": _median(v), "all": [round(x, 3) for x in v]} for k, v in out.items()}


def sim_costs(measured: dict, protect_s: float) -> Costs:
    """The simulator's :class:`Costs` from :func:`measured_costs` (medians; the default where a
    cost was not seen). Inference's wait for a reclaimed device is the controller's decision plus
    the daemon's reclaims for inference (``free_ms``, which includes the park of this run's small
    state), so the park's own rate is left out (``park_gb_per_s`` so high that it adds nothing)."""
    m = {k: v["median"] for k, v in measured.items()}
    base = Costs()
    pick = {"grow_s": m["grow_s"], "shrink_s": m["shrink_s"], "start_s": m["start_s"],
            "loan_node_s": m["loan_node_s"], "reclaim_base_ms": m["inference_reclaim_ms"],
            "controller_ms": m["decide_ms"],
            "resume_ms": m["resume_ms"]}
    return Costs(**{f.name: getattr(base, f.name) for f in fields(Costs)}
                 | {k: v for k, v in pick.items() if v is not None}
                 | {"park_gb_per_s": 1e9, "protect_s": protect_s})


def pooled_rates(logs: list[list[dict]], base_name=lambda job: job) -> dict[str, dict[int, float]]:
    """Each job's measured steps per second by worker count, averaged over the runs (jobs named
    apart per run: ``base_name`` maps a run's job name to the mix's)."""
    seen: dict[str, dict[int, list[float]]] = {}
    for log in logs:
        for e in _of(log, "rates"):
            for n, v in e["steps_per_s"].items():
                seen.setdefault(base_name(e["job"]), {}).setdefault(int(n), []).append(float(v))
    return {job: {n: sum(v) / len(v) for n, v in sorted(by_n.items())} for job, by_n in seen.items()}


def _curve(mix: Mix, measured: dict[int, float], max_workers: int) -> tuple[float, ...]:
    """Steps per second at 1..max_workers: measured, else scaled from the nearest measured count,
    else nominal."""
    out = []
    for n in range(1, max_workers + 1):
        if n in measured:
            out.append(measured[n])
        elif measured:
            m = min(measured, key=lambda k: abs(k - n))
            out.append(measured[m] * n / m)
        else:
            out.append(mix.nominal_steps_per_s(n))
    return tuple(out)


def executed(log: list[dict]) -> tuple[dict[str, float], tuple[tuple[float, int], ...]]:
    """When a run submitted each job, and the demand as it changed: what the simulator replays."""
    submits = {e["job"]: e["t"] for e in _of(log, "submit")}
    return submits, tuple((e["t"], e["devices"]) for e in _of(log, "demand"))


def workload(mix: Mix, rates: dict[str, dict[int, float]], demand: tuple[tuple[float, int], ...],
             submits: dict[str, float] | None = None) -> Workload:
    submits = submits or {}
    jobs = tuple(JobSpec(j.name, submits.get(j.name, j.submit_s), j.max_workers, j.steps,
                         _curve(mix, rates.get(j.name, {}), j.max_workers), application="ray_policies",
                         deadline_s=j.deadline_s, state_mb=0.1) for j in mix.jobs)
    return Workload(jobs, demand, "examples/ray_policies.py mix", mix.nodes)


def simulate(mix: Mix, policy: str, options: dict, costs: Costs, rates: dict[str, dict[int, float]],
             demand: tuple[tuple[float, int], ...], submits: dict[str, float] | None = None,
             tick_s: float = 1.0) -> dict:
    """bench.cluster_engine on the mix as a run executed it (``demand``: (second, devices wanted);
    ``submits``: each job's submission, else the plan's): the same ``decide()``, the measured costs
    and throughput. The summary, with GPU-seconds harvested (its GPU-hours are too coarse here)."""
    from nodeagent_ray.policy import PolicyConfig
    sim = Simulation(workload(mix, rates, demand, submits), PolicyConfig(name=policy, options=options),
                     cluster=Cluster(training_nodes=0, inference_nodes=mix.nodes, gpus_per_node=1, lending=True),
                     costs=costs, tick_s=tick_s, max_s=3600.0)
    result = sim.run()
    summary = result.summary()
    summary["harvested_gpu_s"] = round(result.harvested_gpu_s, 1)
    summary["jct_s"] = {j["name"]: None if j["jct_s"] is None else round(j["jct_s"], 1) for j in result.jobs}
    summary["queue_s"] = {j["name"]: None if j["queue_s"] is None else round(j["queue_s"], 1) for j in result.jobs}
    summary["costs"] = asdict(costs)
    return summary


def side_by_side(real: dict, sim: dict, keys: tuple[str, ...] = COMPARED) -> dict:
    """{key: {"real", "sim", "ratio"}}: ratio real / sim, None where either is missing or sim is 0
    (then equal figures say ``"same"``)."""
    out = {}
    for k in keys:
        r, s = real.get(k), sim.get(k)
        numbers = isinstance(r, (int, float)) and isinstance(s, (int, float))
        ratio = round(r / s, 2) if numbers and s != 0 else ("same" if numbers and r == s else None)
        out[k] = {"real": r, "sim": s, "ratio": ratio}
    return out
