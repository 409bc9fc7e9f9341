"""bench.cluster_real and examples/ray_policies.py without Ray: the figures a real run's event
log gives, the costs measured from it, the simulator on the same mix, and the side-by-side.
(The real run itself is not in CI: the suite already runs one Ray scenario.)"""

from __future__ import annotations

import importlib.util
import sys

import pytest

from bench import cluster_real as cr
from bench.cluster_engine import Costs
from tests.conftest import REPO


def _log() -> list[dict]:
    """Two jobs worked out by hand: ``a`` (two workers, then one after a reclaim for inference),
    ``b`` (queued, one worker, an SLO job that misses its deadline)."""
    return [
        {"t": 0.0, "kind": "submit", "job": "a", "max_workers": 2, "steps": 100, "deadline_s": None},
        {"t": 0.0, "kind": "demand", "devices": 1},
        {"t": 0.1, "kind": "placed", "node": "n1", "wait_ms": 900.0, "reclaimed": False, "decide_ms": None},
        {"t": 0.2, "kind": "controller", "what": "lend", "job": "a", "node": "n2", "device": 0},
        {"t": 0.2, "kind": "controller", "what": "lend", "job": "a", "node": "n3", "device": 0},
        {"t": 4.0, "kind": "controller", "what": "loan_node", "job": "a", "node": "n2", "lend_to_node_ms": 3800.0},
        {"t": 5.0, "kind": "submit", "job": "b", "max_workers": 1, "steps": 50, "deadline_s": 30.0},
        {"t": 6.0, "kind": "controller", "what": "loan_node", "job": "a", "node": "n3", "lend_to_node_ms": 5800.0},
        {"t": 14.0, "kind": "tracker", "job": "a", "event": "start", "world_size": 1},
        {"t": 14.0, "kind": "progress", "job": "a", "step": 0, "workers": 1},
        {"t": 16.0, "kind": "progress", "job": "a", "step": 20, "workers": 1},
        {"t": 24.0, "kind": "tracker", "job": "a", "event": "start", "world_size": 2},
        {"t": 24.0, "kind": "progress", "job": "a", "step": 20, "workers": 2},
        {"t": 28.0, "kind": "progress", "job": "a", "step": 60, "workers": 2},
        {"t": 30.0, "kind": "demand", "devices": 2},
        {"t": 30.2, "kind": "controller", "what": "reclaim", "job": "a", "node": "n3", "then": "release",
         "reason": "inference demand", "free_ms": 40.0},
        {"t": 30.3, "kind": "placed", "node": "n3", "wait_ms": 300.0, "reclaimed": True, "decide_ms": 120.0},
        {"t": 40.0, "kind": "tracker", "job": "a", "event": "start", "world_size": 1},
        {"t": 40.0, "kind": "progress", "job": "a", "step": 60, "workers": 1},
        {"t": 44.0, "kind": "progress", "job": "a", "step": 100, "workers": 1},
        {"t": 44.0, "kind": "tracker", "job": "a", "event": "workers_done", "world_size": None},
        {"t": 47.0, "kind": "tracker", "job": "a", "event": "finish", "world_size": None},
        {"t": 47.5, "kind": "controller", "what": "reclaim", "job": "a", "node": "n2", "then": "release",
         "reason": "job gone", "free_ms": 10.0},
        {"t": 48.0, "kind": "controller", "what": "lend", "job": "b", "node": "n2", "device": 0},
        {"t": 52.0, "kind": "controller", "what": "loan_node", "job": "b", "node": "n2", "lend_to_node_ms": 4000.0},
        {"t": 60.0, "kind": "tracker", "job": "b", "event": "start", "world_size": 1},
        {"t": 60.0, "kind": "progress", "job": "b", "step": 0, "workers": 1},
        {"t": 63.0, "kind": "progress", "job": "b", "step": 50, "workers": 1},
        {"t": 63.0, "kind": "tracker", "job": "b", "event": "workers_done", "world_size": None},
        {"t": 64.0, "kind": "tracker", "job": "b", "event": "finish", "world_size": None},
        {"t": 65.0, "kind": "end"},
    ]


