"""Trace-driven cluster simulation: the controller's placement policies, side by side.

Each policy of nodeagent_ray.policies (the same ``decide()`` the Ray controller runs)
places a job trace on a cluster of dedicated training nodes and inference nodes whose
idle devices may be lent, with and without lending, under an inference demand curve;
resizes, reclaims and parks cost what nodeagent measured (bench/cluster_engine.py says
what is modelled and from what). Reported per run: average and p99 JCT, queueing time
(submission to the first worker up), JCT by job size, deadlines met (SLO jobs),
inference wait p50/p99 (a replica's wait for a device: 0 when one was idle, else the
controller's reclaim), GPU-hours harvested from inference (training steps taken on
inference devices); then the papers' comparisons, each paper's figure beside ours.

The workload is generated (Philly-shaped jobs, a day/night inference curve; see
bench/cluster_trace.py) unless --trace names a Pollux or DeepBoot workload CSV, with
--trace-dir its simulator's traces/ folder for measured throughput and job lengths.
--seeds runs several generated workloads; the comparisons use the mean over seeds.

example: python -m bench.cluster_sim --json --out /tmp/sim.json
         python -m bench.cluster_sim --small --json                  (CI: a few seconds)
         python -m bench.cluster_sim --trace workload-6.csv --trace-dir traces/ --policies knapsack,tiresias

exit status: 0 every run finished; 1 a run failed or left jobs unfinished at --max-days;
2 bad arguments or an unreadable trace.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing as mp
import os
import platform
import sys
import time
from dataclasses import asdict, fields, replace

from bench.cluster_engine import Cluster, Costs, Simulation
from bench.cluster_trace import TraceError, Workload, bucket_of, generate, read_trace
from nodeagent_ray.policies import POLICIES, make_policy
from nodeagent_ray.policy import PolicyConfig

POLICY_ORDER = ("max-workers", "fifo", "tiresias", "knapsack", "deadline")
MEANS = ("jct_avg_s", "jct_p50_s", "jct_p99_s", "queue_avg_s", "queue_p99_s", "best_effort_jct_avg_s",
         "deadlines_met_share", "inference_wait_p50_ms", "inference_wait_p99_ms", "inference_utilisation",
         "harvested_gpu_h", "lent_inference_gpu_h", "resizes", "preemptions", "parks", "finished", "jobs",
         "slo_jobs", "deadlines_met", "inference_placements", "inference_reclaims", "span_h", "decide_ms_avg")


def log(message: str) -> None:
    print(f"[cluster_sim] {message}", file=sys.stderr, flush=True)


def label(policy: str, lending: bool) -> str:
    return f"{policy}/{'lend' if lending else 'no-lend'}"


# ------------------------------------------------------------------ running


def _run(task: tuple) -> tuple[str, int, dict]:
    workload, policy, options, lending, cluster, costs, tick_s, max_s = task
    started = time.perf_counter()
    sim = Simulation(workload, PolicyConfig(name=policy, options=options), cluster=replace(cluster, lending=lending),
                     costs=costs, tick_s=tick_s, max_s=max_s, clock=time.perf_counter)
    summary = sim.run().summary()
    summary["wall_s"] = round(time.perf_counter() - started, 2)
    return label(policy, lending), summary


def run_all(workloads: dict[int, Workload], policies: list[str], options: dict[str, dict], lendings: list[bool],
            cluster: Cluster, costs: Costs, tick_s: float, max_s: float, processes: int) -> dict:
    """Every (seed, policy, lending); returns {label: {"seeds": {seed: summary}, "mean": {...}}}."""
    tasks = [(seed, (w, p, options.get(p, {}), lend, cluster, costs, tick_s, max_s))
             for seed, w in workloads.items() for p in policies for lend in lendings]
    out: dict[str, dict] = {}
    results = []
    if processes > 1 and len(tasks) > 1:
        with mp.get_context("fork").Pool(processes) as pool:
            for (seed, _), (name, summary) in zip(tasks, pool.imap(_run, [t for _, t in tasks])):
                results.append((seed, name, summary))
                log(f"seed {seed} {name}: JCT {summary['jct_avg_s']} s, queue {summary['queue_avg_s']} s "
                    f"({summary['wall_s']} s)")
    else:
        for seed, task in tasks:
            name, summary = _run(task)
            results.append((seed, name, summary))
            log(f"seed {seed} {name}: JCT {summary['jct_avg_s']} s, queue {summary['queue_avg_s']} s "
                f"({summary['wall_s']} s)")
    for seed, name, summary in results:
        out.setdefault(name, {"seeds": {}})["seeds"][str(seed)] = summary
    for name, entry in out.items():
        entry["mean"] = mean_of(list(entry["seeds"].values()))
    ordered = sorted(out, key=lambda k: (POLICY_ORDER.index(k.split("/")[0]) if k.split("/")[0] in POLICY_ORDER
                                         else 99, k.endswith("no-lend")))
    return {k: out[k] for k in ordered}


def mean_of(summaries: list[dict]) -> dict:
    """The mean of each headline number over seeds (None where a seed has none); JCT by bucket too."""
    mean: dict = {}
    for key in MEANS:
        values = [s[key] for s in summaries if isinstance(s.get(key), (int, float))]
        mean[key] = round(sum(values) / len(values), 4) if values else None
    buckets: dict[str, list[float]] = {}
    for s in summaries:
        for b, v in (s.get("jct_by_bucket_avg_s") or {}).items():
            if v is not None:
                buckets.setdefault(b, []).append(v)
    mean["jct_by_bucket_avg_s"] = {b: round(sum(v) / len(v), 1) for b, v in buckets.items()}
    return mean


# ------------------------------------------------------------------ the papers' comparisons


def _ratio(a, b) -> float | None:
    return round(a / b, 3) if isinstance(a, (int, float)) and isinstance(b, (int, float)) and b > 0 else None


def _change(new, old) -> float | None:
    """Percent change from ``old`` to ``new`` (negative: lower)."""
    return round((new - old) / old * 100.0, 1) if isinstance(new, (int, float)) and isinstance(old, (int, float)) \
        and old > 0 else None


def comparisons(runs: dict) -> list[dict]:
    """Each published claim against the runs that test it (means over seeds); absent runs are skipped."""
    m = {name: entry["mean"] for name, entry in runs.items()}
    out: list[dict] = []

    def have(*names: str) -> bool:
        return all(n in m for n in names)

    if have("knapsack/lend", "fifo/no-lend"):
        ours, base = m["knapsack/lend"], m["fifo/no-lend"]
        out.append({"paper": "Aryl (Li et al., arXiv:2202.07896)", "ours": "knapsack/lend", "against": "fifo/no-lend",
                    "claim": "capacity loaning and elastic scaling, against a scheduler with neither: "
                             "1.50x lower average JCT, 1.53x lower average queueing",
                    "paper_jct_ratio": 1.50, "paper_queue_ratio": 1.53,
                    "jct_ratio": _ratio(base["jct_avg_s"], ours["jct_avg_s"]),
                    "queue_ratio": _ratio(base["queue_avg_s"], ours["queue_avg_s"]),
                    "baseline_queue_avg_s": base["queue_avg_s"]})
    for against in ("tiresias/lend", "fifo/lend", "max-workers/lend"):
        if have("knapsack/lend", against):
            out.append({"paper": "DeepBoot (Chen et al., IEEE TPDS 34(9), 2023)", "ours": "knapsack/lend",
                        "against": against,
                        "claim": "average JCT 32% (testbed) and 38% (simulation) lower than Optimus, Tiresias, AFS "
                                 "and Pollux, on a cluster lending idle inference GPUs",
                        "paper_jct_change_pct": [-32.0, -38.0],
                        "jct_change_pct": _change(m["knapsack/lend"]["jct_avg_s"], m[against]["jct_avg_s"]),
                        "queue_change_pct": _change(m["knapsack/lend"]["queue_avg_s"], m[against]["queue_avg_s"])})
    for against in ("tiresias/no-lend", "fifo/no-lend"):
        if have("knapsack/no-lend", against):
            out.append({"paper": "Pollux (Qiao et al., OSDI'21)", "ours": "knapsack/no-lend", "against": against,
                        "claim": "average JCT 37-50% lower than Optimus+Oracle and Tiresias (no lending)",
                        "paper_jct_change_pct": [-37.0, -50.0],
                        "jct_change_pct": _change(m["knapsack/no-lend"]["jct_avg_s"], m[against]["jct_avg_s"])})
    if have("knapsack/lend", "max-workers/lend", "knapsack/no-lend"):
        row = {"paper": "issue 25", "ours": "knapsack/lend", "against": "max-workers/lend, knapsack/no-lend",
               "claim": "knapsack lending against today's rule (furthest below max_workers) and against no lending"}
        for name in ("knapsack/lend", "max-workers/lend", "knapsack/no-lend", "max-workers/no-lend"):
            if name in m:
                row[name] = {k: m[name][k] for k in ("jct_avg_s", "jct_p99_s", "queue_avg_s", "harvested_gpu_h",
                                                      "inference_wait_p99_ms")}
        out.append(row)
    for lend in ("no-lend", "lend"):
        t, f = f"tiresias/{lend}", f"fifo/{lend}"
        if have(t, f):
            small_t = (m[t]["jct_by_bucket_avg_s"] or {}).get("small")
            small_f = (m[f]["jct_by_bucket_avg_s"] or {}).get("small")
            out.append({"paper": "Tiresias (Gu et al., NSDI'19)", "ours": t, "against": f,
                        "claim": "2D attained service finishes short jobs first without knowing job lengths; "
                                 "average JCT up to 5.5x lower than YARN-CS (FIFO)",
                        "paper_jct_ratio": 5.5,
                        "jct_ratio": _ratio(m[f]["jct_avg_s"], m[t]["jct_avg_s"]),
                        "small_jobs_jct_ratio": _ratio(small_f, small_t),
                        "jct_by_bucket_avg_s": {t: m[t]["jct_by_bucket_avg_s"], f: m[f]["jct_by_bucket_avg_s"]}})
    for lend in ("lend", "no-lend"):
        d = f"deadline/{lend}"
        if d not in m:
            continue
        others = [n for n in m if n.endswith("/" + lend) and n != d]
        row = {"paper": "Chronus (Gao et al., SoCC'21)", "ours": d, "against": ", ".join(others),
               "claim": "deadline-aware admission with leases: deadline misses up to 14.7x fewer, best-effort JCT "
                        "up to 19.9x lower than existing schedulers",
               "paper_miss_ratio": 14.7, "deadlines_met_share": {n: m[n]["deadlines_met_share"] for n in [d, *others]},
               "deadlines_missed": {n: None if m[n]["slo_jobs"] is None else round(m[n]["slo_jobs"] - m[n]["deadlines_met"], 2)
                                    for n in [d, *others]},
               "best_effort_jct_avg_s": {n: m[n]["best_effort_jct_avg_s"] for n in [d, *others]}}
        miss = 1 - (m[d]["deadlines_met_share"] or 0)
        row["miss_ratio"] = {n: _ratio(1 - (m[n]["deadlines_met_share"] or 0), miss) if miss > 0 else None
                             for n in others}
        out.append(row)
    return out


# ------------------------------------------------------------------ the command line


def _floats(text: str, n: int) -> tuple[float, ...]:
    parts = tuple(float(x) for x in text.split(","))
    if len(parts) != n:
        raise argparse.ArgumentTypeError(f"want {n} comma-separated numbers, got {text!r}")
    return parts


def _options(pairs: list[str], policies: list[str]) -> dict[str, dict]:
    """--option knapsack.resize_s=5 -> {"knapsack": {"resize_s": 5.0}}, checked by make_policy."""
    out: dict[str, dict] = {}
    for pair in pairs:
        key, _, value = pair.partition("=")
        policy, _, field_name = key.partition(".")
        if not value or not field_name or policy not in POLICIES:
            raise ValueError(f"--option {pair!r}: want POLICY.SETTING=VALUE with POLICY one of {', '.join(POLICIES)}")
        parsed = json.loads(value) if value[:1] in "[{" else float(value)
        out.setdefault(policy, {})[field_name] = tuple(parsed) if isinstance(parsed, list) else parsed
    for policy, opts in out.items():
        make_policy(policy, opts)
    return out


def workload_summary(w: Workload) -> dict:
    buckets: dict[str, int] = {}
    for j in w.jobs:
        buckets[bucket_of(j.gpu_s)] = buckets.get(bucket_of(j.gpu_s), 0) + 1
    span = w.demand[-1][0] if w.demand else 0.0
    busy = sum(n * ((w.demand[i + 1][0] if i + 1 < len(w.demand) else span) - t) for i, (t, n) in enumerate(w.demand))
    return {"source": w.source, "jobs": len(w.jobs), "gpu_h": round(sum(j.gpu_s for j in w.jobs) / 3600.0, 1),
            "slo_jobs": sum(1 for j in w.jobs if j.deadline_s is not None), "jobs_by_bucket": buckets,
            "last_submit_h": round(max((j.submit_s for j in w.jobs), default=0.0) / 3600.0, 2),
            "inference_devices": w.inference_devices,
            "demand_mean_share": round(busy / span / w.inference_devices, 3) if span and w.inference_devices else None}


def main(argv: list[str] | None = None) -> int:
    doc = __doc__.split("\n\n")
    ap = argparse.ArgumentParser(prog="python -m bench.cluster_sim", description=doc[0], allow_abbrev=False,
                                 epilog="\n\n".join(doc[1:]).strip(), formatter_class=argparse.RawDescriptionHelpFormatter)
    w = ap.add_argument_group("workload")
    w.add_argument("--trace", help="a Pollux/DeepBoot workload CSV (name,time,application,num_replicas,batch_size)")
    w.add_argument("--trace-dir", help="the simulator's traces/ folder: <application>/placements.csv, validation-*.csv")
    w.add_argument("--demand", default="auto", choices=("auto", "trace", "generated", "none"),
                   help="inference demand with --trace: its inference rows, the day/night curve, none (default auto)")
    w.add_argument("--jobs", type=int, default=140, help="generated: jobs (default 140)")
    w.add_argument("--hours", type=float, default=24.0, help="generated: hours of arrivals (default 24)")
    w.add_argument("--seeds", default="0", help="generated: comma-separated seeds, one workload each (default 0)")
    w.add_argument("--slo-fraction", type=float, default=None,
                   help="share of jobs given a deadline (default 0.25 generated, 0 for a trace)")
    w.add_argument("--slack", type=lambda t: _floats(t, 2), default=(1.5, 3.0),
                   help="deadline = submit + U(a,b) x its run time on the workers it asks for (default 1.5,3)")
    w.add_argument("--demand-mean", type=float, default=0.35, help="generated: mean inference utilisation (0.35)")
    w.add_argument("--small", action="store_true",
                   help="the CI preset: 30 jobs over 4 h on 2 training and 2 inference nodes")
    c = ap.add_argument_group("cluster and costs")
    c.add_argument("--training-nodes", type=int, default=8)
    c.add_argument("--inference-nodes", type=int, default=8)
    c.add_argument("--gpus-per-node", type=int, default=4)
    for f in fields(Costs):
        c.add_argument(f"--{f.name.replace('_', '-')}", type=float, default=f.default, help=f"(default {f.default})")
    p = ap.add_argument_group("policies")
    p.add_argument("--policies", default=",".join(POLICY_ORDER), help=f"comma-separated (default all: "
                   f"{','.join(POLICY_ORDER)})")
    p.add_argument("--lending", default="both", choices=("both", "on", "off"))
    p.add_argument("--option", action="append", default=[], metavar="POLICY.SETTING=VALUE",
                   help="a policy's setting, e.g. knapsack.min_resize_interval_s=120 (repeatable)")
    p.add_argument("--tick-s", type=float, default=60.0, help="the controller decides at least this often (60)")
    p.add_argument("--max-days", type=float, default=30.0, help="stop a run this long after the first arrival")
    o = ap.add_argument_group("output")
    o.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    o.add_argument("--out", help="also write the JSON here")
    o.add_argument("--processes", type=int, default=min(2, os.cpu_count() or 1), help="runs in parallel")
    args = ap.parse_args(argv)

    if args.small:
        args.jobs, args.hours, args.training_nodes, args.inference_nodes = 30, 4.0, 2, 2
    policies = [x.strip() for x in args.policies.split(",") if x.strip()]
    unknown = [x for x in policies if x not in POLICIES]
    if unknown:
        ap.error(f"--policies: unknown {', '.join(unknown)}; known: {', '.join(POLICIES)}")
    try:
        options = _options(args.option, policies)
        seeds = [int(s) for s in args.seeds.split(",") if s.strip()]
    except ValueError as exc:
        ap.error(str(exc))
    if not seeds or args.jobs < 1 or args.hours <= 0 or min(args.training_nodes, args.inference_nodes) < 0 \
            or args.gpus_per_node < 1 or args.training_nodes + args.inference_nodes < 1:
        ap.error("need a seed, --jobs >= 1, --hours > 0, nodes >= 0 (not both 0), --gpus-per-node >= 1")
    cluster = Cluster(args.training_nodes, args.inference_nodes, args.gpus_per_node)
    costs = Costs(**{f.name: getattr(args, f.name) for f in fields(Costs)})
    lendings = {"both": [True, False], "on": [True], "off": [False]}[args.lending]

    started = time.perf_counter()
    try:
        if args.trace:
            slo = 0.0 if args.slo_fraction is None else args.slo_fraction
            workloads = {seeds[0]: read_trace(args.trace, args.trace_dir, gpus_per_node=args.gpus_per_node,
                                              demand=args.demand, inference_devices=cluster.inference_devices,
                                              seed=seeds[0], slo_fraction=slo, slack=args.slack)}
        else:
            slo = 0.25 if args.slo_fraction is None else args.slo_fraction
            workloads = {s: generate(jobs=args.jobs, hours=args.hours, seed=s, slo_fraction=slo, slack=args.slack,
                                     inference_devices=cluster.inference_devices, demand_mean=args.demand_mean)
                         for s in seeds}
    except (TraceError, ValueError) as exc:
        print(f"cluster_sim: {exc}", file=sys.stderr)
        return 2
    for seed, wl in workloads.items():
        log(f"workload seed {seed}: {wl.source}, {sum(j.gpu_s for j in wl.jobs) / 3600:.0f} GPU-hours")
    try:
        runs = run_all(workloads, policies, options, lendings, cluster, costs, args.tick_s, args.max_days * 86400.0,
                       max(1, args.processes))
    except Exception as exc:  # a policy's bug: say which, exit 1
        log(f"a run failed: {type(exc).__name__}: {exc}")
        return 1
    result = {
        "benchmark": "cluster_sim",
        "date": datetime.date.today().isoformat(),
        "hostname": platform.node(), "python": platform.python_version(), "cpu_count": os.cpu_count(),
        "workload": {str(s): workload_summary(wl) for s, wl in workloads.items()},
        "seeds": seeds, "cluster": asdict(cluster) | {"lending": args.lending}, "costs": asdict(costs),
        "tick_s": args.tick_s, "policy_options": {p: options.get(p, {}) for p in policies},
        "runs": runs, "comparisons": comparisons(runs),
        "elapsed_s": round(time.perf_counter() - started, 1),
    }
    if args.out:
        with open(args.out, "w", encoding="utf-8") as f:
            json.dump(result, f, indent=1)
            f.write("\n")
    if args.json:
        print(json.dumps(result))
    else:
        print(render_table(result))
    unfinished = sum(s["jobs"] - s["finished"] for e in runs.values() for s in e["seeds"].values())
    if unfinished:
        log(f"{unfinished} job(s) unfinished at --max-days {args.max_days:g} over all runs")
    return 1 if unfinished else 0


def render_table(result: dict) -> str:
    rows = [f"{'run':22s} {'JCT avg h':>9s} {'p99 h':>7s} {'queue s':>9s} {'SLO met':>8s} "
            f"{'inf p99 ms':>10s} {'harvest GPU-h':>13s}"]
    for name, entry in result["runs"].items():
        m = entry["mean"]

        def f(v, scale=1.0, digits=1):
            return "-" if v is None else f"{v / scale:.{digits}f}"
        slo = "-" if m["deadlines_met_share"] is None else f(m["deadlines_met_share"], 0.01, 0) + "%"
        rows.append(f"{name:22s} {f(m['jct_avg_s'], 3600, 2):>9s} {f(m['jct_p99_s'], 3600, 1):>7s} "
                    f"{f(m['queue_avg_s']):>9s} {slo:>8s} "
                    f"{f(m['inference_wait_p99_ms']):>10s} {f(m['harvested_gpu_h']):>13s}")
    for c in result["comparisons"]:
        keys = {k: v for k, v in c.items() if k.endswith(("ratio", "change_pct"))}
        rows.append(f"{c['paper']}: {c['ours']} vs {c['against']}: {keys}")
    return "\n".join(rows)


if __name__ == "__main__":
    sys.exit(main())
