"""The controller's decisions (nodeagent_ray.policy), stepped by hand: no Ray, no sockets, no clock."""

from __future__ import annotations

import pytest

from nodeagent_ray.policy import (ClusterView, DeviceView, JobView, Lend, LoanView, NodeView, PolicyConfig, Reclaim,
                                  ReclaimCost, Release, Resume, SessionCount, Then, WriteOff, choose_reclaims, decide,
                                  reclaim_cost)


def dev(node: str, state: str = "FREE", *, index: int = 0, borrower: str | None = None, inference: int = 0,
        **training: tuple[int, int]) -> DeviceView:
    return DeviceView(node, index, state, borrower, inference,
                      {job.replace("_", "-"): SessionCount(*counts) for job, counts in training.items()})


def view(*devices: DeviceView, loans=(), jobs=None, dead=(), unknown=(), wanted: int = 0) -> ClusterView:
    nodes: dict[str, list[DeviceView]] = {}
    for d in devices:
        nodes.setdefault(d.node, []).append(d)
    for name in dead:
        nodes.setdefault(name, [])
    return ClusterView(
        nodes={n: NodeView(n, alive=n not in dead, devices=tuple(ds), loans_known=n not in unknown)
               for n, ds in nodes.items()},
        loans={(loan.node, loan.device): loan for loan in loans},
        jobs=jobs if jobs is None else {j.name: j for j in jobs}, inference_wanted=wanted)


JOB = JobView("job-7", max_workers=3)


def test_free_devices_are_lent_and_never_run_protect_draining_or_another_borrowers():
    v = view(dev("n1", "RUN", inference=1), dev("n2", "PROTECT"), dev("n3"), dev("n4", "DRAINING"),
             dev("n5", "LENT", borrower="someone-else"), dev("n6", "FREE", inference=1), jobs=[JOB])
    assert decide(v, 0.0) == [Lend("n3", 0, "job-7")]


def test_nothing_is_lent_while_the_jobs_are_unknown_or_want_no_more():
    assert decide(view(dev("n1"), dev("n2"), jobs=None), 0.0) == []
    full = JobView("job-7", max_workers=1)
    loans = [LoanView("n1", 0, "job-7")]
    assert decide(view(dev("n1", "LENT", borrower="job-7", job_7=(1, 0)), dev("n2"), loans=loans, jobs=[full]),
                  0.0) == []


def test_each_free_device_goes_to_the_job_furthest_below_its_max_workers():
    a, b = JobView("a", max_workers=2), JobView("b", max_workers=3)
    loans = [LoanView("n1", 0, "b")]
    v = view(dev("n1", "LENT", borrower="b", b=(1, 0)), dev("n2"), dev("n3"), dev("n4"), loans=loans, jobs=[a, b])
    # b holds 1 of 3 (2 short), a 0 of 2 (2 short): a by name, then b (2 short) before a (1 short), then a.
    assert decide(v, 0.0) == [Lend("n2", 0, "a"), Lend("n3", 0, "b"), Lend("n4", 0, "a")]


def test_inference_joining_a_lent_device_reclaims_it_and_the_job_shrinks_when_it_has_other_workers():
    loans = [LoanView("n2", 0, "job-7"), LoanView("n3", 0, "job-7")]
    v = view(dev("n2", "LENT", borrower="job-7", inference=1, job_7=(1, 0)),
             dev("n3", "LENT", borrower="job-7", job_7=(1, 0)), loans=loans, jobs=[JOB])
    assert decide(v, 0.0) == [Reclaim("n2", 0, "job-7", Then.RELEASE, "inference session")]


def test_the_last_running_worker_of_a_job_is_parked_not_released():
    loans = [LoanView("n3", 0, "job-7")]
    v = view(dev("n3", "LENT", borrower="job-7", inference=1, job_7=(1, 0)), loans=loans, jobs=[JOB])
    assert decide(v, 0.0) == [Reclaim("n3", 0, "job-7", Then.PARK, "inference session")]
    # Both of a job's devices wanted at once: the first goes (the second still trains), the second parks.
    loans = [LoanView("n2", 0, "job-7"), LoanView("n3", 0, "job-7")]
    v = view(dev("n2", "LENT", borrower="job-7", inference=1, job_7=(1, 0)),
             dev("n3", "LENT", borrower="job-7", inference=1, job_7=(1, 0)), loans=loans, jobs=[JOB])
    assert decide(v, 0.0) == [Reclaim("n2", 0, "job-7", Then.RELEASE, "inference session"),
                              Reclaim("n3", 0, "job-7", Then.PARK, "inference session")]


