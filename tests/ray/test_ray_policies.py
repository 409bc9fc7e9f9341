"""The placement policies of issue 25 (nodeagent_ray.policies), stepped by hand on small views:
no Ray, no sockets, no clock. Every node here has one device, index 0."""

from __future__ import annotations

import os

import pytest

from nodeagent_ray.policies import Deadline, Fifo, Knapsack, Tiresias, make_policy
from nodeagent_ray.policies.knapsack import multiple_choice_knapsack
from nodeagent_ray.policies.signals import rates, remaining_s
from nodeagent_ray.policy import (ClusterView, DeviceView, JobView, Lend, LoanView, NodeView, PolicyConfig, Reclaim,
                                  Renew, SessionCount, Then, decide)


def cluster(*, free=(), lent=None, busy=(), dedicated=(), jobs=(), wanted=0) -> ClusterView:
    """``free``: nodes with a FREE device; ``lent``: {node: job} LENT with the job's worker running
    there and its loan node up; ``busy``: nodes whose device inference uses (RUN)."""
    lent = lent or {}
    nodes = {}
    for name in free:
        nodes[name] = (DeviceView(name, 0, "FREE"),)
    for name, job in lent.items():
        nodes[name] = (DeviceView(name, 0, "LENT", job, 0, {job: SessionCount(1, 0)}),)
    for name in busy:
        nodes[name] = (DeviceView(name, 0, "RUN", None, 1),)
    return ClusterView(nodes={n: NodeView(n, True, ds, dedicated=n in dedicated) for n, ds in nodes.items()},
                       loans={(n, 0): LoanView(n, 0, job, 0.0) for n, job in lent.items()},
                       jobs={j.name: j for j in jobs}, inference_wanted=wanted)


def run(name: str, view: ClusterView, now: float = 1000.0, **options):
    return decide(view, now, PolicyConfig(name=name, options=options))


def lends(decisions) -> list[tuple[str, str]]:
    return [(d.node, d.job) for d in decisions if isinstance(d, Lend)]


def reclaims(decisions) -> list[tuple[str, str, str]]:
    return [(d.node, d.job, d.reason) for d in decisions if isinstance(d, Reclaim)]


def linear(n: int, per_worker: float = 1.0) -> dict[int, float]:
    return {k: per_worker * k for k in range(1, n + 1)}


# ------------------------------------------------------------------ choosing a policy


def test_a_policy_is_chosen_by_name_and_its_settings_are_checked():
    assert isinstance(make_policy("knapsack", {"resize_s": 3.0}), Knapsack)
    assert make_policy("tiresias").queue_limits_gpu_s == (3600.0, 36000.0)
    with pytest.raises(ValueError, match="unknown policy 'las'"):
        PolicyConfig(name="las")
    with pytest.raises(ValueError, match="has no setting 'quantum'"):
        PolicyConfig(name="tiresias", options={"quantum": 1})
    with pytest.raises(ValueError, match="increasing"):
        Tiresias(queue_limits_gpu_s=(10.0, 5.0))
    with pytest.raises(ValueError, match="margin"):
        Deadline(margin=1.0)


def test_every_policy_leaves_a_dedicated_nodes_loans_to_training_when_inference_asks():
    jobs = [JobView("a", 2, submitted_at=0.0, steps_per_s=linear(2), expected_steps=10_000)]
    view = cluster(lent={"t1": "a", "i1": "a"}, dedicated={"t1"}, jobs=jobs, wanted=2)
    for name in ("max-workers", "fifo", "tiresias", "knapsack", "deadline"):
        taken = reclaims(run(name, view))
        assert taken == [("i1", "a", "inference demand")], name


# ------------------------------------------------------------------ fifo and tiresias: gangs


def test_fifo_runs_a_gang_whole_or_not_at_all_and_backfills_what_fits():
    big = JobView("big", 3, submitted_at=1.0)
    small = JobView("small", 1, submitted_at=2.0)
    decisions = run("fifo", cluster(free=("n1", "n2"), busy=("n3",), jobs=[big, small]))
    assert lends(decisions) == [("n1", "small")]  # big (3) does not fit in 2; small, behind it, does


