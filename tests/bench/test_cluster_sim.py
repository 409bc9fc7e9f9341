"""bench.cluster_sim: the simulator's accounting on tiny traces worked out by hand, the reader of
the Pollux/DeepBoot trace format on a small fixture, the generator's shape, and the command end
to end on the small preset."""

from __future__ import annotations

import json
import resource
import subprocess
import sys

import pytest

from bench.cluster_engine import Cluster, Costs, Simulation
from bench.cluster_sim import comparisons, main
from bench.cluster_trace import BUCKETS, PROFILES, Application, JobSpec, Workload, bucket_of, generate, read_trace
from nodeagent_ray.policy import PolicyConfig
from tests.conftest import REPO

FIXTURE = REPO / "tests" / "data" / "pollux_trace"

# Round costs, so that every time below can be added up by hand.
COSTS = Costs(grow_s=20.0, shrink_s=5.0, start_s=10.0, loan_node_s=2.0, reclaim_base_ms=2.0, park_gb_per_s=10.0,
              controller_ms=5.0, resume_ms=0.0, protect_s=60.0)


def job(name: str, submit: float, steps: int, deadline: float | None = None) -> JobSpec:
    return JobSpec(name, submit, 1, steps, (1.0,), "toy", deadline, state_mb=100.0)


def simulate(jobs, demand, *, training: int, inference: int, policy: str = "fifo", lending: bool = True):
    workload = Workload(tuple(jobs), tuple(demand), "by hand", inference)
    cluster = Cluster(training_nodes=training, inference_nodes=inference, gpus_per_node=1, lending=lending)
    result = Simulation(workload, PolicyConfig(name=policy), cluster=cluster, costs=COSTS).run()
    return result, {j["name"]: j for j in result.jobs}, result.summary()


def test_jct_queueing_and_harvest_add_up_by_hand_with_and_without_lending():
    jobs = [job("a", 0.0, 100), job("b", 50.0, 50)]
    # No lending: a is lent the training device at 0, its loan node is up at 2 (queue 2 s), it starts
    # by 12 and ends at 112. b waits for that device: a's loan is taken back at 112 ("job gone"),
    # the controller's next turn lends it at 113, up at 115 (queue 65 s), started by 125, ends at 175.
    _, by_name, s = simulate(jobs, [(0.0, 0)], training=1, inference=1, lending=False)
    assert (by_name["a"]["jct_s"], by_name["a"]["queue_s"]) == pytest.approx((112.0, 2.0))
    assert (by_name["b"]["jct_s"], by_name["b"]["queue_s"]) == pytest.approx((125.0, 65.0))
    assert s["jct_avg_s"] == pytest.approx(118.5) and s["queue_avg_s"] == pytest.approx(33.5)
    assert s["harvested_gpu_h"] == 0.0 and s["inference_placements"] == 0
    assert by_name["a"]["attained_gpu_s"] == pytest.approx(112.0)  # held from the lend to the end
    # Lending: b gets the idle inference device at 50 (up at 52, started by 62, ends at 112): it trained
    # 50 s there, which is what was harvested.
    result, by_name, s = simulate(jobs, [(0.0, 0)], training=1, inference=1, lending=True)
    assert by_name["b"]["jct_s"] == pytest.approx(62.0) and by_name["b"]["queue_s"] == pytest.approx(2.0)
    assert result.harvested_gpu_s == pytest.approx(50.0)
    assert result.lent_inference_gpu_s == pytest.approx(62.0)  # lent from 50 to 112, resize included