def test_a_serving_layers_demand_takes_the_cheapest_loans_first():
    big = JobView("big", max_workers=4, steps_since_checkpoint=500)
    fresh = JobView("fresh", max_workers=4, steps_since_checkpoint=3)
    solo = JobView("solo", max_workers=1)
    loans = [LoanView("a1", 0, "big"), LoanView("a2", 0, "big"), LoanView("b1", 0, "fresh"),
             LoanView("b2", 0, "fresh"), LoanView("c1", 0, "solo")]
    v = view(dev("a1", "LENT", borrower="big", big=(2, 0)), dev("a2", "LENT", borrower="big", big=(1, 0)),
             dev("b1", "LENT", borrower="fresh", fresh=(1, 0)), dev("b2", "LENT", borrower="fresh", fresh=(1, 0)),
             dev("c1", "LENT", borrower="solo", solo=(1, 0)), loans=loans, jobs=[big, fresh, solo], wanted=3)
    costs = {loan.node: reclaim_cost(v, loan) for loan in loans}
    assert costs["c1"] == ReclaimCost(stalls_job=True, workers_lost=1, steps_since_checkpoint=0)
    assert costs["a1"] == ReclaimCost(False, 2, 500) and costs["b1"] == ReclaimCost(False, 1, 3)
    # Not stalling a job first, then the fewest workers lost, then the least progress to redo.
    assert [loan.node for loan in choose_reclaims(v, 5)] == ["b1", "b2", "a2", "a1", "c1"]
    reclaims = [d for d in decide(v, 0.0) if isinstance(d, Reclaim)]
    assert [(d.node, d.then, d.reason) for d in reclaims] == [
        ("b1", Then.RELEASE, "inference demand"), ("b2", Then.PARK, "inference demand"),
        ("a2", Then.RELEASE, "inference demand")]


def test_a_parked_loan_resumes_in_process_when_its_device_is_free_again():
    loans = [LoanView("n3", 0, "job-7", since=100.0)]
    parked = dev("n3", "PROTECT", job_7=(0, 1))
    assert decide(view(parked, loans=loans, jobs=[JOB]), 110.0) == []  # waits out the protect window
    busy = dev("n3", "RUN", inference=1, job_7=(0, 1))
    assert decide(view(busy, loans=loans, jobs=[JOB]), 110.0) == []
    free = dev("n3", "FREE", job_7=(0, 1))
    assert decide(view(free, loans=loans, jobs=[JOB]), 110.0) == [Resume("n3", 0, "job-7")]


def test_a_parked_loan_is_released_when_it_waited_too_long_or_another_device_is_free():
    loans = [LoanView("n3", 0, "job-7", since=100.0)]
    parked = dev("n3", "RUN", inference=1, job_7=(0, 1))
    cfg = PolicyConfig(park_max_s=60.0)
    assert decide(view(parked, loans=loans, jobs=[JOB]), 161.0, cfg) == [
        Release("n3", 0, "job-7", "parked longer than 60s")]
    # Another device free now: the job restarts there from its handed-off state rather than wait.
    assert decide(view(parked, dev("n2"), loans=loans, jobs=[JOB]), 110.0, cfg) == [
        Release("n3", 0, "job-7", "another device is free"), Lend("n2", 0, "job-7")]


def test_stale_loans_and_loans_of_jobs_that_are_gone_are_given_back():
    loans = [LoanView("n1", 0, "job-7"), LoanView("n2", 0, "gone"), LoanView("n3", 0, "gone")]
    v = view(dev("n1", "PROTECT"), dev("n2", "LENT", borrower="gone", gone=(1, 0)), dev("n3", "FREE", gone=(0, 1)),
             loans=loans, jobs=[JOB])
    assert decide(v, 0.0) == [Reclaim("n2", 0, "gone", Then.RELEASE, "job gone"),
                              Release("n1", 0, "job-7", "device not lent"), Release("n3", 0, "gone", "job gone")]
    # Jobs unknown this round (their registry did not answer): no loan is taken for its job being gone.
    assert decide(view(dev("n2", "LENT", borrower="gone", gone=(1, 0)), loans=loans[1:2], jobs=None), 0.0) == []


def test_a_dead_nodes_loans_are_written_off_and_the_others_untouched():
    loans = [LoanView("n2", 0, "job-7"), LoanView("n2", 1, "job-7"), LoanView("n3", 0, "job-7")]
    v = view(dev("n3", "LENT", borrower="job-7", job_7=(1, 0)), dev("n1"), loans=loans, jobs=[JOB], dead=["n2"])
    assert decide(v, 0.0) == [WriteOff("n2", ((0, "job-7"), (1, "job-7"))), Lend("n1", 0, "job-7")]


def test_a_restarted_controller_decides_the_same_from_the_same_view_and_finishes_a_half_done_lend():
    loans = [LoanView("n2", 0, "job-7")]
    v = view(dev("n2", "LENT", borrower="job-7", job_7=(1, 0)), dev("n3", "LENT", borrower="job-7"),
             dev("n1", "RUN", inference=1), loans=loans, jobs=[JOB])
    first = decide(v, 0.0)
    assert first == [Lend("n3", 0, "job-7", "lent without a loan node")]
    assert decide(v, 0.0) == first
    # Once the loan node is there, nothing more: no second lend of the same device.
    done = view(dev("n2", "LENT", borrower="job-7", job_7=(1, 0)), dev("n3", "LENT", borrower="job-7"),
                dev("n1", "RUN", inference=1), loans=loans + [LoanView("n3", 0, "job-7")], jobs=[JOB])
    assert decide(done, 0.0) == []


def test_nothing_is_started_or_stopped_on_a_node_whose_loan_nodes_are_unknown():
    v = view(dev("n2"), dev("n3", "PROTECT"), loans=[LoanView("n3", 0, "job-7")], jobs=[JOB], unknown=["n2", "n3"])
    assert decide(v, 0.0) == []


def test_park_max_s_is_checked():
    with pytest.raises(ValueError, match="park_max_s"):
        PolicyConfig(park_max_s=-1)