def test_a_real_runs_log_gives_the_simulators_figures():
    m = cr.metrics(_log())
    assert m["jct_s"] == {"a": 44.0, "b": 58.0} and m["jct_avg_s"] == 51.0 and m["jct_p99_s"] == 58.0
    assert m["queue_s"] == {"a": 4.0, "b": 47.0} and m["queue_avg_s"] == 25.5  # to the first loan node up
    assert (m["slo_jobs"], m["deadlines_met"]) == (1, 0)  # b finished at 63 s, its deadline was 30 s
    # The idle device's placement waits 0 ms, as in the simulator; the reclaimed one its 300 ms.
    assert m["inference_placements"] == 2 and m["inference_reclaims"] == 1
    assert (m["inference_wait_p50_ms"], m["inference_wait_p99_ms"]) == (0.0, 300.0)
    # GPU-seconds in intervals that made steps: a 1x2 + 2x4 + 1x4, b 1x3.
    assert m["harvested_gpu_s"] == 17.0
    assert (m["resizes"], m["preemptions"], m["parks"]) == (4, 0, 0)
    assert m["fit_returned_after_last_step_avg_s"] == 2.0 and m["span_s"] == 65.0


def test_a_compacted_log_gives_the_same_figures():
    waiting = [{"t": 6.0 + i, "kind": "progress", "job": "b", "step": 0, "workers": 0} for i in range(50)]
    log = sorted(_log() + waiting, key=lambda e: e["t"])
    kept = cr.compact(log)
    assert cr.metrics(kept) == cr.metrics(log) and len(kept) == len(_log()) + 2  # the first and last of b's wait
    assert [e["t"] for e in kept if e["kind"] == "progress" and e["job"] == "b"][:2] == [6.0, 55.0]


def test_a_reclaim_for_another_job_is_a_preemption_and_a_parked_last_worker_a_park():
    log = _log() + [
        {"t": 50.0, "kind": "controller", "what": "reclaim", "job": "b", "then": "release", "reason": "knapsack",
         "free_ms": 5.0},
        {"t": 51.0, "kind": "controller", "what": "reclaim", "job": "b", "then": "park",
         "reason": "inference session", "free_ms": 7.0},
    ]
    m = cr.metrics(log)
    assert (m["preemptions"], m["parks"]) == (1, 1)


def test_the_costs_the_simulator_assumes_are_measured_from_the_log():
    c = cr.measured_costs([_log()])
    assert c["loan_node_s"]["all"] == [3.8, 5.8, 4.0] and c["loan_node_s"]["median"] == 4.0
    assert c["start_s"]["all"] == [8.0, 8.0]  # a: n2's loan node up at 6.0 is the latest before its start
    # a's group grew before it had started (no gain or loss in between): from that start, 14.0 to 24.0;
    # it shrank from the reclaim's decision (its record, at 30.2, is written once the device is free) to 40.0.
    assert c["grow_s"]["all"] == [10.0] and c["shrink_s"]["all"] == [9.84]
    assert c["reclaim_ms"]["all"] == [40.0, 10.0] and c["inference_reclaim_ms"]["all"] == [40.0]
    assert c["park_ms"]["all"] == [] and c["decide_ms"]["all"] == [120.0]
    costs = cr.sim_costs(c, protect_s=3.0)
    assert (costs.loan_node_s, costs.start_s, costs.grow_s, costs.shrink_s) == (4.0, 8.0, 10.0, 9.84)
    assert (costs.reclaim_base_ms, costs.controller_ms, costs.protect_s) == (40.0, 120.0, 3.0)
    assert costs.resume_ms == Costs().resume_ms  # none measured: the default stays


DEMAND = ((0.0, 1), (34.0, 2), (54.0, 1), (80.0, 0))


