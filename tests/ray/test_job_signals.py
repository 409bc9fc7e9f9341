"""The per-job signals a job's tracker reports to the policies (nodeagent_ray.jobsignals, and
JobTracker.view through RayJobs), stepped by hand: times passed in."""

from __future__ import annotations

import pytest

from nodeagent_ray.jobsignals import JobSignals


def test_steps_per_second_is_measured_per_worker_count_and_never_across_a_restart_or_a_park():
    s = JobSignals(created_at=100.0, expected_steps=1_000, deadline=5_000.0, smoothing=0.5)
    s.group_started(1, 0, now=110.0)
    assert s.last_resize_at == 110.0 and s.steps_per_s == {}
    s.step_done(1, 1, now=111.0)  # the first report of a group: nothing to pair it with
    s.step_done(3, 1, now=112.0)  # 2 steps in 1 s
    s.step_done(4, 1, now=113.0)  # 1 step in 1 s: smoothed 2 + 0.5 x (1 - 2)
    assert s.steps_per_s == {1: 1.5}
    s.paused()
    s.step_done(5, 1, now=200.0)  # after a park: not 1 step in 87 s
    assert s.steps_per_s == {1: 1.5}
    s.group_started(2, 5, now=230.0)  # grown to two: the restart's 30 s is not a rate either
    s.step_done(6, 2, now=240.0)
    s.step_done(10, 2, now=241.0)
    assert s.steps_per_s == {1: 1.5, 2: 4.0} and s.last_resize_at == 230.0
    s.step_done(11, 2, now=242.0)
    assert s.view_fields() == {"submitted_at": 100.0, "steps_per_s": {1: 1.5, 2: 2.5}, "steps_done": 11,
                               "expected_steps": 1_000, "deadline": 5_000.0, "last_resize_at": 230.0}
    s.stopped(now=300.0)
    assert s.last_resize_at == 300.0 and s.world_size == 0


def test_a_world_size_learned_from_a_step_report_is_a_resize_and_a_resumed_group_counts_from_its_state():
    s = JobSignals(created_at=0.0)
    s.group_started(2, 0, now=1.0)
    s.step_done(50, 2, now=10.0)
    s.step_done(40, 3, now=20.0)  # a group of 3 that resumed from step 40 reports before started() did
    assert s.last_resize_at == 20.0 and s.world_size == 3
    s.group_started(3, 40, now=21.0)
    assert s.steps_done == 40 and s.last_resize_at == 20.0  # same size: not a second resize


def test_what_a_job_says_at_creation_is_checked():
    with pytest.raises(ValueError, match="expected_steps"):
        JobSignals(created_at=0.0, expected_steps=0)
    with pytest.raises(ValueError, match="deadline"):
        JobSignals(created_at=0.0, deadline=float("nan"))


def test_the_tracker_reports_its_signals_and_the_controller_reads_them_into_a_jobview():
    pytest.importorskip("ray")
    from nodeagent_ray.actors import JobTracker, job_view
    job = JobTracker("job-7", max_workers=3, expected_steps=500, deadline=1e12)
    job.started(world_size=2, resumed_from=0, pid_of_rank0=1)
    for step in range(1, 5):
        job.step_done(step, 2)
    view = job_view(job.view())
    assert (view.name, view.max_workers, view.expected_steps, view.deadline, view.steps_done) == \
        ("job-7", 3, 500, 1e12, 4)
    assert set(view.steps_per_s) == {2} and view.steps_per_s[2] > 0 and view.last_resize_at is not None
    # A tracker of an older release reports no signals: they stay unknown.
    old = job_view({"name": "old", "max_workers": 1, "steps_since_checkpoint": 3, "finished": False})
    assert (old.steps_per_s, old.expected_steps, old.submitted_at) == ({}, None, None)