def test_fifo_never_takes_a_device_from_a_running_job_for_another():
    running = JobView("late", 2, submitted_at=5.0)
    early = JobView("early", 1, submitted_at=1.0)
    decisions = run("fifo", cluster(lent={"n1": "late", "n2": "late"}, jobs=[early, running]))
    assert decisions == []


def test_tiresias_puts_a_new_job_ahead_of_one_that_attained_more_than_a_queue_and_preempts_it():
    old = JobView("old", 2, submitted_at=0.0, attained_gpu_s=4000.0, last_resize_at=0.0)
    new = JobView("new", 2, submitted_at=900.0)
    decisions = run("tiresias", cluster(lent={"n1": "old", "n2": "old"}, jobs=[old, new]))
    assert reclaims(decisions) == [("n1", "old", "tiresias: a higher queue"),
                                   ("n2", "old", "tiresias: a higher queue")]
    assert all(d.then is Then.RELEASE for d in decisions if isinstance(d, Reclaim))  # not parked: it moves
    # Next round the devices are free: they go to the new job.
    assert lends(run("tiresias", cluster(free=("n1", "n2"), jobs=[old, new]))) == [("n1", "new"), ("n2", "new")]


def test_tiresias_keeps_fifo_inside_a_queue_and_spares_a_job_started_moments_ago():
    first = JobView("first", 1, submitted_at=0.0, attained_gpu_s=10.0, last_resize_at=0.0)
    second = JobView("second", 1, submitted_at=5.0)
    assert run("tiresias", cluster(lent={"n1": "first"}, jobs=[first, second])) == []  # same queue: first stays
    heavy = JobView("heavy", 1, submitted_at=0.0, attained_gpu_s=5000.0, last_resize_at=950.0)
    assert run("tiresias", cluster(lent={"n1": "heavy"}, jobs=[heavy, second]), now=1000.0) == []  # 50 s < min_run_s
    assert reclaims(run("tiresias", cluster(lent={"n1": "heavy"}, jobs=[heavy, second]), now=1100.0))


def test_tiresias_promotes_a_job_that_waited_starve_factor_times_its_run_to_the_first_queue():
    # "starved" ran 4000 GPU-s on 1 worker (queue 1), then waited since t=0; "runner" is in queue 1 too
    # but arrived earlier... and "fresh" ran 100 s (queue 0).
    starved = JobView("starved", 1, submitted_at=10.0, attained_gpu_s=4000.0, last_resize_at=0.0)
    runner = JobView("runner", 1, submitted_at=0.0, attained_gpu_s=5000.0, last_resize_at=0.0)
    policy = Tiresias(starve_factor=3.0)
    assert policy.queue(starved, 11_000.0, 0) == 1  # waited 11,000 s < 3 x 4,000
    assert policy.queue(starved, 12_000.0, 0) == 0  # waited 12,000 s: promoted
    assert policy.queue(starved, 12_000.0, 1) == 1  # running: no longer starving
    view = cluster(lent={"n1": "runner"}, jobs=[runner, starved])
    assert run("tiresias", view, now=11_000.0) == []
    assert reclaims(run("tiresias", view, now=12_000.0)) == [("n1", "runner", "tiresias: a higher queue")]
    assert run("tiresias", view, now=12_000.0, starve_factor=0.0) == []  # promotion off


def test_tiresias_gives_inference_the_lowest_priority_jobs_loans_first():
    low = JobView("low", 1, submitted_at=0.0, attained_gpu_s=50_000.0)
    high = JobView("high", 1, submitted_at=5.0)
    view = cluster(lent={"n1": "high", "n2": "low"}, jobs=[low, high], wanted=1)
    assert reclaims(run("tiresias", view)) == [("n2", "low", "inference demand")]


# ------------------------------------------------------------------ knapsack


def test_multiple_choice_knapsack_by_hand():
    # item 0: 1 worker worth 1, 2 worth 1.8, 3 worth 2.4; item 1: 1 worth 1, 2 worth 1.9. Four units:
    # (2, 2) = 3.7 beats (3, 1) = 3.4 and (1, 2) = 2.9.
    items = [[(1, 1.0), (2, 1.8), (3, 2.4)], [(1, 1.0), (2, 1.9)]]
    assert multiple_choice_knapsack(items, 4) == [1, 1]
    assert multiple_choice_knapsack(items, 3) == [0, 1]  # 2.9 against 2.8
    assert multiple_choice_knapsack(items, 1) is None  # both must have one


