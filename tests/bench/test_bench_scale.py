"""bench.scale runs end to end (50 sessions, a 1 s idle window) and reports what it promises."""

from __future__ import annotations

import json
import resource
import subprocess
import sys

import pytest

from tests.conftest import REPO


@pytest.mark.slow
def test_scale_bench_reports_idle_cost_status_handoffs_and_scheduler_steps():
    out = subprocess.run([sys.executable, "-m", "bench.scale", "--json", "--sessions", "50", "--idle-s", "1",
                          "--procs", "3", "--handoffs", "200", "--cycles", "1", "--status-repeats", "3",
                          "--scheduler-samples", "30"],
                         capture_output=True, text=True, timeout=120, cwd=REPO, check=False)
    assert out.returncode == 0, out.stderr
    r = json.loads(out.stdout)
    assert r["benchmark"] == "scale" and r["sessions"] == r["sessions_attached"] == 50
    assert r["holder_processes"] == 3 and r["sessions_per_process"] == [17, 17, 16]
    assert r["sessions_listed"] >= 52  # the idle ones and the two handing off, all in one status
    assert r["attach_errors"] == []
    assert 0.9 <= r["idle_s"] < 3
    for key in ("idle_cpu_percent", "idle_cpu_percent_empty", "clients_idle_cpu_percent", "idle_wakeups_per_s"):
        assert r[key] is not None and r[key] >= 0, key
    assert r["rss_after_kb"] > 0 and r["rss_per_session_kb"] == pytest.approx(
        (r["rss_after_kb"] - r["rss_before_kb"]) / 50, abs=0.01)
    assert r["fds_per_session"] >= 1  # at least its connection
    assert r["status_ms"] > 0 and r["status_ms_empty"] > 0
    assert r["status_breakdown"]["reply_bytes"] > 50 * 50  # 50 sessions listed
    for key in ("handoff_empty_p50_us", "handoff_empty_p99_us", "handoff_idle_p50_us", "handoff_idle_p99_us",
                "handoff_idle_over_empty_p50", "handoff_idle_over_empty_p99"):
        assert r[key] > 0, key
    assert r["handoff_samples_idle"] >= 200 and r["handoff_samples_empty"] >= 400  # one idle block, two empty
    assert r["handoff_idle_over_empty_p99"] == pytest.approx(
        r["handoff_idle_p99_us"] / r["handoff_empty_p99_us"], rel=0.01)
    assert r["statuses_during_block"] >= 1 and r["handoff_status_p99_us"] > 0  # a block beside statuses
    assert r["handoff_status_over_idle_p99"] == pytest.approx(r["handoff_status_p99_us"] / r["handoff_idle_p99_us"],
                                                              rel=0.01)
    assert set(r["scheduler_step_us"]) == {"10", "1000", "10000"}
    assert all(v > 0 for v in r["scheduler_step_us"].values())
    assert r["scheduler"]["10000"]["waiting"] == 10000
    goals = {g["goal"]: g for g in r["goals"]}
    assert goals["idle_cpu_percent < 1"]["value"] == r["idle_cpu_percent"]
    assert goals["idle_cpu_percent < 1"]["met"] == (r["idle_cpu_percent"] < 1)
    assert goals["handoff_idle_over_empty_p50 <= 1.1"]["met"] == (r["handoff_idle_over_empty_p50"] <= 1.1)
    assert r["all_goals_met"] == all(g["met"] for g in r["goals"])


def test_idle_sessions_are_split_over_enough_processes_for_their_descriptors():
    from bench.scale import holder_processes, split

    assert holder_processes(1000, 5, 20000) == 5
    assert holder_processes(1000, 5, 1024) == 5  # 200 Clients each fit under 1024
    assert holder_processes(1000, 1, 1024) == 2  # one process could not hold 1000
    assert holder_processes(1000, 2, 164) == 10  # 100 per process, 64 kept spare
    assert holder_processes(3, 5, 20000) == 3  # never a process without a session
    assert holder_processes(1000, 1, resource.RLIM_INFINITY) == 1
    assert split(1000, 3) == [334, 333, 333] and sum(split(7, 7)) == 7