def test_inference_takes_a_lent_device_back_the_job_parks_and_resumes_in_process():
    # One inference device, lent to b at 0 (up at 2, started by 12). Inference wants it from 30 to 50:
    # the last worker is parked (18 steps done), the replica waits for the reclaim only: 5 ms of
    # controller, 2 ms, and 100 MB parked at 10 GB/s = 10 ms. The device is PROTECT from 50 to 110,
    # then b resumes in-process (no resize) with 82 steps left: done at 192.
    result, by_name, s = simulate([job("b", 0.0, 100)], [(0.0, 0), (30.0, 1), (50.0, 0)], training=0,
                                  inference=1, policy="max-workers")
    assert result.inference_waits_ms == pytest.approx([17.0])
    assert s["inference_wait_p99_ms"] == pytest.approx(17.0) and s["inference_reclaims"] == 1
    assert by_name["b"]["parks"] == 1 and by_name["b"]["resizes"] == 1  # the start only
    assert by_name["b"]["jct_s"] == pytest.approx(192.0)
    assert result.harvested_gpu_s == pytest.approx(100.0)  # every step was taken on the inference device
    assert result.inference_busy_gpu_s == pytest.approx(20.0)
    assert s["decisions"]["reclaim:inference demand"] == 1 and s["decisions"]["resume"] == 1


def test_deadlines_met_and_the_tiresias_claim_are_read_from_the_runs():
    jobs = [job("slo", 0.0, 100, deadline=200.0), job("late", 0.0, 100, deadline=150.0)]
    _, by_name, s = simulate(jobs, [(0.0, 0)], training=1, inference=0, lending=False)
    # fifo, one device, both arrive at 0: "late" first (by name) ends at 112 and meets 150; "slo" ends at
    # 112 + 1 + 2 + 10 + 100 = 225 and misses 200.
    assert by_name["late"]["finished_s"] == pytest.approx(112.0) and by_name["slo"]["finished_s"] == pytest.approx(225.0)
    assert (s["slo_jobs"], s["deadlines_met"], s["deadlines_met_share"]) == (2, 1, 0.5)
    runs = {"tiresias/no-lend": {"mean": {"jct_avg_s": 100.0, "jct_by_bucket_avg_s": {"small": 10.0}}},
            "fifo/no-lend": {"mean": {"jct_avg_s": 300.0, "jct_by_bucket_avg_s": {"small": 50.0}}}}
    [row] = comparisons(runs)
    assert (row["jct_ratio"], row["small_jobs_jct_ratio"], row["paper_jct_ratio"]) == (3.0, 5.0, 5.5)


def test_the_reader_takes_the_pollux_and_deepboot_format_with_measured_throughput():
    w = read_trace(str(FIXTURE / "workload.csv"), str(FIXTURE / "traces"), inference_devices=4)
    by_name = {j.name: j for j in w.jobs}
    assert sorted(by_name) == ["cifar10-2", "toy-0", "toy-1"]
    toy0, toy1 = by_name["toy-0"], by_name["toy-1"]
    # toy-0: batch 64 on 1 worker is placement "1" at 64 (0.2 s), on 2 it is "2" at 32 (0.12 s);
    # 3 epochs (the validation files' length) of batch 64 are 30 iterations.
    assert toy0.submit_s == 10.0 and toy0.max_workers == 2 and toy0.steps == 30
    assert toy0.steps_per_s == pytest.approx((5.0, 1 / 0.12))
    # toy-1: batch 128 on one worker is two accumulated steps of 64: 0.2 + (0.2 - 0.0) = 0.4 s.
    assert toy1.steps_per_s == pytest.approx((2.5,)) and toy1.steps == 15
    # cifar10 has no folder: the built-in profile, a quarter GPU-hour on the 2 workers it asks for.
    cifar = by_name["cifar10-2"]
    assert cifar.steps_per_s == PROFILES["cifar10"].steps_per_s(2)
    assert cifar.gpu_s == pytest.approx(0.25 * 3600, rel=0.01)
    # The inference rows (one GPU each for `duration` s) are the demand: 1 from 0, 2 from 20, 1 from 30.
    assert [w.demand_at(t) for t in (0, 19, 20, 30, 59, 60)] == [1, 1, 2, 1, 1, 0]
    app = Application(str(FIXTURE / "traces" / "toy"))
    assert app.step_time(4, 64) is None  # 16 samples a worker: below the smallest measured (32)
    assert app.step_time(6, 192) == pytest.approx(0.3)  # not in placements: scalability.csv's 6 workers
    with pytest.raises(ValueError, match="no column application, batch_size, name, num_replicas, time"):
        read_trace(str(FIXTURE / "traces" / "toy" / "placements.csv"))
    with pytest.raises(ValueError, match="application 'toy' has no folder"):
        read_trace(str(FIXTURE / "workload.csv"))  # no --trace-dir, and toy has no built-in profile


