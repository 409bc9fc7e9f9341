"""Two placement policies in turn on a real local Ray cluster, and bench.cluster_sim beside them.

    python examples/ray_policies.py --json            # one JSON object on stdout
    python examples/ray_policies.py --policies max-workers,knapsack --option knapsack.resize_s=12

One cluster for both runs (examples/ray_colocate.py's: a Ray head and three Ray nodes
``n1``-``n3``, each with its own cpu-backend nodeagent daemon, loan agents, everything bound
to 127.0.0.1 with explicit memory and object-store sizes, stopped by pid by the supervisor).
Under each policy in turn, a controller (a Ray actor running that policy) places the mix of
``bench.cluster_real.MIX``: Ray Train jobs of known lengths submitted a few seconds apart,
each its own driver process, and an inference demand that rises and falls, served the way
the simulator's serving layer does it (an idle device if there is one, PROTECT first, else
the controller's ``want_inference_devices``). Each run's event log gives the figures
bench.cluster_sim reports; the costs the simulator assumes are taken from the logs (lend to
loan node, Ray Train start, grow and shrink, reclaim, park, resume); and the simulator runs
the same mix as each run went (its submissions and demand) with those costs, so that real
and simulated figures stand side by side with their ratio (``comparison``). About nine
minutes on a 2-core VM; the JSON keeps each run's event log (bench.cluster_real's format).

Why today's ``max-workers`` against ``knapsack`` by default: their difference shows with three
jobs on three devices. Today's rule gives both free devices to the two-worker job and never
takes one back for another job, so the short jobs queue behind it; the knapsack admits a
waiting job with one worker as soon as the big job's last resize is ``min_resize_interval_s``
old, shrinking it (a Ray Train restart each way). ``fifo`` and ``tiresias`` would need
GPU-hour queue limits and two-minute ``min_run_s`` scaled down to tell apart here.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import threading
import time
from dataclasses import asdict
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(Path(__file__).resolve().parent))

import ray_colocate as rc  # noqa: E402  the local cluster, its supervisor and its cleanup

from bench.cluster_real import (MIX, compact, executed, measured_costs, metrics, pooled_rates,  # noqa: E402
                                side_by_side, sim_costs, simulate)

DEFAULT_POLICIES = "max-workers,knapsack"
# At this scale (jobs of a minute): the knapsack's resize cost near what Ray Train's restart takes
# here, and a job kept at its count for 10 s rather than DeepBoot's minute.
DEFAULT_OPTIONS = {"knapsack": {"min_resize_interval_s": 10.0, "resize_s": 12.0}}
RUN_TIMEOUT_S = 420.0  # one policy's run, from its first submission (170-290 s measured on the busy 2-core VM)
SAMPLE_S = 0.25  # how often the jobs' progress is read
REPLICA_RATE_HZ, REPLICA_COMPUTE_MS = 10.0, 5.0


def say(msg: str) -> None:
    print(f"[ray_policies {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def make_replica_class():
    import ray

    @ray.remote(num_cpus=0, max_concurrency=3)
    class Replica:
        """An inference replica kept on its node between placements: it opens its session (the
        demand the controller sees) only when placed, and closes it when the demand falls."""

        def __init__(self, name: str) -> None:
            self.name = name
            self._stop = threading.Event()
            self._granted = threading.Condition()
            self._first_grant: dict[int, float] = {}  # placement -> unix time of its first grant

        def serve(self, placement: int, rate_hz: float, compute_ms: float) -> dict:
            from client_lib import Client, DaemonError
            self._stop.clear()
            requests = errors = 0
            with Client(self.name, workload="inference") as client:
                next_at = time.monotonic()
                while not self._stop.is_set():
                    try:
                        with client.slice(timeout=10.0):
                            if placement not in self._first_grant:
                                with self._granted:
                                    self._first_grant[placement] = time.time()
                                    self._granted.notify_all()
                            until = time.perf_counter() + compute_ms / 1000.0
                            while time.perf_counter() < until:
                                pass
                        requests += 1
                    except DaemonError:
                        errors += 1
                    next_at += 1.0 / rate_hz
                    self._stop.wait(max(0.0, next_at - time.monotonic()))
            return {"requests": requests, "errors": errors}

        def first_grant(self, placement: int, timeout_s: float) -> float | None:
            """Unix time of ``placement``'s first grant (None: not within ``timeout_s``). By placement,
            because this call may run before the ``serve`` it waits for has begun."""
            with self._granted:
                self._granted.wait_for(lambda: placement in self._first_grant, timeout_s)
                return self._first_grant.get(placement)

        def stop(self) -> None:
            self._stop.set()

    return Replica


class PolicyRun:
    """One policy's run of the mix on the cluster: a controller with that policy, the jobs, the
    demand; its event log (bench.cluster_real's format)."""

    def __init__(self, cluster: "Cluster", policy: str, options: dict, tag: str) -> None:
        self.c, self.policy, self.options, self.tag = cluster, policy, options, tag
        self.log: list[dict] = []
        self._lock = threading.Lock()
        self.t0 = 0.0
        self.drivers: dict[str, subprocess.Popen] = {}
        self.trackers: dict[str, object] = {}
        self.serving: list[tuple[str, object]] = []  # (node, serve ref), oldest first
        self.served: list[dict] = []
        self.steps: dict[str, int] = {}  # each job's latest step, as sampled
        self.failure: str | None = None
        self.first_demand = threading.Event()  # the demand at 0 s is placed before the first job comes, as simulated

    def job(self, name: str) -> str:
        return f"{self.tag}-{name}"

    def event(self, kind: str, t: float | None = None, **fields) -> None:
        with self._lock:
            self.log.append({"t": round((time.time() if t is None else t) - self.t0, 3), "kind": kind, **fields})

    # -------- the controller

    def start_controller(self) -> None:
        import ray

        from nodeagent_ray.actors import NAMESPACE, Controller, ControllerSettings, NodeSettings
        run = self.c.run
        settings = ControllerSettings(
            nodes=tuple(NodeSettings(n.name, n.cluster, n.events, os.path.join(n.keys_dir, "server.key"))
                        for n in run.nodes.values()),
            client_key=self.c.controller_key, state_dir=os.path.join(run.dir, f"controller-{self.tag}"),
            core={"tick_ms": 100.0, "resync_s": 1.0, "reclaim_deadline_ms": 3000.0,
                  "policy": {"name": self.policy, "options": self.options}})
        self.controller = Controller.options(name=f"controller-{self.tag}", namespace=NAMESPACE,
                                             resources={"nodeagent_head": 1}).remote(settings)
        ready = ray.get(self.controller.ready.remote())
        if ready["error"]:
            raise RuntimeError(f"controller ({self.policy}): {ready['error']}")

    # -------- jobs

    def submit(self, plan) -> None:
        from nodeagent_ray.actors import create_job
        name = self.job(plan.name)
        deadline = None if plan.deadline_s is None else self.t0 + plan.deadline_s
        self.trackers[name] = create_job(name, plan.max_workers, expected_steps=plan.steps, deadline=deadline)
        self.event("submit", job=name, max_workers=plan.max_workers, steps=plan.steps,
                   deadline_s=plan.deadline_s)
        run = self.c.run
        with open(os.path.join(run.dir, f"fit-{name}.log"), "ab") as log:
            self.drivers[name] = subprocess.Popen(
                [sys.executable, str(Path(rc.__file__).resolve()), "--fit-driver", self.c.address, "--workdir", run.dir,
                 "--job", name, "--max-workers", str(plan.max_workers), "--steps", str(plan.steps),
                 "--step-s", str(MIX.step_s)],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, cwd=REPO, start_new_session=True,
                env=dict(os.environ, PYTHONUNBUFFERED="1", **rc.TRAIN_ENV))
        rc.write_pidfile(self.drivers[name].pid, os.path.join(run.dir, f"fit-{name}.json"),
                         {"what": f"job {name}'s driver"})
        say(f"{self.policy}: submitted {name} (max {plan.max_workers} workers, {plan.steps} steps)")

    def sample(self) -> None:
        import ray
        names = list(self.trackers)
        for name, pr in zip(names, ray.get([self.trackers[n].progress.remote() for n in names], timeout=10)):
            self.event("progress", job=name, step=pr["step"], workers=pr["world_size"])
            self.steps[name] = pr["step"]

    # -------- inference demand, as the simulator's serving layer places it

    def when(self, step, last_change: float) -> None:
        """Wait for a demand step's moment (bench.cluster_real.DemandStep)."""
        if step.job is not None:
            while self.steps.get(self.job(step.job), 0) < step.steps:
                if time.time() - self.t0 > RUN_TIMEOUT_S:
                    raise TimeoutError(f"job {step.job} did not reach step {step.steps}")
                time.sleep(0.05)
            return
        at = self.t0 + step.at_s if step.at_s is not None else last_change + step.after_s
        time.sleep(max(0.0, at - time.time()))

    def serve_demand(self) -> None:
        last_change = self.t0
        try:
            for step in MIX.demand:
                self.when(step, last_change)
                last_change = time.time()
                devices = step.devices
                self.event("demand", devices=devices)
                while len(self.serving) > devices:
                    self.unplace()
                while len(self.serving) < devices:
                    self.place(time.time())
                self.first_demand.set()
        except Exception as exc:  # told to the main loop, which fails the run with it
            self.failure = f"serving layer: {type(exc).__name__}: {exc}"

    def idle_inference_nodes(self) -> list[str]:
        """Nodes a replica may take at once: no replica there, device PROTECT (first) or FREE."""
        busy = {node for node, _ in self.serving}
        found = []
        for node, result in self.c.placement.inventory().items():
            if node in busy or not result.ok or not hasattr(result.reply, "devices"):
                continue
            for d in result.reply.devices:
                if d.state in ("PROTECT", "FREE"):
                    found.append((d.state != "PROTECT", node))
        return [node for _, node in sorted(found)]

    def place(self, asked: float) -> None:
        import ray
        while time.time() - asked < 60.0:
            idle = self.idle_inference_nodes()
            decide_ms = None
            if idle:
                node = idle[0]
            else:
                t = time.time()
                got = ray.get(self.controller.want_inference_devices.remote(1), timeout=30)
                decide_ms = round((time.time() - t) * 1000.0, 3)
                if not got:
                    time.sleep(0.25)  # nothing to take back yet: ask again, as the simulator's unserved queue does
                    continue
                node = got[0][0]
            replica = self.c.replicas[node]
            placement = self.c.next_placement()
            self.serving.append((node, replica.serve.remote(placement, REPLICA_RATE_HZ, REPLICA_COMPUTE_MS)))
            granted = ray.get(replica.first_grant.remote(placement, 30.0), timeout=40)
            if granted is None:
                raise RuntimeError(f"a replica placed on {node} got no grant within 30 s")
            self.event("placed", node=node, wait_ms=round((granted - asked) * 1000.0, 3),
                       reclaimed=decide_ms is not None, decide_ms=decide_ms)
            say(f"{self.policy}: inference placed on {node} after {(granted - asked) * 1000.0:.0f} ms"
                f"{' (reclaimed)' if decide_ms is not None else ''}")
            return
        raise RuntimeError("no device for inference within 60 s")

    def unplace(self) -> None:
        import ray
        node, ref = self.serving.pop()  # the newest replica goes first, as in the simulator
        self.c.replicas[node].stop.remote()
        self.served.append({"node": node, **ray.get(ref, timeout=30)})
        self.event("unplaced", node=node)

    # -------- the run

    def execute(self) -> dict:
        import ray
        self.start_controller()
        say(f"{self.policy}: controller up")
        self.t0 = time.time()
        serving = threading.Thread(target=self.serve_demand, name="serving", daemon=True)
        serving.start()
        self.first_demand.wait(60.0)
        pending = sorted(MIX.jobs, key=lambda j: j.submit_s)
        while True:
            now = time.time() - self.t0
            while pending and pending[0].submit_s <= now:
                self.submit(pending.pop(0))
            self.sample()
            if self.failure:
                raise RuntimeError(self.failure)
            for name, proc in self.drivers.items():
                if proc.poll() not in (None, 0):
                    raise RuntimeError(f"job {name}'s driver exited with status {proc.returncode}: "
                                       f"{rc.log_tail(os.path.join(self.c.run.dir, f'fit-{name}.log'))}")
            if not pending and not serving.is_alive() and all(p.poll() == 0 for p in self.drivers.values()):
                break
            if now > RUN_TIMEOUT_S:
                raise TimeoutError(f"{self.policy}: the mix did not finish within {RUN_TIMEOUT_S:g} s")
            time.sleep(SAMPLE_S)
        self.event("end")
        self.collect()
        ray.get(self.controller.shutdown.remote(), timeout=20)
        ray.kill(self.controller, no_restart=True)
        for tracker in self.trackers.values():
            ray.kill(tracker, no_restart=True)
        return {"policy": self.policy, "options": self.options, "log": self.log, "inference": self.served}

    def collect(self) -> None:
        """The trackers' histories, their measured throughput and the controller's records, into the log."""
        import ray
        for name, tracker in self.trackers.items():
            for h in ray.get(tracker.report.remote(), timeout=10)["history"]:
                self.event("tracker", t=h["time"], job=name, event=h["event"], world_size=h.get("world_size"))
            self.event("rates", job=name, steps_per_s=ray.get(tracker.view.remote(), timeout=10)["steps_per_s"])
        for rec in ray.get(self.controller.records.remote(), timeout=10):
            if rec["kind"] in ("lend", "loan_node", "reclaim", "release", "resume", "failed", "loan_node_failed"):
                fields = {k: v for k, v in rec.items() if k not in ("time", "kind")}
                self.event("controller", t=rec["time"], what=rec["kind"], **fields)
        self.log = compact(sorted(self.log, key=lambda e: e["t"]))


class Cluster:
    """The cluster both runs share, and what their serving layer reads (a placement client of its own)."""

    def __init__(self, run: rc.Run) -> None:
        import ray

        from client_lib.placement import ClientKeys, PlacementClient, load_server_public
        from nodeagent_ray.actors import NAMESPACE, LoanAgent, LoanSettings, agent_name
        os.environ.update(rc.TRAIN_ENV)
        self.run = run
        self._placements = 0
        self.controller_key = run.start_daemons()
        self.address = run.start_ray()
        say("daemons and Ray cluster up (head + 3 nodes)")
        self.agents = {}  # held: an actor nobody holds a handle to is stopped by Ray
        for name, node in run.nodes.items():
            # One host: two loan nodes lent in one turn must not start together (raynode.host_start_lock).
            settings = LoanSettings(address=self.address, state_dir=os.path.join(node.dir, "loans"),
                                    temp_dir=run.ray_tmp, endpoint=node.endpoint, node_ip=run.node_ip,
                                    start_lock=os.path.join(run.dir, "loan-start.lock"))
            self.agents[name] = LoanAgent.options(name=agent_name(name), namespace=NAMESPACE,
                                                  resources={f"nodeagent_node:{name}": 1}).remote(name, settings)
        Replica = make_replica_class()
        self.replicas = {name: Replica.options(resources={f"nodeagent_node:{name}": 1}).remote(f"svc-{name}")
                         for name in run.nodes}
        ray.get([r.__ray_ready__.remote() for r in self.replicas.values()], timeout=60)
        ray.get([a.__ray_ready__.remote() for a in self.agents.values()], timeout=60)
        self.placement = PlacementClient(
            {n.name: n.cluster for n in run.nodes.values()}, keys=ClientKeys.load(self.controller_key),
            server_keys={n.name: load_server_public(os.path.join(n.keys_dir, "server.key"))
                         for n in run.nodes.values()}, timeout_ms=2000)

    def next_placement(self) -> int:
        self._placements += 1
        return self._placements

    def wait_idle(self, timeout_s: float = 60.0) -> None:
        """Between runs: no loan node left, every device FREE (protect windows over)."""
        import ray
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            loans = ray.get([a.list.remote() for a in self.agents.values()], timeout=10)
            states = [d.state for r in self.placement.inventory().values() if r.ok for d in r.reply.devices]
            if not any(loans) and len(states) == len(self.run.nodes) and set(states) == {"FREE"}:
                return
            time.sleep(0.25)
        raise TimeoutError(f"the cluster was not idle within {timeout_s:g} s between runs")


def body(run: rc.Run, policies: list[str], options: dict[str, dict]) -> dict:
    cluster = Cluster(run)
    runs = []
    for i, policy in enumerate(policies):
        cluster.wait_idle()
        current = PolicyRun(cluster, policy, options.get(policy, {}), f"p{i + 1}")
        try:
            runs.append(current.execute())
        except Exception as exc:  # the JSON keeps what the run logged, to see where it stood
            try:
                current.collect()
            except Exception as again:
                say(f"{policy}: could not read the trackers and the controller after the failure: {again}")
            return {"error": f"{type(exc).__name__}: {exc}", "policy": policy,
                    "partial_log": current.log, "finished_runs": runs}
        say(f"{policy}: done in {runs[-1]['log'][-1]['t']:.0f} s")
    return compare(runs)


def _base(job: str) -> str:
    return job.split("-", 1)[1]


def compare(runs: list[dict]) -> dict:
    """Real figures per policy, the costs measured, the simulator on the same mix with them, side by side."""
    logs = [r["log"] for r in runs]
    measured = measured_costs(logs)
    costs = sim_costs(measured, rc.PROTECT_S)
    rates = pooled_rates(logs, _base)
    out = {"benchmark": "ray_policies", "mix": {"jobs": [asdict(j) for j in MIX.jobs],
                                                "demand": [asdict(d) for d in MIX.demand],
                                                "nodes": MIX.nodes, "step_s": MIX.step_s},
           "measured_costs": measured, "sim_costs": asdict(costs),
           "steps_per_s": {j: {str(n): round(v, 2) for n, v in r.items()} for j, r in rates.items()},
           "policies": {}}
    checks = {}
    for r in runs:
        log = [{**e, **({"job": _base(e["job"])} if e.get("job") else {})} for e in r["log"]]
        real = metrics(log)
        submits, demand = executed(log)  # the simulator replays the run as it went
        sim = simulate(MIX, r["policy"], r["options"], costs, rates, demand, submits)
        sim.pop("costs", None)
        out["policies"][r["policy"]] = {"options": r["options"], "real": real, "sim": sim,
                                        "comparison": side_by_side(real, sim), "inference": r["inference"],
                                        "log": r["log"]}
        checks[f"{r['policy']}_all_jobs_finished"] = real["finished"] == real["jobs"] == len(MIX.jobs)
    out["checks"] = checks
    return out


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    from bench.cluster_sim import _options
    from nodeagent_ray.policies import POLICIES
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    ap.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    ap.add_argument("--policies", default=DEFAULT_POLICIES,
                    help=f"comma-separated, run in this order (default {DEFAULT_POLICIES}; "
                         f"known: {', '.join(POLICIES)})")
    ap.add_argument("--option", action="append", default=[], metavar="POLICY.SETTING=VALUE",
                    help="a policy's setting, as bench.cluster_sim takes it (default: "
                         + ", ".join(f"{p}.{k}={v:g}" for p, o in DEFAULT_OPTIONS.items() for k, v in o.items()) + ")")
    ap.add_argument("--workdir", help="run directory (default: a new one under /tmp, removed at the end)")
    ap.add_argument("--keep", action="store_true", help="keep the run directory and its logs")
    ap.add_argument("--node-ip", default="127.0.0.1", metavar="ADDRESS",
                    help="the address every Ray node and nodeagent daemon binds (default 127.0.0.1)")
    ap.add_argument("--driver", action="store_true", help=argparse.SUPPRESS)  # the runs' Ray driver (internal)
    args = ap.parse_args(argv)
    args.policies = [p.strip() for p in args.policies.split(",") if p.strip()]
    unknown = [p for p in args.policies if p not in POLICIES]
    if not args.policies or unknown or len(set(args.policies)) != len(args.policies):
        ap.error(f"--policies: want distinct names out of {', '.join(POLICIES)}, got {','.join(args.policies)!r}")
    try:
        given = _options(args.option, args.policies)
    except ValueError as exc:
        ap.error(str(exc))
    args.options = {p: {**DEFAULT_OPTIONS.get(p, {}), **given.get(p, {})} for p in args.policies}
    args.options = {p: o for p, o in args.options.items() if o}
    args.measure_designs = False  # what ray_colocate's supervisor reads
    return args


def main() -> int:
    args = parse()
    if args.driver:
        rc.drive(args, lambda run: body(run, args.policies, args.options))
    driver_args = ["--policies", ",".join(args.policies)]
    for policy, opts in args.options.items():
        driver_args += [a for k, v in opts.items() for a in ("--option", f"{policy}.{k}={v}")]
    return rc.supervise(args, script=__file__, driver_args=driver_args)


if __name__ == "__main__":
    raise SystemExit(main())