def test_knapsack_admits_waiting_jobs_with_one_worker_before_growing_any_job():
    a = JobView("a", 3, submitted_at=0.0, steps_per_s=linear(3), expected_steps=100_000, last_resize_at=0.0)
    b = JobView("b", 2, submitted_at=10.0, steps_per_s=linear(2), expected_steps=100_000)
    c = JobView("c", 2, submitted_at=20.0, steps_per_s=linear(2), expected_steps=100_000)
    decisions = run("knapsack", cluster(lent={"n1": "a", "n2": "a", "n3": "a"}, jobs=[a, b, c]))
    assert reclaims(decisions) == [("n1", "a", "knapsack"), ("n2", "a", "knapsack")]  # a keeps one
    assert lends(decisions) == []  # the freed devices are lent next round
    # a resized 30 s ago keeps its three (min_resize_interval_s 60): nothing to admit with.
    assert run("knapsack", cluster(lent={"n1": "a", "n2": "a", "n3": "a"}, jobs=[a, b, c]), now=30.0) == []


def test_knapsack_gives_a_spare_worker_where_it_brings_a_completion_nearest():
    near = JobView("near", 2, submitted_at=0.0, steps_per_s=linear(2), expected_steps=1_000)
    far = JobView("far", 2, submitted_at=1.0, steps_per_s=linear(2), expected_steps=100_000)
    decisions = run("knapsack", cluster(lent={"n1": "near", "n2": "far"}, free=("n3",), jobs=[near, far]))
    assert lends(decisions) == [("n3", "near")]
    # A worker that scales badly is worth less than one that scales well.
    flat = JobView("near", 2, submitted_at=0.0, steps_per_s={1: 1.0, 2: 1.01}, expected_steps=1_000)
    decisions = run("knapsack", cluster(lent={"n1": "near", "n2": "far"}, free=("n3",), jobs=[flat, far]))
    assert lends(decisions) == [("n3", "far")]


def test_knapsack_does_not_resize_a_job_for_less_than_the_resize_costs():
    nearly_done = JobView("j", 2, submitted_at=0.0, steps_per_s=linear(2), expected_steps=1_000, steps_done=980)
    view = cluster(lent={"n1": "j"}, free=("n2",), jobs=[nearly_done])
    assert run("knapsack", view) == []  # 20 s left on one worker; 10 s on two, plus a 15 s resize
    assert lends(run("knapsack", view, resize_s=5.0)) == [("n2", "j")]


def test_knapsack_gives_inference_the_loans_whose_loss_costs_least_and_a_jobs_last_worker_last():
    near = JobView("near", 2, submitted_at=0.0, steps_per_s=linear(2), expected_steps=1_000)
    far = JobView("far", 2, submitted_at=1.0, steps_per_s=linear(2), expected_steps=100_000)
    solo = JobView("solo", 1, submitted_at=2.0, steps_per_s=linear(1), expected_steps=10)
    view = cluster(lent={"a1": "near", "a2": "near", "b1": "far", "b2": "far", "c1": "solo"},
                   jobs=[near, far, solo], wanted=3)
    # near loses 500 s + a resize, far 50,000 s + a resize: near first, then far, which still trains
    # on one; a job's last worker only after that, the one that stalls the least work first.
    assert [r[0] for r in reclaims(run("knapsack", view))] == ["a1", "b1", "c1"]
    view = cluster(lent={"a1": "near", "a2": "near", "c1": "solo"}, jobs=[near, solo], wanted=2)
    assert [r[0] for r in reclaims(run("knapsack", view))] == ["a1", "c1"]  # solo: 10 s left; near: 1,000 s


# ------------------------------------------------------------------ deadline (Chronus)