def test_the_generator_has_philly_buckets_and_a_day_night_curve_under_40_percent():
    w = generate(jobs=200, hours=24, seed=3, inference_devices=32)
    counts = {}
    for j in w.jobs:
        counts[bucket_of(j.gpu_s)] = counts.get(bucket_of(j.gpu_s), 0) + 1
    assert counts == {"small": 149, "medium": 37, "large": 10, "xlarge": 4}  # 74.6 / 18.6 / 4.8 / 2.1 %
    assert [round(share * 200) for share, *_ in BUCKETS][1:] == [37, 10, 4]
    assert all(j.max_workers in PROFILES[j.application].sizes for j in w.jobs)
    day = [w.demand_at(h * 3600.0) for h in range(24)]
    assert sum(day) / len(day) / 32 < 0.40 and max(day) > 2 * min(day)
    assert max(range(24), key=lambda h: day[h]) in range(10, 19)  # the peak in the afternoon
    assert generate(jobs=200, hours=24, seed=3, inference_devices=32) == w  # a seed is a workload


@pytest.mark.timeout(120)
def test_cluster_sim_json_end_to_end_on_the_small_preset(tmp_path):
    out = tmp_path / "sim.json"
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    proc = subprocess.run([sys.executable, "-m", "bench.cluster_sim", "--small", "--json", "--out", str(out)],
                          capture_output=True, text=True, timeout=110, cwd=REPO, check=False)
    assert proc.returncode == 0, proc.stderr
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    # Small: under a minute of CPU (the run and its pool), which no other test's load can stretch as it
    # stretched the wall time (52 s of it for 9 s of CPU on a loaded 2-core VM).
    assert (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime) < 60
    result = json.loads(proc.stdout)
    assert json.loads(out.read_text()) == result
    assert result["benchmark"] == "cluster_sim"
    assert list(result["runs"]) == [f"{p}/{lend}" for p in ("max-workers", "fifo", "tiresias", "knapsack", "deadline")
                                    for lend in ("lend", "no-lend")]
    for name, entry in result["runs"].items():
        m = entry["mean"]
        assert m["finished"] == m["jobs"] == 30, name
        assert m["jct_avg_s"] > 0 and m["queue_avg_s"] >= 0
        if name.endswith("no-lend"):
            assert m["harvested_gpu_h"] == 0 and m["inference_wait_p99_ms"] in (0, None)
    papers = {c["paper"].split(" ")[0] for c in result["comparisons"]}
    assert papers == {"Aryl", "DeepBoot", "Pollux", "issue", "Tiresias", "Chronus"}
    from bench import report  # its figure and headline rows, where matplotlib is installed
    if report.matplotlib_available():
        assert report.main([str(tmp_path), "--out", str(tmp_path / "report")]) == 0
        page = (tmp_path / "report" / "report.html").read_text()
        assert (tmp_path / "report" / "report-cluster_sim.png").stat().st_size > 5_000
        assert "Aryl: knapsack/lend vs fifo/no-lend: JCT ÷, queueing ÷" in page and "paper 1.50× / 1.53×" in page


def test_bad_arguments_and_an_unreadable_trace_exit_2(tmp_path, capsys):
    with pytest.raises(SystemExit) as exc:
        main(["--policies", "nope"])
    assert exc.value.code == 2
    assert main(["--trace", str(tmp_path / "missing.csv")]) == 2
    assert "missing.csv" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["--option", "knapsack.no_such=1"])