def test_the_simulator_replays_the_run_as_it_went():
    """Submissions and the demand come from the run's log, not the plan (a demand step may wait
    for a job's progress, which the plan cannot time)."""
    submits, demand = cr.executed(_log())
    assert submits == {"a": 0.0, "b": 5.0} and demand == ((0.0, 1), (30.0, 2))
    costs = Costs(protect_s=3.0)
    late = cr.simulate(cr.MIX, "max-workers", {}, costs, {}, DEMAND, {"a": 0.0, "b": 8.0, "c": 100.0})
    planned = cr.simulate(cr.MIX, "max-workers", {}, costs, {}, DEMAND)
    assert late["queue_s"]["c"] < planned["queue_s"]["c"]  # submitted after a is done: no queue behind it
    with pytest.raises(ValueError):
        cr.DemandStep(1, at_s=0.0, after_s=5.0)
    with pytest.raises(ValueError):
        cr.DemandStep(1, job="a")


def test_the_simulator_runs_the_same_mix_and_the_two_policies_differ():
    costs = Costs(grow_s=12.0, shrink_s=10.0, start_s=12.0, loan_node_s=4.0, protect_s=3.0, park_gb_per_s=1e9,
                  reclaim_base_ms=50.0, controller_ms=100.0)
    today = cr.simulate(cr.MIX, "max-workers", {}, costs, {}, DEMAND)
    knap = cr.simulate(cr.MIX, "knapsack", {"min_resize_interval_s": 10.0, "resize_s": 12.0}, costs, {}, DEMAND)
    assert today["finished"] == knap["finished"] == len(cr.MIX.jobs)
    # Today's rule keeps both devices on a until inference takes one; the knapsack admits b early.
    assert today["queue_s"]["b"] > 30.0 > knap["queue_s"]["b"]
    assert today["preemptions"] == 0 < knap["preemptions"]
    assert today["inference_wait_p99_ms"] == 150.0  # controller 100 ms + reclaim 50 ms: the costs given


def test_measured_throughput_sets_the_simulated_jobs_speed():
    costs = Costs(protect_s=3.0)
    slow = cr.simulate(cr.MIX, "max-workers", {}, costs, {"a": {1: 5.0, 2: 10.0}}, DEMAND)
    fast = cr.simulate(cr.MIX, "max-workers", {}, costs, {"a": {1: 50.0}}, DEMAND)  # 2 workers: scaled, 100/s
    assert slow["jct_s"]["a"] > fast["jct_s"]["a"] + 30.0
    logs = [[{"t": 1, "kind": "rates", "job": "p1-a", "steps_per_s": {"1": 10.0}}],
            [{"t": 1, "kind": "rates", "job": "p2-a", "steps_per_s": {"1": 20.0, "2": 30.0}}]]
    assert cr.pooled_rates(logs, lambda j: j.split("-", 1)[1]) == {"a": {1: 15.0, 2: 30.0}}


def test_side_by_side_gives_each_figure_with_its_ratio():
    got = cr.side_by_side({"jct_avg_s": 60.0, "parks": 0, "resizes": 4, "queue_avg_s": None},
                          {"jct_avg_s": 50.0, "parks": 0, "resizes": 0, "queue_avg_s": 3.0},
                          keys=("jct_avg_s", "parks", "resizes", "queue_avg_s"))
    assert got == {"jct_avg_s": {"real": 60.0, "sim": 50.0, "ratio": 1.2},
                   "parks": {"real": 0, "sim": 0, "ratio": "same"},
                   "resizes": {"real": 4, "sim": 0, "ratio": None},
                   "queue_avg_s": {"real": None, "sim": 3.0, "ratio": None}}


@pytest.fixture(scope="module")
def example():
    spec = importlib.util.spec_from_file_location("ray_policies", REPO / "examples" / "ray_policies.py")
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod
    try:
        spec.loader.exec_module(mod)
    finally:
        del sys.modules[spec.name]
    return mod