def test_deadline_admits_an_slo_job_with_the_fewest_workers_that_meet_it_under_a_lease():
    slo = JobView("slo", 4, submitted_at=0.0, steps_per_s=linear(4), expected_steps=3_000, deadline=3_000.0)
    best = JobView("best", 4, submitted_at=0.0, steps_per_s=linear(4), expected_steps=50_000)
    view = cluster(free=("t1", "t2", "t3", "t4", "i1"), dedicated={"t1", "t2", "t3", "t4"}, jobs=[slo, best])
    decisions = run("deadline", view, now=0.0)
    # 3,000 steps by 2,700 s (10% margin): 1 worker needs 3,015 s with its start, 2 workers 1,515 s.
    slo_lends = [d for d in decisions if isinstance(d, Lend) and d.job == "slo"]
    assert [(d.node, d.lease_s) for d in slo_lends] == [("t1", 600.0), ("t2", 600.0)]  # on dedicated nodes
    assert lends(decisions)[2:] == [("i1", "best"), ("t3", "best"), ("t4", "best")]  # the rest, best effort first
    # An SLO job that cannot make its deadline is best effort: no lease.
    late = JobView("slo", 4, submitted_at=0.0, steps_per_s=linear(4), expected_steps=30_000, deadline=3_000.0)
    view = cluster(free=("t1", "t2", "t3", "t4", "i1"), dedicated={"t1", "t2", "t3", "t4"}, jobs=[late, best])
    assert all(d.lease_s is None for d in run("deadline", view, now=0.0) if isinstance(d, Lend))


def test_deadline_takes_best_effort_devices_for_an_slo_job_and_counts_only_dedicated_ones_as_guaranteed():
    slo = JobView("slo", 2, submitted_at=100.0, steps_per_s=linear(2), expected_steps=1_000, deadline=1_000.0)
    best = JobView("best", 2, submitted_at=0.0, steps_per_s=linear(2), expected_steps=90_000, last_resize_at=0.0)
    view = cluster(lent={"t1": "best", "t2": "best"}, dedicated={"t1", "t2"}, jobs=[slo, best])
    assert reclaims(run("deadline", view, now=100.0)) == [("t1", "best", "deadline"), ("t2", "best", "deadline")]
    # The best effort job on inference nodes, one dedicated device free: the SLO job needs two
    # guaranteed, so it is not admitted (no lease); it runs as best effort, shortest first.
    view = cluster(lent={"i1": "best", "i2": "best"}, free=("t9",), dedicated={"t9"}, jobs=[slo, best])
    decisions = run("deadline", view, now=100.0)
    assert lends(decisions) == [("t9", "slo")] and all(d.lease_s is None for d in decisions if isinstance(d, Lend))
    assert reclaims(decisions) == [("i1", "best", "deadline")]


def test_deadline_keeps_a_leased_jobs_devices_and_renews_the_lease_when_it_runs_out():
    slo = JobView("slo", 2, submitted_at=0.0, steps_per_s=linear(2), expected_steps=100, deadline=10_000.0,
                  lease_expires=700.0, last_resize_at=100.0)
    view = cluster(lent={"t1": "slo", "t2": "slo"}, dedicated={"t1", "t2"}, jobs=[slo])
    assert run("deadline", view, now=500.0) == []  # it needs one worker now, but its lease runs to 700
    renewed = run("deadline", view, now=800.0)
    assert reclaims(renewed) == [("t1", "slo", "deadline")]  # at renewal it keeps what it needs
    assert [d for d in renewed if isinstance(d, Renew)] == [Renew("t1", 0, "slo", 600.0)]


def test_deadline_gives_inference_best_effort_loans_first():
    slo = JobView("slo", 1, submitted_at=0.0, steps_per_s=linear(1), expected_steps=100, deadline=10_000.0)
    best = JobView("best", 1, submitted_at=0.0, steps_per_s=linear(1), expected_steps=100)
    view = cluster(lent={"i1": "slo", "i2": "best"}, jobs=[slo, best], wanted=1)
    assert reclaims(run("deadline", view)) == [("i2", "best", "inference demand")]


# ------------------------------------------------------------------ signals


def test_throughput_is_interpolated_between_measured_counts_and_scaled_linearly_beyond():
    job = JobView("j", 8, steps_per_s={2: 2.0, 4: 3.0})
    assert rates(job, 6) == [0.0, 1.0, 2.0, 2.5, 3.0, 3.75, 4.5]
    assert rates(JobView("j", 2), 2) == [0.0, 1.0, 2.0]  # nothing measured: one step per worker-second
    assert remaining_s(JobView("j", 2, steps_per_s={1: 2.0}, expected_steps=100, steps_done=40), 1, 0.0) == 30.0
    assert remaining_s(JobView("j", 2), 0, 3600.0) == float("inf")
    assert remaining_s(JobView("j", 2), 2, 3600.0) == 1800.0  # no length said: an hour on one worker