def test_the_example_checks_its_arguments_before_starting_anything(example, capsys):
    args = example.parse([])
    assert args.policies == ["max-workers", "knapsack"]
    assert args.options == {"knapsack": {"min_resize_interval_s": 10.0, "resize_s": 12.0}}
    args = example.parse(["--policies", "fifo,knapsack", "--option", "knapsack.resize_s=5"])
    assert args.options == {"knapsack": {"min_resize_interval_s": 10.0, "resize_s": 5.0}}
    for bad in (["--policies", "fifo,nope"], ["--policies", "fifo,fifo"], ["--option", "knapsack.nope=1"]):
        with pytest.raises(SystemExit) as exc:
            example.parse(bad)
        assert exc.value.code == 2
    assert "nope" in capsys.readouterr().err


def test_the_example_puts_real_and_simulated_side_by_side_per_policy(example):
    """compare(): the real figures from each run's log, the costs measured over both, the
    simulator on the mix with them, and the ratios; job names lose the run's tag."""
    runs = []
    for i, policy in enumerate(("max-workers", "knapsack")):
        log = [{**e, **({"job": f"p{i + 1}-{e['job']}"} if e.get("job") else {})} for e in _log()]
        runs.append({"policy": policy, "options": {}, "log": log, "inference": []})
    out = example.compare(runs)
    assert out["measured_costs"]["grow_s"]["all"] == [10.0, 10.0]
    assert out["sim_costs"]["grow_s"] == 10.0 and out["sim_costs"]["protect_s"] == example.rc.PROTECT_S
    for policy in ("max-workers", "knapsack"):
        entry = out["policies"][policy]
        assert entry["real"]["jct_s"] == {"a": 44.0, "b": 58.0}
        assert set(entry["sim"]["jct_s"]) == {j.name for j in cr.MIX.jobs}
        row = entry["comparison"]["jct_avg_s"]
        assert row["real"] == 51.0 and row["ratio"] == round(51.0 / entry["sim"]["jct_avg_s"], 2)
    assert out["checks"] == {"max-workers_all_jobs_finished": False, "knapsack_all_jobs_finished": False}


def test_ray_nodes_of_one_host_start_one_at_a_time(tmp_path):
    """raynode.host_start_lock, which the loan agents of examples/ray_policies.py share: a second
    process that wants to start a node waits until the first one's start is over."""
    import subprocess
    import time

    from nodeagent_ray.raynode import host_start_lock
    lock = str(tmp_path / "start.lock")
    child = ("import sys, time; from nodeagent_ray.raynode import host_start_lock\n"
             "print('ready', flush=True)\n"
             "with host_start_lock(sys.argv[1]):\n    print(time.monotonic(), flush=True)\n")
    with host_start_lock(lock):
        proc = subprocess.Popen([sys.executable, "-c", child, lock], stdout=subprocess.PIPE, text=True, cwd=REPO)
        assert proc.stdout.readline() == "ready\n"
        time.sleep(0.5)
        released = time.monotonic()
    got = float(proc.communicate(timeout=30)[0])
    assert proc.returncode == 0 and got >= released
    with host_start_lock(None):  # no lock asked: nothing to wait for
        pass


def test_a_jobs_tracker_is_placed_on_the_node_of_whoever_creates_it(monkeypatch):
    """Not on a loan node: an actor of no resources may land on any node, and a loan node goes
    away at its reclaim (a run of examples/ray_policies.py lost job c's tracker so)."""
    pytest.importorskip("ray", reason="the ray extra is not installed (pip install -e '.[ray]')")
    from nodeagent_ray import actors

    class Context:
        def get_node_id(self) -> str:
            return "node-of-the-driver"

    asked: dict = {}

    class Tracker:
        def options(self, **kwargs):
            asked.update(kwargs)
            return self

        def remote(self, *args, **kwargs):
            return ("tracker", args)

    monkeypatch.setattr(actors.ray, "get_runtime_context", lambda: Context())
    monkeypatch.setattr(actors, "TrainingJob", Tracker())
    assert actors.create_job("job-1", 2) == ("tracker", ("job-1", 2))
    assert asked["label_selector"] == {"ray.io/node-id": "node-of-the-driver"} and asked["name"] == "job:job-1"