def test_fifo_and_tiresias_dataclasses_are_the_registered_policies():
    assert Fifo.name == "fifo" and Tiresias.name == "tiresias" and Knapsack.name == "knapsack" \
        and Deadline.name == "deadline"


def test_the_controller_and_the_simulator_carry_out_every_kind_of_decision():
    import typing

    from bench.cluster_engine import Simulation
    from nodeagent_ray.core import ControllerCore
    from nodeagent_ray.policy import Decision
    for cls in typing.get_args(Decision):
        assert callable(getattr(ControllerCore, f"_do_{cls.__name__.lower()}", None)), cls
        assert callable(getattr(Simulation, f"_do_{cls.__name__.lower()}", None)), cls


def test_the_controller_reads_leases_and_attained_service_from_the_nodes_and_renews_through_them():
    """Before: the daemon had no renewal, so the controller remembered the leases it granted and
    sent nothing (a restarted controller granted them again), and attained_gpu_s was always 0.
    Now both come from the nodes' inventories, and a renewal is the daemon's renew op."""
    from client_lib import protocol as p
    from nodeagent_ray.core import ControllerCore, CoreConfig

    def device(index, state="FREE", borrower=None, lent_until=None):
        return p.DeviceInventory(index=index, uuid=f"GPU-{index}", name="x", backend="cpu", memory_total_bytes=1,
                                 memory_used_bytes=None, utilization_percent=None, state=state, borrower=borrower,
                                 lent_until=lent_until, sessions=[],
                                 policy=p.PolicyInfo(quanta_ms={}, grace_ms=1.0, protect_s=1.0))

    class Nodes:
        nodes = ["n1", "n2"]
        event_gaps: dict = {}
        renewed: list = []
        lent: list = []

        def renew(self, node, dev, borrower, max_s):
            self.renewed.append((node, dev, borrower, max_s))
            return p.LifecycleReply(device=dev, state="LENT", borrower=borrower, changed=True,
                                    lent_until=1000.0 + max_s)

        def lend(self, node, dev, borrower, max_s=None, borrower_uids=None):
            assert borrower_uids == (os.getuid(),)  # the loan nodes' workers run as the controller's user
            self.lent.append((node, dev, borrower, max_s))
            return p.LifecycleReply(device=dev, state="LENT", borrower=borrower, changed=True)

    class Loans:
        def start(self, node, dev, job, uuid):
            raise RuntimeError("not here")

    nodes = Nodes()
    core = ControllerCore(nodes, loans=Loans(), jobs=None, wall=lambda: 1000.0, config=CoreConfig(lease_grace_s=30.0))
    core._job_views = {"slo": JobView("slo", 2), "own": JobView("own", 1, lease_expires=5.0, attained_gpu_s=7.0),
                       "best": JobView("best", 1)}
    core._inventory = {
        "n1": p.InventoryReply(node="n1", boot=1, attained_gpu_s={"slo": 100.0, "own": 1.0},
                               devices=[device(0, "LENT", "slo", 1630.0), device(1, "LENT", "best")]),
        "n2": p.InventoryReply(node="n2", boot=1, attained_gpu_s={"slo": 20.5},
                               devices=[device(0, "LENT", "slo", 1330.0), device(1, "LENT", "own", 99.0)])}
    jobs = core.view().jobs
    assert jobs["slo"].attained_gpu_s == 120.5 and jobs["slo"].lease_expires == 1600.0  # the latest lease, less grace
    assert jobs["best"].lease_expires is None and jobs["best"].attained_gpu_s == 0.0  # lent with no end: no lease
    assert (jobs["own"].lease_expires, jobs["own"].attained_gpu_s) == (5.0, 7.0)  # what a job reports wins
    core._do_renew(Renew("n2", 0, "slo", 600.0), None)
    assert nodes.renewed == [("n2", 0, "slo", 630.0)]  # the lease and its grace, on the daemon
    core._do_lend(Lend("n1", 2, "slo", lease_s=600.0), core.view())
    core._do_lend(Lend("n1", 3, "best"), core.view())
    assert nodes.lent == [("n1", 2, "slo", 630.0), ("n1", 3, "best", None)]
    core._dead.add("n1")  # a dead node's figures are not counted
    assert core.view().jobs["slo"].attained_gpu_s == 20.5
